"""Shared pieces of the kernel tests: the device, the per-dtype tolerance table, paged inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# One tolerance per dtype for every kernel: (atol, rtol) against the torch reference. Relative
# tolerances are about two units in the last place (bf16: 2^-8 = 0.4 %; fp16: 2^-11): the Triton
# interpreter rounds fp32 -> bf16 differently from torch, and outputs are rounded once more. Tight
# enough that a 5 % error in the softmax scale fails.
TOLERANCE = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (1e-3, 2e-3),
    torch.bfloat16: (5e-3, 1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


@dataclass
class PagedBatch:
    """A mixed batch over a paged cache whose blocks are scattered (a random permutation)."""

    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32
    max_query_len: int


def paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> PagedBatch:
    """Row ``i``: ``context_lens[i]`` cached tokens then ``query_lens[i]`` new ones (all in cache)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few spare blocks never referenced
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        table[i, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(dtype)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return PagedBatch(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        table.to(DEVICE), max(query_lens),
    )
