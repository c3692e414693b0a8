"""The model runner: turns a scheduled step into one forward pass and sampled tokens.

All torch work of the engine happens here. A step's rows are flattened into one varlen batch —
``input_ids``, ``positions``, ``slot_mapping`` of ``T`` tokens; ``query_start_loc``,
``seq_lens``, ``block_tables`` of ``S`` rows — the model runs once, and logits are computed only
for the last token of each row that samples.

Tensor parallelism (:mod:`.tp_shards`, :mod:`.collectives`): every rank has a runner over its
shard and its own KV cache (its KV heads, the same number of blocks everywhere). Rank 0's runner
lives in the engine core: it builds each step's arrays, broadcasts them (a header of sizes, then
the two input buffers), runs its shard and samples from the gathered logits. The other ranks'
runners sit in :meth:`ModelRunner.serve_worker`, running the steps they receive until told to stop.
Block tables, scheduling and prefix caching exist once, on rank 0: a worker sees only arrays.
"""

from __future__ import annotations

import logging
import random
import threading
import warnings

import torch

from cadenza.node.runner.backend import AttentionMetadata, select_backend
from cadenza.node.core.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from cadenza.node.runner.models.config import ModelConfig
from cadenza.node.runner.models.llama import load_model
from cadenza.node.runner.sampler import apply_token_bitmask, sample, sampling_tensors, token_logprobs
from cadenza.node.core.step import SchedulerOutput
from cadenza.node.runner.collectives import Collectives, TensorParallelError
from cadenza.node.runner.cuda_graphs import DEFAULT_MEMORY_BUDGET, StepGraphs, graph_shapes
from cadenza.node.runner.step_inputs import InputBuffers, Layout, StepRows, step_rows
from cadenza.node.runner.tp_shards import ShardPlan

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CPU_DEFAULT_KV_BYTES = 1 << 30
# What rank 0 broadcasts: an eager step, the end, a step replayed from a captured graph, a capture of
# the step graphs, a read and a write of KV blocks (KV transfer).
OP_STEP, OP_STOP, OP_GRAPH, OP_CAPTURE, OP_READ_KV, OP_WRITE_KV = 1, 2, 3, 4, 5, 6
_NO_LAYOUT = Layout(0, 0, 0, 0)


def rank_device(device: str, rank: int) -> torch.device:
    """The device of tensor-parallel ``rank`` for the configured ``device``: the CPU for every rank,
    else the ``rank``-th GPU from the configured one (``cuda`` is ``cuda:0``)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    return torch.device(dev.type, (dev.index or 0) + rank)


class ModelRunner:
    """Owns the model weights, the paged KV cache and per-request sampling seeds.

    Args:
        config: the engine configuration (model path, dtype, device, cache size).
        model_config: the model's shape.
        max_model_len: resolved longest sequence (sizes the RoPE table).
        weights_seed: draw the weights from this seed instead of loading them
            (:func:`~cadenza.node.runner.models.llama.random_weights`; benchmarks of a model's
            shapes without its files). None: load ``config.model``'s safetensors.
        collectives: this rank's collectives when ``config.tensor_parallel_size > 1`` (rank 0 in
            the engine core, the others in :meth:`serve_worker`); None at size 1.

    Raises:
        ConfigError: a tensor-parallel size the model does not split over, or collectives of
            another size; a KV cache that cannot be allocated.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 weights_seed: int | None = None, collectives: Collectives | None = None) -> None:
        size = config.tensor_parallel_size
        if (collectives.size if collectives is not None else 1) != size:
            raise ConfigError("tensor_parallel_size", f"{size} ranks configured, collectives of "
                                                      f"{collectives.size if collectives else 1} given")
        self.collectives = collectives if size > 1 else None
        # Rank 0 issues one sequence of collectives at a time: steps on the engine thread, KV reads
        # for a peer on the KV transfer thread (every rank must see the ops in one order).
        self._ops = threading.Lock()
        self._workers_in_step = False  # rank 0 has told the workers of the step it runs (execute)
        self.rank = collectives.rank if self.collectives is not None else 0
        self.plan = ShardPlan.of(model_config, self.rank, size)
        self.device = rank_device(config.device, self.rank)
        self.dtype = _DTYPES[config.dtype] if config.dtype != "auto" else (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model_config = model_config
        self.block_size = config.cache.block_size
        self.backend = select_backend(config.attention_backend, self.device, self.dtype)
        self.model = load_model(config.model, model_config, self.backend, max_model_len, self.dtype, self.device,
                                weights_seed, self.plan, self.collectives)
        self.max_model_len = max_model_len
        self._capture = config.cuda_graphs and self.device.type == "cuda" and self.backend.name == "triton"
        # the fewest KV blocks any rank holds (GPUs' free memory differs): rank 0's block manager
        # hands out block ids every rank must have
        self.num_kv_blocks = self._least(self._num_kv_blocks(config.cache))
        # One block more than the block manager hands out: the scratch block padding tokens write to.
        self.scratch_block = self.num_kv_blocks
        shape = (model_config.num_hidden_layers, 2, self.num_kv_blocks + 1, self.block_size,
                 self.plan.num_kv_heads, model_config.head_dim)
        try:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise ConfigError(
                "kv_cache_bytes", f"cannot allocate a KV cache of {self.num_kv_blocks} blocks on "
                f"{self.device} ({exc}); lower the KV cache size"
            ) from None
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self._seeds = random.Random(config.seed)
        self._seeds_of: dict[str, int] = {}
        self.inputs = InputBuffers(self.device, 4096, 4096)
        self.graphs: StepGraphs | None = None
        self.last_step_graphed = False  # whether the last step replayed a graph
        # request id -> its sampled token's logprobs entry (sampler.token_logprobs), for the
        # requests of the last step that asked; the engine core takes it after each step
        self.last_logprobs: dict[str, list] = {}
        logger.info(
            "model loaded: %s, %d layers, %s on %s%s; KV cache %d blocks x %d tokens (%.1f MiB), attention=%s",
            model_config.architecture, model_config.num_hidden_layers, self.dtype, self.device,
            f" (tensor-parallel rank {self.rank} of {size})" if size > 1 else "",
            self.num_kv_blocks, self.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
            self.backend.name,
        )
        if self._capture and self.rank == 0:  # workers capture when rank 0 says (serve_worker), in step
            self.capture_graphs(config.scheduler)
        elif config.cuda_graphs and self.device.type == "cuda":  # the torch reference reads device values on the host
            logger.info("CUDA graphs need the triton backend; every step runs eagerly on %s", self.backend.name)

    def _num_kv_blocks(self, cache: CacheConfig) -> int:
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        mc = self.model_config  # this rank's KV heads only
        per_block = 2 * mc.num_hidden_layers * self.plan.num_kv_heads * mc.head_dim * (
            torch.finfo(self.dtype).bits // 8) * self.block_size
        if cache.kv_cache_bytes is not None:
            budget = cache.kv_cache_bytes
        elif self.device.type == "cuda":  # the graphs' memory pool comes out of the free memory first
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(max(0, free - (DEFAULT_MEMORY_BUDGET if self._capture else 0)) * cache.kv_cache_fraction)
        else:
            budget = _CPU_DEFAULT_KV_BYTES
        if cache.kv_cache_bytes is not None or self.device.type == "cpu":
            budget //= self.plan.size  # a replica's bytes, shared by its ranks (a GPU's fraction is its own)
        return max(1, budget // per_block)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, masks=None) -> list[int]:
        """Run one step; return one sampled token per row with ``sample`` set, in row order.

        ``masks``: the grammar masks of the step's structured rows, being computed while the
        forward runs (a :class:`~cadenza.node.engine.grammar.StepMasks`: ``rows`` and
        ``result()``); taken once the logits exist and applied before sampling.

        The step is replayed from a captured CUDA graph when one holds it (:attr:`graphs`), and
        run eagerly otherwise; either way its inputs are built by :mod:`.step_inputs` (vectorised
        numpy into persistent buffers, two copies to the device) and logits are computed only for
        the rows that sample.

        Raises:
            TensorParallelError: a rank is gone, or rank 0 failed once the workers had begun the
                step (the collectives are then aborted: the replica cannot step again). A failure
                before that raises as it is, the ranks still in step.
        """
        with self._ops:
            if self.collectives is None:
                return self._execute(step, masks)
            self._workers_in_step = False
            try:
                return self._execute(step, masks)
            except TensorParallelError:
                raise
            except Exception as exc:
                if not self._workers_in_step:  # failed before the workers heard of it: still in step
                    raise
                # The workers wait in this step's next collective, which rank 0 will never issue: its
                # next op would be read as that one (garbage sums, headers of any size). Fatal.
                self.collectives.abort()
                raise TensorParallelError(f"rank 0 failed in the middle of a step ({type(exc).__name__}: "
                                          f"{exc}); the ranks are out of step") from exc

    def _execute(self, step: SchedulerOutput, masks=None) -> list[int]:
        rows = step_rows(step)
        if self.graphs is None:
            hidden = None
        else:  # at tensor-parallel size > 1 the workers replay the same graph (_announce)
            hidden = self.graphs.run(rows) if self.collectives is None else self.graphs.run(rows, self._announce)
        self.last_step_graphed = hidden is not None
        if hidden is None:
            hidden = self._run_eager(rows)
        if not rows.sampled:
            self._workers_in_step = False
            return []
        logits = self.model.compute_logits(hidden)  # gathered here from every rank
        self._workers_in_step = False  # the step's last collective
        params = [req.sampling for req in rows.sampled_requests]
        seeds = [0 if sp.greedy else self._seed(req.request_id, sp.seed)
                 for req, sp in zip(rows.sampled_requests, params)]
        # a row samples the token after its last: decode at p samples p + 1, a chunk [s, s + n) samples s + n
        st = sampling_tensors(params, seeds, rows.sample_positions, self.device, pinned=self.device.type == "cuda")
        if masks is not None:
            apply_token_bitmask(logits, masks.rows, masks.result())
        tokens = sample(logits, st)
        asking = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        if asking:  # only steps with a request that asked pay for them (a second read of the device)
            entries = token_logprobs(logits, tokens, asking, [params[i].logprobs for i in asking])
            self.last_logprobs = {rows.sampled_requests[i].request_id: e for i, e in zip(asking, entries)}
        return tokens.tolist()  # the step's one read of the device

    def _run_eager(self, rows: StepRows) -> torch.Tensor:
        """The hidden states ``[len(rows.sampled), H]`` of the sampled rows' last tokens, the step
        run op by op."""
        layout = Layout(rows.num_tokens, len(rows.sampled), rows.num_rows, max(map(len, rows.tables)))
        views = self.inputs.prepare(rows, layout, self.block_size, self.scratch_block)
        max_seq_len = int((rows.starts + rows.counts).max())
        if self.collectives is not None:  # the workers run the same step on their shards
            self._send(OP_STEP, layout, rows.max_query_len, max_seq_len)
        return self._forward(views, rows.max_query_len, max_seq_len)

    def _tell(self, op: int, *fields: int) -> None:
        """Rank 0: broadcast an op's header, ``op`` and up to 7 fields (the workers read 8)."""
        self.collectives.broadcast(torch.tensor([op, *fields, *[0] * (7 - len(fields))], dtype=torch.int64))

    def _send_inputs(self, inputs: InputBuffers, layout: Layout) -> None:
        """Rank 0: broadcast a step's two filled host input buffers (``layout``'s parts)."""
        self.collectives.broadcast(inputs.host64[: layout.int64_size])
        self.collectives.broadcast(inputs.host32[: layout.int32_size])

    def _send(self, op: int, layout: Layout = _NO_LAYOUT, max_query_len: int = 0, max_seq_len: int = 0):
        """Rank 0: broadcast an eager step's header and inputs (or the end)."""
        self._workers_in_step = op == OP_STEP
        self._tell(op, *layout, max_query_len, max_seq_len)
        if op == OP_STEP:
            self._send_inputs(self.inputs, layout)

    def _announce(self, index: int, num_sampled: int, layout: Layout) -> None:
        """Rank 0, before it replays a step graph: the workers replay the same one on these inputs."""
        self._workers_in_step = True
        self._tell(OP_GRAPH, index, num_sampled, *layout)
        self._send_inputs(self.graphs.inputs, layout)

    def _least(self, value: int) -> int:
        """The least of every rank's ``value`` (the value itself without tensor parallelism)."""
        if self.collectives is None:
            return value
        host = self.collectives.host
        values = host.gather(torch.tensor([value], dtype=torch.int64))
        least = torch.tensor([min(int(v) for v in values) if values is not None else 0], dtype=torch.int64)
        return int(host.broadcast(least))

    @torch.inference_mode()
    def serve_worker(self) -> None:
        """A tensor-parallel worker (rank > 0): run every step rank 0 broadcasts, on this rank's
        shard, until it broadcasts the end.

        Raises:
            TensorParallelError: a rank is gone (the worker's process then exits).
        """
        if self.rank == 0:
            raise RuntimeError("rank 0 drives the steps (execute); serve_worker is for the other ranks")
        header = torch.zeros(8, dtype=torch.int64)
        bcast = self.collectives.broadcast
        while True:
            op, *args = bcast(header).tolist()
            if op == OP_STOP:
                return
            if op == OP_CAPTURE:
                max_num_seqs, token_budget, chunk, mixed, eager, budget_mib, _ = args
                sizes = SchedulerConfig(token_budget=token_budget, chunk_size=chunk, max_num_seqs=max_num_seqs)
                self.capture_graphs(sizes, "eager" if eager else "cuda", bool(mixed), budget_mib << 20)
                continue
            if op == OP_GRAPH:
                index, num_sampled, *sizes = args[:6]
                layout = Layout(*sizes)
                hidden = self.graphs.replay(index, num_sampled, lambda host64, host32, n64=layout.int64_size,
                                            n32=layout.int32_size: (bcast(host64[:n64]), bcast(host32[:n32])))
                if num_sampled:
                    self.model.compute_logits(hidden)
                continue
            if op in (OP_READ_KV, OP_WRITE_KV):
                ids = bcast(torch.zeros(args[0], dtype=torch.int64))
                if op == OP_READ_KV:
                    self.collectives.gather(self._local_blocks(ids))  # to rank 0, which sends them
                else:
                    self._write_local(ids, bcast(torch.empty(args[0] * self._full_block_bytes, dtype=torch.uint8)))
                continue
            tokens, logits, rows, width, max_query_len, max_seq_len, _ = args
            layout = Layout(tokens, logits, rows, width)
            views = self.inputs.load(layout, lambda host64, host32, n64=layout.int64_size, n32=layout.int32_size: (
                bcast(host64[:n64]), bcast(host32[:n32])))
            hidden = self._forward(views, max_query_len, max_seq_len)
            if logits:
                self.model.compute_logits(hidden)  # this rank's vocabulary slice, gathered on rank 0

    def stop_workers(self) -> None:
        """Rank 0: tell the workers to leave :meth:`serve_worker` (their processes then exit)."""
        if self.collectives is not None and self.rank == 0:
            with self._ops:
                self._send(OP_STOP)

    def _forward(self, views: tuple, max_query_len: int, max_seq_len: int) -> torch.Tensor:
        """The model on a step's device views (:meth:`.step_inputs.InputBuffers.views`): the final
        hidden states of the tokens ``logits_index`` names. Reads no device value on the host, so
        a CUDA graph can record it."""
        input_ids, positions, slot_mapping, logits_index, query_start_loc, seq_lens, block_tables = views
        meta = AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens,
                                 block_tables=block_tables, max_query_len=max_query_len, max_seq_len=max_seq_len)
        return self.model(input_ids, positions, self.kv_caches, meta)[logits_index]

    @torch.inference_mode()
    def capture_graphs(self, scheduler: SchedulerConfig, record: str = "cuda", mixed: bool = True,
                       memory_budget: int = DEFAULT_MEMORY_BUDGET) -> None:
        """Capture the step graphs for ``scheduler``'s sizes (:mod:`.cuda_graphs`); later steps a
        graph holds replay it. ``record="eager"`` runs everything but the capture (CPU tests)."""
        with self._ops:  # a capture is a sequence of collectives at tensor-parallel size > 1
            self._capture_graphs(scheduler, record, mixed, memory_budget)

    def _capture_graphs(self, scheduler: SchedulerConfig, record: str, mixed: bool, memory_budget: int) -> None:
        if self.collectives is not None and self.rank == 0:  # every rank captures the same shapes, in step
            self._tell(OP_CAPTURE, scheduler.max_num_seqs, scheduler.token_budget, scheduler.effective_chunk_size,
                       int(mixed), int(record == "eager"), memory_budget >> 20)
        shapes = graph_shapes(scheduler.max_num_seqs, scheduler.token_budget, scheduler.effective_chunk_size,
                              self.max_model_len, mixed)
        width = -(-self.max_model_len // self.block_size)
        graphs = StepGraphs(self.device, self.block_size, self.scratch_block, width, shapes, memory_budget, record)
        graphs.capture(lambda views, shape: self._forward(views, shape.max_query_len, self.max_model_len),
                       self._least if self.collectives is not None else None)
        self.graphs = graphs

    def _seed(self, request_id: str, seed: int | None) -> int:
        """The request's own seed, else one drawn from the engine's seed at its first sampled row."""
        if request_id not in self._seeds_of:
            self._seeds_of[request_id] = self._seeds.getrandbits(63) if seed is None else seed
        return self._seeds_of[request_id]

    def read_kv_blocks(self, block_ids: list[int]) -> memoryview:
        """The KV of ``block_ids`` as raw bytes, block after block, each ``[L, 2, BS, Hkv, D]``
        (every layer's K then V, every KV head of the model): the KV transfer's payload layout,
        whatever the tensor-parallel size (rank 0 gathers the other ranks' heads). Safe to call
        from another thread than the steps'."""
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        with self._ops:
            if self.collectives is None:
                blocks = self._local_blocks(ids)
            else:
                self._tell(OP_READ_KV, len(block_ids))
                self.collectives.broadcast(ids)
                blocks = self._all_heads(self.collectives.gather(self._local_blocks(ids)))
        return memoryview(blocks.cpu().view(torch.uint8).reshape(-1).numpy()).cast("B")

    def _local_blocks(self, ids: torch.Tensor) -> torch.Tensor:
        """``[n, L, 2, BS, this rank's KV heads, D]`` of the blocks ``ids``."""
        return self.kv_cache.index_select(2, ids.to(self.device)).permute(2, 0, 1, 3, 4, 5).contiguous()

    def _all_heads(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's blocks (rank order) as the whole model's KV heads: each KV head once (a
        head replicated on several ranks is taken from the first)."""
        every = max(1, self.plan.size // self.model_config.num_key_value_heads)
        return torch.cat(parts[::every], dim=4)

    @property
    def _full_block_bytes(self) -> int:
        """Bytes of one block of the payload: every layer, K and V, every KV head of the model."""
        mc = self.model_config
        return mc.num_hidden_layers * 2 * self.block_size * mc.num_key_value_heads * mc.head_dim * self.kv_cache.element_size()

    def write_kv_blocks(self, block_ids: list[int], payload: bytes | memoryview) -> None:
        """Write ``payload`` (the layout :meth:`read_kv_blocks` gives) into ``block_ids``; each rank
        takes its own KV heads of it.

        Raises:
            ValueError: a payload of the wrong size for that many blocks.
        """
        per_block = self._full_block_bytes
        if len(payload) != per_block * len(block_ids):
            raise ValueError(f"{len(payload)} payload bytes for {len(block_ids)} blocks of {per_block}")
        with warnings.catch_warnings():  # a read-only buffer: the tensor is only read (copied into the cache)
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(payload, dtype=torch.uint8)
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        with self._ops:
            if self.collectives is not None:
                self._tell(OP_WRITE_KV, len(block_ids))
                self.collectives.broadcast(ids)
                self.collectives.broadcast(data.clone())  # the broadcast's buffer is written on the other ranks: give it its own
            self._write_local(ids, data)

    def _write_local(self, ids: torch.Tensor, data: torch.Tensor) -> None:
        """Write this rank's KV heads of a whole-model payload (``uint8``) into blocks ``ids``."""
        mc, plan = self.model_config, self.plan
        blocks = data.view(self.dtype).view(len(ids), mc.num_hidden_layers, 2, self.block_size,
                                            mc.num_key_value_heads, mc.head_dim)
        mine = blocks[:, :, :, :, plan.kv_head_start: plan.kv_head_start + plan.num_kv_heads]
        self.kv_cache.index_copy_(2, ids.to(self.device), mine.permute(1, 2, 0, 3, 4, 5).to(self.device))

    def release(self, request_id: str) -> None:
        """Forget a finished request's sampling state."""
        self._seeds_of.pop(request_id, None)
