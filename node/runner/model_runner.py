"""The model runner: turns a scheduled step into one forward pass and sampled tokens.

All torch work of the engine happens here. A step's rows are flattened into one varlen batch —
``input_ids``, ``positions``, ``slot_mapping`` of ``T`` tokens; ``query_start_loc``,
``seq_lens``, ``block_tables`` of ``S`` rows — the model runs once, and logits are computed only
for the last token of each row that samples.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

from cadenza.node.runner.backend import AttentionMetadata, select_backend
from cadenza.node.core.config import CacheConfig, ConfigError, EngineConfig
from cadenza.node.runner.models.config import ModelConfig
from cadenza.node.runner.models.llama import load_model
from cadenza.node.runner.sampler import make_generator, sample
from cadenza.node.core.step import SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CPU_DEFAULT_KV_BYTES = 1 << 30


class ModelRunner:
    """Owns the model weights, the paged KV cache and per-request sampling generators.

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
        self.backend = select_backend(config.attention_backend, self.device)
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
        self._generators: dict[str, torch.Generator] = {}
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
        """Run one step; return one sampled token per row with ``sample`` set, in row order."""
        bs = self.block_size
        ids: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logit_rows: list[int] = []
        params, generators = [], []
        for req, start, n, do_sample, table in step.rows:
            end = start + n
            ids.append(req.token_ids[start:end])
            pos = np.arange(start, end)
            slots.append(np.asarray(table)[pos // bs] * bs + pos % bs)
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            tables.append(table)
            if do_sample:
                logit_rows.append(query_start[-1] - 1)
                params.append(req.sampling)
                generators.append(None if req.sampling.greedy else self._generator(req.request_id, req.sampling.seed))

        dev = self.device
        input_ids = torch.from_numpy(np.concatenate([np.asarray(x, dtype=np.int64) for x in ids])).to(dev)
        positions = torch.from_numpy(
            np.concatenate([np.arange(e - (q1 - q0), e) for e, q0, q1 in zip(seq_lens, query_start, query_start[1:])])
        ).to(dev)
        width = max(len(t) for t in tables)
        table_arr = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            table_arr[i, : len(t)] = t
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots).astype(np.int64)).to(dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(table_arr).to(dev),
            max_query_len=max(b - a for a, b in zip(query_start, query_start[1:])),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not logit_rows:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=dev)])
        return sample(logits, params, generators)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = make_generator(self._seeds.getrandbits(63) if seed is None else seed, self.device)
            self._generators[request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        """Forget a finished request's sampling state."""
        self._generators.pop(request_id, None)
