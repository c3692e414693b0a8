"""Rotary position embedding applied in place to q and k (Triton).

GPT-NeoX "rotate half" layout, as Hugging Face Llama: with ``x = [x1, x2]`` split in halves,
``x1' = x1 cos - x2 sin`` and ``x2' = x2 cos + x1 sin``, angles looked up by position in a
``cos_sin_cache`` built with ``rope_theta`` and any ``rope_scaling`` (linear, Llama 3) — see
:mod:`cadenza.node.runner.models.rope`. RoFormer: Su et al., 2021. One program per token rotates all its
query and key heads; arithmetic in fp32.
"""

from __future__ import annotations

import torch

from cadenza.kernels._triton import tl, triton


@triton.jit
def _rotate_heads(ptr, stride_h, num_heads, cos, sin,
                  HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < num_heads) & (d < HALF)
    first = ptr + h * stride_h + d
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_fwd(
    Q, K, positions, cos_sin,  # Q: [T, Hq, D]; K: [T, Hkv, D]; [T]; [P, D] (cos | sin)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    num_q_heads, num_kv_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_sin + pos * stride_cs + d, mask=d < HALF, other=1.0)[None, :]
    sin = tl.load(cos_sin + pos * stride_cs + HALF + d, mask=d < HALF, other=0.0)[None, :]
    _rotate_heads(Q + t * stride_qt, stride_qh, num_q_heads, cos, sin, HALF, HQ_PAD, HALF_PAD)
    _rotate_heads(K + t * stride_kt, stride_kh, num_kv_heads, cos, sin, HALF, HK_PAD, HALF_PAD)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` in place by their tokens' positions.

    Rotate-half RoPE in fp32, rounded once to the input dtype (fp32, fp16 or bf16); angles in
    radians from the table, which carries ``rope_theta`` and any ``rope_scaling``.

    Args:
        positions: ``[T]`` int64.
        q: ``[T, Hq, D]``; k: ``[T, Hkv, D]`` (last dims contiguous; views are fine).
        cos_sin_cache: ``[max_position, D]`` fp32, cos in the first ``D/2`` columns, sin after.

    Returns:
        ``(q, k)``, the same tensors, rotated.
    """
    t, num_q_heads, head_dim = q.shape
    if t:
        half = head_dim // 2
        _rotary_fwd[(t,)](
            q, k, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            num_q_heads, k.shape[1],
            HALF=half, HALF_PAD=triton.next_power_of_2(half),
            HQ_PAD=triton.next_power_of_2(num_q_heads), HK_PAD=triton.next_power_of_2(k.shape[1]),
        )
    return q, k
