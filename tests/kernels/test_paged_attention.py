"""The Triton paged attention kernel against the torch reference, over mixed batches."""

from __future__ import annotations

import pytest
import torch

from cadenza.kernels import reference
from cadenza.kernels.attention import paged_attention
from kernel_cases import DTYPES, assert_close, paged_batch


def check(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    b = paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    scale = head_dim**-0.5
    out = paged_attention(b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables, scale,
                          max_query_len=b.max_query_len)
    # The reference runs in fp32 on the same (rounded) inputs.
    expected = reference.paged_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(), b.query_start_loc,
                                         b.seq_lens, b.block_tables, scale)
    assert out.dtype == dtype and out.shape == b.q.shape
    assert_close(out, expected, dtype)


# Decode rows (one query over a cached prefix), a chunk resuming mid-block, a prompt with an
# empty prefix, and a chunk that starts on a block boundary — all in one launch.
MIXED_QUERY = [1, 13, 1, 20, 1, 16]
MIXED_CONTEXT = [37, 11, 0, 0, 70, 32]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_prefill_and_decode_rows_in_one_launch(dtype, head_dim, block_size):
    check(MIXED_QUERY, MIXED_CONTEXT, 8, 2, head_dim, block_size, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", range(1, 9))
def test_every_gqa_ratio_from_1_to_8_query_heads_per_kv_head(group, dtype):
    check(MIXED_QUERY, MIXED_CONTEXT, 2 * group, 2, 64, 16, dtype, seed=group)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_cached_prefix_over_scattered_blocks(dtype):
    check([9, 1], [301, 250], 4, 1, 64, 16, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunk_boundaries_inside_kv_blocks(dtype):
    # Chunks of 7 over a prompt of 40: each resumes at a position that is not a block start.
    for start in range(0, 40, 7):
        check([min(7, 40 - start)], [start], 4, 2, 64, 16, dtype, seed=start)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_whole_prompts_with_empty_prefixes(dtype):
    check([1, 2, 31, 64, 65], [0, 0, 0, 0, 0], 4, 4, 64, 16, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_only_batch(dtype):
    check([1] * 7, [1, 5, 16, 17, 33, 100, 2], 8, 1, 128, 32, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dim_smaller_than_a_tensor_core_tile(dtype):
    check([3, 1], [5, 9], 4, 2, 16, 16, dtype)  # the tiny test models' head size


def test_online_softmax_rescales_when_a_late_key_dominates():
    """A key far past the first tile with a huge score must take over the softmax: the running
    maximum jumps and every earlier partial sum is rescaled."""
    b = paged_batch([1, 4], [200, 150], 4, 2, 64, 16, torch.float32)
    q = b.q.clone()
    for row, (pos, token) in enumerate([(190, 0), (150, 3)]):  # a late cached key, the row's last query
        block = int(b.block_tables[row, pos // 16])
        key = b.k_cache[block, pos % 16]  # [Hkv, D]
        query_token = int(b.query_start_loc[row]) + token
        q[query_token] = key.repeat_interleave(2, 0) * 4.0  # score = 4 |k|^2 / 8, far above the rest
    out = paged_attention(q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables, 64**-0.5)
    expected = reference.paged_attention(q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                                         64**-0.5)
    assert_close(out, expected, torch.float32)
    late_value = b.v_cache[int(b.block_tables[0, 190 // 16]), 190 % 16].repeat_interleave(2, 0)
    assert_close(out[0], late_value, torch.float16)  # nearly all the weight is on that key


def test_queries_may_be_strided_views_of_a_fused_projection():
    b = paged_batch(MIXED_QUERY, MIXED_CONTEXT, 8, 2, 64, 16, torch.float32)
    qkv = torch.randn(b.q.shape[0], (8 + 2 * 2) * 64, device=b.q.device)
    q = qkv[:, : 8 * 64].view(-1, 8, 64)
    q.copy_(b.q)
    assert not q.is_contiguous()
    out = paged_attention(q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables, 0.125)
    expected = reference.paged_attention(b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                                         0.125)
    assert_close(out, expected, torch.float32)


def test_mismatched_cache_is_refused():
    b = paged_batch([1], [3], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError):
        paged_attention(b.q[:, :, :32], b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables, 1.0)
