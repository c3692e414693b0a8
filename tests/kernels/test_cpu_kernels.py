"""The compiled CPU kernels (kernels/csrc/cpu_ops.cpp) against the torch references, fp32."""

from __future__ import annotations

import pytest
import torch

from cadenza.kernels import cpu, reference
from cadenza.node.runner.models.rope import cos_sin_cache
from kernel_cases import assert_close, paged_batch

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"the CPU kernels did not build: {cpu.build_error()}")


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 17, 130])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 48), (37, 50), (3, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_is_torchs_linear(rows, out_features, in_features, bias):
    x, w = randn(rows, in_features), randn(out_features, in_features, seed=1)
    b = randn(out_features, seed=2) if bias else None
    torch.testing.assert_close(cpu.linear_rows(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_rows_reads_a_strided_input_and_refuses_bad_shapes():
    x = randn(4, 96)[:, :48]  # not contiguous
    w = randn(8, 48)
    torch.testing.assert_close(cpu.linear_rows(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="linear_rows"):
        cpu.linear_rows(randn(2, 47), w)
    with pytest.raises(RuntimeError, match="float32"):
        cpu.linear_rows(x.double(), w)


@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_with_and_without_the_residual_add(fused):
    x, w, r = randn(5, 96), randn(96, seed=1), randn(5, 96, seed=2)
    got = cpu.rms_norm(x, w, 1e-6, r if fused else None)
    expected = reference.rms_norm(x, w, 1e-6, r if fused else None)
    if fused:
        assert_close(got[0], expected[0], torch.float32)
        assert torch.equal(got[1], expected[1])
    else:
        assert_close(got, expected, torch.float32)


@pytest.mark.parametrize("head_dim", [16, 64, 96])
def test_rotary_embedding_in_place_on_views_of_a_fused_projection(head_dim):
    table = cos_sin_cache(head_dim, 512, 10000.0, None)
    positions = torch.tensor([0, 1, 7, 300, 511, 2])
    qkv = randn(6, (4 + 2 * 2) * head_dim)
    q = qkv[:, : 4 * head_dim].view(6, 4, head_dim)
    k = qkv[:, 4 * head_dim : 6 * head_dim].view(6, 2, head_dim)
    eq, ek = reference.rotary_embedding(positions, q.clone(), k.clone(), table)
    v_before = qkv[:, 6 * head_dim :].clone()
    gq, gk = cpu.rotary_embedding(positions, q, k, table)
    assert gq.data_ptr() == q.data_ptr()
    assert_close(gq, eq, torch.float32)
    assert_close(gk, ek, torch.float32)
    assert torch.equal(qkv[:, 6 * head_dim :], v_before)  # v untouched
    with pytest.raises(RuntimeError, match="outside the table"):
        cpu.rotary_embedding(torch.tensor([512] * 6), q, k, table)


def test_silu_and_mul():
    x = randn(7, 2 * 40) * 4
    assert_close(cpu.silu_and_mul(x), reference.silu_and_mul(x), torch.float32)


def check_attention(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, seed=0, q_scale=1.0):
    """The new tokens' K/V go through the fused write: the cache is first the batch's, with the
    new tokens' slots cleared, and must end up equal to it. ``q_scale`` sharpens the softmax."""
    b = paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed)
    b.q.mul_(q_scale)
    slots = []
    for row, (n, c) in enumerate(zip(query_lens, context_lens)):
        for pos in range(c, c + n):
            slots.append(int(b.block_tables[row, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    nb = b.k_cache.shape[0]
    k_new = b.k_cache.view(nb * block_size, num_kv_heads, head_dim)[slot_mapping].clone()
    v_new = b.v_cache.view(nb * block_size, num_kv_heads, head_dim)[slot_mapping].clone()
    k_cache, v_cache = b.k_cache.clone(), b.v_cache.clone()
    k_cache.view(nb * block_size, num_kv_heads, head_dim)[slot_mapping] = 0
    v_cache.view(nb * block_size, num_kv_heads, head_dim)[slot_mapping] = 0
    out = cpu.paged_attention(b.q, k_new, v_new, k_cache, v_cache, slot_mapping, b.query_start_loc, b.seq_lens,
                              b.block_tables, head_dim**-0.5)
    assert torch.equal(k_cache, b.k_cache) and torch.equal(v_cache, b.v_cache)
    expected = reference.paged_attention(b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                                         head_dim**-0.5)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [16, 64, 96])
def test_mixed_batch_short_rows_compiled_long_rows_by_sdpa(head_dim, block_size):
    # decodes, chunks at and just past the compiled kernel's row limit, a whole prompt
    check_attention([1, 13, 1, cpu.SHORT_ROW, cpu.SHORT_ROW + 1, 40, 1], [37, 11, 0, 5, 3, 0, 70], 8, 2, head_dim,
                    block_size)


@pytest.mark.parametrize("group", [1, 2, 3, 8])
def test_every_gqa_ratio(group):
    check_attention([1, 4, 1], [20, 9, 300], 2 * group, 2, 64, 16, seed=group)


@pytest.mark.parametrize("group", [1, 3])
def test_a_lone_decode_is_split_over_its_kv_heads(group):
    # one query token: fewer tokens than threads, so each KV head's query group is its own task
    check_attention([1], [300], 3 * group, 3, 64, 16, seed=10 + group)


@pytest.mark.parametrize("q_scale", [0.01, 8.0, 60.0])
def test_flat_and_peaked_softmax(q_scale):
    # the vectorised exp over scores from near-equal to spread over hundreds (weights underflow)
    check_attention([1, 1, 3], [47, 200, 16], 4, 2, 64, 16, seed=3, q_scale=q_scale)


def test_chunk_boundaries_inside_kv_blocks():
    for start in range(0, 40, 7):
        check_attention([min(7, 40 - start)], [start], 4, 2, 64, 16, seed=start)


def test_attention_refuses_a_block_outside_the_cache():
    b = paged_batch([1], [20], 4, 2, 64, 16, torch.float32)
    tables = b.block_tables.clone()
    tables[0, 1] = b.k_cache.shape[0]
    k = torch.zeros(1, 2, 64)
    with pytest.raises(RuntimeError, match="names block"):
        cpu.paged_attention(b.q, k, k, b.k_cache, b.v_cache, torch.tensor([0]), b.query_start_loc, b.seq_lens,
                            tables, 0.125)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.paged_attention(b.q, k, k, b.k_cache, b.v_cache, torch.tensor([10**6]), b.query_start_loc, b.seq_lens,
                            b.block_tables, 0.125)


def test_degenerate_and_inconsistent_inputs_raise_instead_of_crashing():
    """Each of these once divided by zero (SIGFPE) or read and wrote past a tensor."""
    with pytest.raises(RuntimeError, match="H > 0"):
        cpu.rms_norm(torch.randn(2, 0), torch.randn(0), 1e-6)
    assert torch.equal(cpu.linear_rows(torch.randn(1, 0), torch.randn(8, 0), torch.ones(8)), torch.ones(1, 8))
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu.linear_rows(torch.randn(2, 16), torch.randn(8, 16), torch.randn(1))
    b = paged_batch([1], [20], 4, 2, 64, 16, torch.float32)
    k = torch.zeros(1, 2, 64)
    attend = lambda **kw: cpu.paged_attention(  # noqa: E731
        kw.get("q", b.q), kw.get("k", k), kw.get("k", k), b.k_cache, kw.get("v_cache", b.v_cache), torch.tensor([0]),
        kw.get("qsl", b.query_start_loc), b.seq_lens, b.block_tables, 0.125)
    for qsl in ([0, 5], [1000, 1001], [1, 1]):
        with pytest.raises(RuntimeError, match="query_start_loc"):
            attend(qsl=torch.tensor(qsl, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="v_cache"):
        attend(v_cache=b.v_cache[:1])
    with pytest.raises(RuntimeError, match="no KV heads"):
        attend(k=torch.zeros(1, 0, 64))
    with pytest.raises(RuntimeError, match="cos_sin_cache"):
        cpu.rotary_embedding(torch.tensor([0]), torch.randn(1, 2, 16), torch.randn(1, 2, 16), torch.randn(32))
