"""Paged attention over a mixed prefill/decode batch in one Triton launch.

One program handles ``BLOCK_Q`` query tokens of one sequence for one KV head, with all the
``GROUP`` query heads that share that KV head stacked into the tile (rows ``token × head``), so
GQA reads each key and value once per tile. Keys are walked ``BLOCK_N`` at a time through the
block table — a tile may span several KV blocks, and a chunk boundary may fall anywhere inside
a block. Softmax is online, in fp32 (FlashAttention, Dao et al. 2022; FlashAttention-2, Dao
2023): a running maximum ``m``, a running sum ``l`` and an fp32 accumulator rescaled as each
tile arrives. A decode row is simply a row of one query token.
"""

from __future__ import annotations

import torch

from cadenza.kernels._triton import INTERPRET, native_dot, tl, triton

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_attn_fwd(
    Q, K_cache, V_cache, Out,  # Q, Out: [T, Hq, D]; caches: [NB, BS, Hkv, D]
    query_start_loc, seq_lens, block_tables,  # [S + 1], [S], [S, max_blocks]
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,  # head dim, and it padded to a power of two
    GROUP: tl.constexpr, G_PAD: tl.constexpr,  # query heads per KV head, padded
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NATIVE_DOT: tl.constexpr, FP32_DOT: tl.constexpr,  # fp32 operands: "ieee" or "tf32x3"
):
    seq = tl.program_id(0)
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)  # heaviest (latest) query tiles first
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc + seq).to(tl.int64)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    context = tl.load(seq_lens + seq) - q_len  # tokens cached before this step's queries

    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    offs_m = tl.arange(0, BLOCK_M)
    token = q_block * BLOCK_Q + offs_m // G_PAD  # query index within the row
    head = kv_head * GROUP + offs_m % G_PAD
    row_ok = (token < q_len) & (offs_m % G_PAD < GROUP)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = Q + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if not NATIVE_DOT:
        q = q.to(tl.float32)
    q_pos = context + token  # absolute position of each query row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_end = context + tl.minimum((q_block + 1) * BLOCK_Q, q_len)  # keys this tile can see
    offs_n = tl.arange(0, BLOCK_N)
    table = block_tables + seq * stride_bt
    # Block ids are read one tile ahead so the K/V loads of a tile never wait on them.
    next_block = tl.load(table + offs_n // BLOCK_SIZE, mask=offs_n < kv_end, other=0)
    for start in range(0, kv_end, BLOCK_N):
        pos = start + offs_n
        n_ok = pos < kv_end
        block = next_block.to(tl.int64)
        ahead = pos + BLOCK_N
        next_block = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < kv_end, other=0)
        slot = pos % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K_cache + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V_cache + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        if not NATIVE_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if NATIVE_DOT:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k), input_precision=FP32_DOT)
        s = s * qk_scale  # [BLOCK_M, BLOCK_N] fp32
        visible = (pos[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if NATIVE_DOT:
            pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.dot(p, v, input_precision=FP32_DOT)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = Out + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Attention of a mixed prefill/decode batch over a paged KV cache (Triton).

    Same contract as :func:`cadenza.kernels.reference.paged_attention`: row ``i`` has
    ``query_start_loc[i+1] - query_start_loc[i]`` new query tokens at the end of a sequence of
    ``seq_lens[i]`` tokens whose keys and values are all in the cache already; each query attends
    to every cached key before it and causally to the new ones. GQA with any number of query heads
    per KV head.

    Algorithm: FlashAttention-2's online softmax (Dao, 2023) over keys read through the block
    table (PagedAttention, Kwon et al., 2023) — scores in fp32, base-2 exponentials, a running
    max and sum per query row, one rescaled fp32 accumulator; decode rows are rows of one token.
    Tiles: see :func:`tile_config`.

    Args:
        q: ``[T, Hq, D]`` fp32, fp16 or bf16, last dim contiguous.
        k_cache, v_cache: ``[NB, BS, Hkv, D]``, same dtype, last dim contiguous.
        query_start_loc: ``[S + 1]`` int32, from 0.
        seq_lens: ``[S]`` int32.
        block_tables: ``[S, max_blocks]`` int32.
        scale: softmax scale (usually ``D ** -0.5``).
        max_query_len: longest row (sizes the grid); read from ``query_start_loc`` if omitted.

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype.

    Raises:
        ValueError: mismatched shapes or dtypes.
    """
    t, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads or k_cache.dtype != q.dtype or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"q {tuple(q.shape)} {q.dtype} does not fit caches {tuple(k_cache.shape)} {k_cache.dtype}"
        )
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if t == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    config = tile_config(max_query_len, num_heads // num_kv_heads, head_dim, q.dtype)
    grid = (num_seqs, triton.cdiv(max_query_len, config["BLOCK_Q"]), num_kv_heads)
    launch = config.pop("launch")
    _paged_attn_fwd[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size, NATIVE_DOT=native_dot(q.dtype), FP32_DOT="ieee" if INTERPRET else "tf32x3",
        **config, **launch,
    )
    return out


def tile_config(max_query_len: int, group: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tile sizes for a launch, by explicit rules (no autotuning: it cannot run on the CPU path).

    Rows of a tile are ``query token × query head of the group``. Decode-only launches use 16 rows
    (``tl.dot``'s minimum) and 32 keys per step, so many programs fit an SM; launches with a
    prefill row use 128 rows and 64 keys (wgmma-sized on Hopper), or 64 x 32 for fp32 operands
    (3xTF32 on a GPU), whose tiles take twice the registers and shared memory. Pipeline stages
    overlap the K/V loads with compute. ``tests/kernels/test_gpu_compile.py`` compiles each rule
    for sm_80 and sm_90 and checks shared memory and register spills.
    """
    g_pad = triton.next_power_of_2(group)
    d_pad = triton.next_power_of_2(max(head_dim, 16))
    wide = dtype.itemsize == 4  # fp32 operands take twice the registers and shared memory
    if max_query_len == 1:
        block_m, block_n, warps, stages = 16, 32, 4, 2 if wide else 3
    elif wide:
        block_m, block_n, warps, stages = 64, 32, 4, 2
    else:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    return {
        "HEAD_DIM": head_dim, "D_PAD": d_pad, "GROUP": group, "G_PAD": g_pad,
        "BLOCK_Q": max(1, block_m // g_pad), "BLOCK_N": block_n,
        "launch": {"num_warps": warps, "num_stages": stages},
    }
