"""SiLU-and-mul, the SwiGLU activation (Triton): ``silu(x[:, :I]) * x[:, I:]``.

Shazeer, "GLU Variants Improve Transformer", 2020. Computed in fp32, rounded once on store.
"""

from __future__ import annotations

import torch

from cadenza.kernels._triton import tl, triton


@triton.jit
def _silu_and_mul_fwd(X, Out, stride_x, stride_o, inner, BLOCK: tl.constexpr):  # X: [T, 2I]; Out: [T, I]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + inner + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Out + row * stride_o + cols, out.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(gate) * up`` computed in fp32, rounded once; fp32, fp16 or bf16.

    Args:
        x: ``[T, 2 * I]``, the gate projection then the up projection, last dim contiguous.

    Returns:
        ``[T, I]`` in ``x``'s dtype.
    """
    t, two_i = x.shape
    inner = two_i // 2
    out = torch.empty((t, inner), dtype=x.dtype, device=x.device)
    if t:
        block = min(triton.next_power_of_2(inner), 1024)
        _silu_and_mul_fwd[(t, triton.cdiv(inner, block))](x, out, x.stride(0), out.stride(0), inner, BLOCK=block)
    return out
