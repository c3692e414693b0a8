"""Compile cadenza's Triton kernels ahead of time for NVIDIA targets, without a GPU.

Triton ships ``ptxas`` and ``cuobjdump``, so ``triton.compile`` can lower a kernel to a cubin for a
given ``GPUTarget`` on any machine and report its registers, stack (spills) and shared memory.
This proves the GPU path (``NATIVE_DOT`` with bf16 operands, tile shapes, pipelining) compiles,
which the interpreter cannot show. Pointers and the strides that are multiples of 16 in practice
get the ``tt.divisibility`` hint the JIT would give them at run time, so the kernel built here is
the one a GPU runs. Run with ``TRITON_INTERPRET=0``; prints one JSON object: case name ->
``{"shared", "regs", "stack"}``, or an error string.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cadenza.kernels.activation import _silu_and_mul_fwd  # noqa: E402
from cadenza.kernels.attention import _paged_attn_fwd, tile_config  # noqa: E402
from cadenza.kernels.cache import _write_kv_cache  # noqa: E402
from cadenza.kernels.norm import _rms_norm_fwd  # noqa: E402
from cadenza.kernels.rotary import _rotary_fwd  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def build(kernel, pointers: dict[str, str], scalars: dict[str, str], constexprs: dict, arch: int,
          aligned: tuple[str, ...] = (), num_warps: int = 4, num_stages: int = 2) -> dict:
    names = kernel.arg_names
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = scalars.get(name, "i32")
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*pointers, *aligned)}
    src = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return {"shared": compiled.metadata.shared, **resources(compiled.asm["cubin"])}


def resources(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True, text=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return {"regs": int(regs.group(1)) if regs else -1, "stack": int(stack.group(1)) if stack else -1}


def attention_case(dt: str, head_dim: int, group: int, max_query_len: int, arch: int) -> dict:
    import torch

    dtype = getattr(torch, _TORCH_DTYPES[dt])
    config = tile_config(max_query_len, group, head_dim, dtype)  # the launcher's own rules
    launch = config.pop("launch")
    from cadenza.kernels._triton import native_dot

    return build(
        _paged_attn_fwd,
        {"Q": dt, "K_cache": dt, "V_cache": dt, "Out": dt,
         "query_start_loc": "i32", "seq_lens": "i32", "block_tables": "i32"},
        {"qk_scale": "fp32"},
        dict(config, BLOCK_SIZE=16, NATIVE_DOT=native_dot(dtype), FP32_DOT="tf32x3"),
        arch,
        aligned=("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ks", "stride_kh",
                 "stride_vb", "stride_vs", "stride_vh"),
        **launch,
    )


def cases():
    for arch in (80, 90):
        for dt in ("bf16", "fp16", "fp32"):
            for head_dim, group, max_query_len in ((128, 4, 512), (128, 4, 1), (96, 4, 512), (64, 1, 512),
                                                   (64, 8, 1), (128, 8, 512)):
                yield (f"attention-sm{arch}-{dt}-d{head_dim}-g{group}-q{max_query_len}",
                       partial(attention_case, dt, head_dim, group, max_query_len, arch))
    for dt in ("bf16", "fp16", "fp32"):
        yield f"kv-cache-{dt}", partial(
            build, _write_kv_cache, {"K": dt, "V": dt, "K_cache": dt, "V_cache": dt, "slot_mapping": "i64"}, {},
            dict(NUM_HEADS=8, HEAD_DIM=128, H_PAD=8, D_PAD=128, BLOCK_SIZE=16), 90,
            aligned=("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cb", "stride_cs", "stride_ch",
                     "stride_vcb", "stride_vcs", "stride_vch"))
        for residual in (False, True):
            yield f"rms-norm-{dt}-residual{residual}", partial(
                build, _rms_norm_fwd, {"X": dt, "R": dt, "W": dt, "Out": dt, "R_out": dt}, {"eps": "fp32"},
                dict(BLOCK=4096, HAS_RESIDUAL=residual), 90,
                aligned=("stride_x", "stride_r", "stride_o", "stride_ro"), num_warps=16)
        yield f"rotary-{dt}", partial(
            build, _rotary_fwd, {"Q": dt, "K": dt, "positions": "i64", "cos_sin": "fp32"}, {},
            dict(HALF=64, HALF_PAD=64, HQ_PAD=32, HK_PAD=8), 90,
            aligned=("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_cs"))
        yield f"silu-and-mul-{dt}", partial(
            build, _silu_and_mul_fwd, {"X": dt, "Out": dt}, {}, dict(BLOCK=1024), 90, aligned=("stride_x", "stride_o"))


def main() -> int:
    results: dict = {}
    for name, fn in cases():
        try:
            results[name] = fn()
        except Exception as exc:  # report every case
            results[name] = f"ERROR {type(exc).__name__}: {exc}"[:2000]
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
