"""KV-cache write, RMSNorm, rotary embedding and SiLU-and-mul against their torch references."""

from __future__ import annotations

import pytest
import torch

from cadenza.kernels import reference
from cadenza.kernels.activation import silu_and_mul
from cadenza.kernels.cache import write_kv_cache
from cadenza.kernels.norm import rms_norm
from cadenza.kernels.rotary import rotary_embedding
from cadenza.node.runner.models.rope import cos_sin_cache
from kernel_cases import DEVICE, DTYPES, assert_close

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def randn(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_cache_write_scatters_tokens_to_their_slots(dtype, block_size):
    k, v = randn(9, 3, 96, dtype=dtype), randn(9, 3, 96, dtype=dtype, seed=1)
    slots = torch.tensor([0, 5, block_size - 1, block_size, 3 * block_size + 2, 70, 71, 40, 100], device=DEVICE)
    caches = [torch.zeros(8, block_size, 3, 96, dtype=dtype, device=DEVICE) for _ in range(4)]
    write_kv_cache(k, v, caches[0], caches[1], slots)
    reference.write_kv_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_kv_cache_write_skips_negative_slots_and_reads_strided_inputs():
    qkv = randn(4, 2 + 2 * 2, 64, dtype=torch.float32)  # k and v are views into a fused projection
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    slots = torch.tensor([3, -1, 9, 0], device=DEVICE)
    k_cache, v_cache = (torch.zeros(2, 16, 2, 64, device=DEVICE) for _ in range(2))
    write_kv_cache(k, v, k_cache, v_cache, slots)
    flat = k_cache.view(32, 2, 64)
    assert torch.equal(flat[3], k[0]) and torch.equal(flat[9], k[2]) and torch.equal(flat[0], k[3])
    assert int((flat.abs().sum((1, 2)) > 0).sum()) == 3


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "fused-residual"])
@pytest.mark.parametrize("hidden", [64, 100, 576])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype, hidden, residual):
    x, w = randn(5, hidden, dtype=dtype), randn(hidden, dtype=dtype, seed=1)
    r = randn(5, hidden, dtype=dtype, seed=2) if residual else None
    got, expected = rms_norm(x, w, 1e-5, r), reference.rms_norm(x, w, 1e-5, r)
    if residual:
        assert_close(got[0], expected[0], dtype)
        assert_close(got[1], expected[1], dtype)
    else:
        assert_close(got, expected, dtype)


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["plain", "llama3"])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_embedding_rotates_q_and_k_in_place(dtype, head_dim, scaling):
    table = cos_sin_cache(head_dim, 4096, 500000.0, scaling).to(DEVICE)
    positions = torch.tensor([0, 1, 63, 64, 1000, 4095], device=DEVICE)
    q, k = randn(6, 8, head_dim, dtype=dtype), randn(6, 2, head_dim, dtype=dtype, seed=1)
    expected_q, expected_k = reference.rotary_embedding(positions, q, k, table)
    got_q, got_k = rotary_embedding(positions, q, k, table)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert_close(got_q, expected_q, dtype)
    assert_close(got_k, expected_k, dtype)


def test_rotary_embedding_on_views_of_a_fused_projection():
    table = cos_sin_cache(16, 64, 10000.0).to(DEVICE)
    qkv = randn(3, (4 + 2 + 2) * 16, dtype=torch.float32)
    q, k = qkv[:, :64].view(3, 4, 16), qkv[:, 64:96].view(3, 2, 16)
    positions = torch.tensor([2, 7, 11], device=DEVICE)
    expected_q, expected_k = reference.rotary_embedding(positions, q, k, table)
    v_before = qkv[:, 96:].clone()
    rotary_embedding(positions, q, k, table)
    assert_close(q, expected_q, torch.float32)
    assert_close(k, expected_k, torch.float32)
    assert torch.equal(qkv[:, 96:], v_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_embedding_with_head_counts_that_are_not_powers_of_two(dtype):
    table = cos_sin_cache(64, 128, 100000.0).to(DEVICE)  # SmolLM2: 9 query heads, 3 KV heads
    positions = torch.arange(5, device=DEVICE) * 20
    q, k = randn(5, 9, 64, dtype=dtype), randn(5, 3, 64, dtype=dtype, seed=1)
    expected_q, expected_k = reference.rotary_embedding(positions, q, k, table)
    rotary_embedding(positions, q, k, table)
    assert_close(q, expected_q, dtype)
    assert_close(k, expected_k, dtype)


@pytest.mark.parametrize("inner", [16, 300, 1536])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype, inner):
    x = randn(4, 2 * inner, dtype=dtype)
    assert_close(silu_and_mul(x), reference.silu_and_mul(x), dtype)
