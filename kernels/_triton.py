"""Import Triton the way cadenza runs it: natively on a CUDA GPU, else under the interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated with ``@triton.jit``, so it must be
set before the kernel modules are imported; every one of them imports ``triton`` and ``tl`` from
here. Without a CUDA device we set ``TRITON_INTERPRET=1`` (unless the user chose otherwise):
kernels then run on the CPU through numpy — 50-250x slower than torch, which is what tests on a
GPU-less machine need.

The interpreter computes bf16 arithmetic wrongly (and bf16 ``tl.dot`` badly wrong), so kernels
load bf16, convert to fp32, compute, and convert on store; ``NATIVE_DOT`` (16-bit operands into
``tl.dot`` with fp32 accumulation, the fast path on tensor cores) is used for bf16 only when
compiled for a GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1" and type(tl.max).__name__ != "InterpretedFunction":
    raise ImportError(
        "triton was imported (torch imports it lazily) before its interpreter was turned on, so its "
        "standard library is compiled for a GPU this machine does not have; set TRITON_INTERPRET=1 "
        "in the environment before starting Python (the cadenza CLI and test suite do this)"
    )

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def native_dot(dtype: torch.dtype) -> bool:
    """Feed ``tl.dot`` 16-bit operands directly (exact products, fp32 accumulation)?

    fp16 always (the interpreter handles it); bf16 only on a GPU (the interpreter gets it wrong);
    fp32 never (it is converted nowhere and multiplied in full precision).
    """
    return dtype == torch.float16 or (dtype == torch.bfloat16 and not INTERPRET)


__all__ = ["INTERPRET", "native_dot", "tl", "triton"]
