"""RMSNorm with an optional fused residual add (Triton).

One program per row. Numerics follow Hugging Face's ``LlamaRMSNorm`` (and
:func:`cadenza.kernels.reference.rms_norm`): the residual sum is rounded to the input dtype, the
mean square is taken in fp32, the normalised row is rounded to the input dtype and then scaled
by the weight. RMSNorm: Zhang & Sennrich, 2019.
"""

from __future__ import annotations

import torch

from cadenza.kernels._triton import tl, triton


@triton.jit
def _rms_norm_fwd(
    X, R, W, Out, R_out,  # X, R, Out, R_out: [T, H]; W: [H]
    stride_x, stride_r, stride_o, stride_ro,
    hidden, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(R_out.dtype.element_ty)
        tl.store(R_out + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / hidden
    h = (x * tl.rsqrt(mean_square + eps)).to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (w * h).to(Out.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each row, optionally after adding ``residual``.

    ``y = w * round(x / sqrt(mean(x²) + eps))``, mean square in fp32, one program per row;
    fp32, fp16 or bf16 in and out.

    Args:
        x: ``[T, H]``, last dim contiguous.
        weight: ``[H]``.
        eps: added to the mean square.
        residual: optional ``[T, H]``; when given, ``x + residual`` is normalised and returned as
            the new residual stream.

    Returns:
        ``[T, H]`` in ``x``'s dtype, or ``(normed, x + residual)``.
    """
    t, hidden = x.shape
    out = torch.empty_like(x)
    r_out = torch.empty_like(x) if residual is not None else out
    if t:
        block = triton.next_power_of_2(hidden)
        _rms_norm_fwd[(t,)](
            x, residual if residual is not None else x, weight, out, r_out,
            x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0), r_out.stride(0),
            hidden, eps,
            BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=min(max(block // 256, 1), 16),
        )
    return out if residual is None else (out, r_out)
