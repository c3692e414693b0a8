"""The model runner: turns a scheduled step into one forward pass and sampled tokens.

All torch work of the engine happens here. A step's rows are flattened into one varlen batch —
``input_ids``, ``positions``, ``slot_mapping`` of ``T`` tokens; ``query_start_loc``,
``seq_lens``, ``block_tables`` of ``S`` rows — the model runs once, and logits are computed only
for the last token of each row that samples.
"""

from __future__ import annotations

import logging
import random
import warnings

import numpy as np
import torch

from cadenza.node.runner.backend import AttentionMetadata, select_backend
from cadenza.node.core.config import CacheConfig, ConfigError, EngineConfig
from cadenza.node.runner.models.config import ModelConfig
from cadenza.node.runner.models.llama import load_model
from cadenza.node.runner.sampler import sample, sampling_tensors
from cadenza.node.core.step import SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CPU_DEFAULT_KV_BYTES = 1 << 30


class ModelRunner:
    """Owns the model weights, the paged KV cache and per-request sampling seeds.

    Args:
        config: the engine configuration (model path, dtype, device, cache size).
        model_config: the model's shape.
        max_model_len: resolved longest sequence (sizes the RoPE table).
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype] if config.dtype != "auto" else (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model_config = model_config
        self.block_size = config.cache.block_size
        self.backend = select_backend(config.attention_backend, self.device, self.dtype)
        self.model = load_model(config.model, model_config, self.backend, max_model_len, self.dtype, self.device)
        self.num_kv_blocks = self._num_kv_blocks(config.cache)
        shape = (model_config.num_hidden_layers, 2, self.num_kv_blocks, self.block_size,
                 model_config.num_key_value_heads, model_config.head_dim)
        try:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise ConfigError(
                f"kv_cache_bytes: cannot allocate a KV cache of {self.num_kv_blocks} blocks on "
                f"{self.device} ({exc}); lower the KV cache size"
            ) from None
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self._seeds = random.Random(config.seed)
        self._seeds_of: dict[str, int] = {}
        logger.info(
            "model loaded: %s, %d layers, %s on %s; KV cache %d blocks x %d tokens (%.1f MiB), attention=%s",
            model_config.architecture, model_config.num_hidden_layers, self.dtype, self.device,
            self.num_kv_blocks, self.block_size, self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
            self.backend.name,
        )

    def _num_kv_blocks(self, cache: CacheConfig) -> int:
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = self.model_config.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8) * self.block_size
        if cache.kv_cache_bytes is not None:
            budget = cache.kv_cache_bytes
        elif self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * cache.kv_cache_fraction)
        else:
            budget = _CPU_DEFAULT_KV_BYTES
        return max(1, budget // per_block)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> list[int]:
        """Run one step; return one sampled token per row with ``sample`` set, in row order.

        The batch's index arrays are built with a handful of vectorised numpy operations over
        all rows (not per row): token ``j`` of row ``i`` sits at position ``start_i + j`` and in
        slot ``table_i[pos // block_size] * block_size + pos % block_size``.
        """
        bs = self.block_size
        decodes, chunks = step.decodes, step.prefill_rows
        num_decodes = len(decodes)
        num_rows = num_decodes + len(chunks)
        tables = step.decode_tables + [row.block_table for row in chunks]
        ids = [req.token_ids[pos] for req, pos in zip(decodes, step.decode_positions)]
        starts = np.empty(num_rows, dtype=np.int64)
        counts = np.ones(num_rows, dtype=np.int64)
        starts[:num_decodes] = step.decode_positions
        sampled, sampled_reqs = list(range(num_decodes)), list(decodes)  # every decode samples
        for i, (req, start, n, do_sample, _table) in enumerate(chunks, num_decodes):
            ids.extend(req.token_ids[start : start + n])
            starts[i] = start
            counts[i] = n
            if do_sample:
                sampled.append(i)
                sampled_reqs.append(req)
        params = [req.sampling for req in sampled_reqs]
        seeds = [0 if sp.greedy else self._seed(req.request_id, sp.seed) for req, sp in zip(sampled_reqs, params)]
        width = max(map(len, tables))
        table_arr = np.zeros((num_rows, width), dtype=np.int64)
        for i, table in enumerate(tables):
            table_arr[i, : len(table)] = table
        query_start = np.zeros(num_rows + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        seq_lens = starts + counts
        row_of_token = np.repeat(np.arange(num_rows), counts)
        positions = np.arange(len(ids)) - np.repeat(query_start[:-1] - starts, counts)
        slots = table_arr[row_of_token, positions // bs] * bs + positions % bs

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(query_start.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(table_arr.astype(np.int32)).to(dev),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        hidden = self.model(input_ids, torch.from_numpy(positions).to(dev), self.kv_caches, meta)
        if not sampled:
            return []
        last = torch.from_numpy(query_start[1:][sampled] - 1).to(dev)
        logits = self.model.compute_logits(hidden[last])
        # a row samples the token after its last: decode at p samples p + 1, a chunk [s, s + n) samples s + n
        st = sampling_tensors(params, seeds, seq_lens[sampled], dev, pinned=dev.type == "cuda")
        return sample(logits, st).tolist()

    def _seed(self, request_id: str, seed: int | None) -> int:
        """The request's own seed, else one drawn from the engine's seed at its first sampled row."""
        if request_id not in self._seeds_of:
            self._seeds_of[request_id] = self._seeds.getrandbits(63) if seed is None else seed
        return self._seeds_of[request_id]

    def read_kv_blocks(self, block_ids: list[int]) -> memoryview:
        """The KV of ``block_ids`` as raw bytes, block after block, each ``[L, 2, BS, Hkv, D]``
        (every layer's K then V): the KV transfer's payload layout."""
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        blocks = self.kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, L, 2, BS, Hkv, D]
        return memoryview(blocks.cpu().view(torch.uint8).reshape(-1).numpy()).cast("B")

    def write_kv_blocks(self, block_ids: list[int], payload: bytes | memoryview) -> None:
        """Write ``payload`` (the layout :meth:`read_kv_blocks` gives) into ``block_ids``.

        Raises:
            ValueError: a payload of the wrong size for that many blocks.
        """
        _layers, _two, _nb, bs, heads, dim = self.kv_cache.shape
        per_block = self.kv_cache[:, :, 0].numel() * self.kv_cache.element_size()
        if len(payload) != per_block * len(block_ids):
            raise ValueError(f"{len(payload)} payload bytes for {len(block_ids)} blocks of {per_block}")
        with warnings.catch_warnings():  # a read-only buffer: the tensor is only read (copied into the cache)
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype)
        blocks = data.view(len(block_ids), _layers, 2, bs, heads, dim).permute(1, 2, 0, 3, 4, 5)
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(2, ids, blocks.to(self.device))

    def release(self, request_id: str) -> None:
        """Forget a finished request's sampling state."""
        self._seeds_of.pop(request_id, None)
