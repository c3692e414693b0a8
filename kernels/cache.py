"""Write a step's new keys and values into the paged KV cache (Triton).

One program per token scatters its ``[Hkv, D]`` key and value rows into cache slot
``slot_mapping[t]`` (block ``slot // BS``, offset ``slot % BS``), as vLLM's
``reshape_and_cache``. A negative slot means "no slot" (padding) and is skipped.
"""

from __future__ import annotations

import torch

from cadenza.kernels._triton import tl, triton


@triton.jit
def _write_kv_cache(
    K, V, K_cache, V_cache, slot_mapping,  # K, V: [T, Hkv, D]; caches: [NB, BS, Hkv, D]; [T]
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(K_cache + block * stride_cb + offset * stride_cs + h * stride_ch + d, k.to(K_cache.dtype.element_ty), mask=mask)
    tl.store(V_cache + block * stride_vcb + offset * stride_vcs + h * stride_vch + d, v.to(V_cache.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new keys and values into their cache slots, in place.

    A copy (cast to the cache dtype), one program per token; fp32, fp16 or bf16.

    Args:
        k, v: ``[T, Hkv, D]`` (last dim contiguous; any row/head strides).
        k_cache, v_cache: ``[NB, BS, Hkv, D]``.
        slot_mapping: ``[T]`` int64 slot ``block_id * BS + offset`` per token; < 0 skips it.

    Raises:
        ValueError: shapes that do not match.
    """
    t, num_heads, head_dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (num_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit the cache {tuple(k_cache.shape)}")
    if t == 0:
        return
    _write_kv_cache[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(num_heads),
        D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )
