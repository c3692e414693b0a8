"""Compile cadenza's Triton kernels ahead of time for NVIDIA targets, without a GPU.

Triton ships ``ptxas``, so ``triton.compile`` can lower a kernel to a cubin for a given
``GPUTarget`` on any machine. This proves the GPU path (``NATIVE_DOT`` with bf16 operands,
tile shapes, shared memory) compiles, which the interpreter cannot show. Run in a process with
``TRITON_INTERPRET=0`` (kernels must be ``JITFunction``\\ s, not interpreted); prints one JSON
object: case name -> shared memory bytes, or the error.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial

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


def build(kernel, pointers: dict[str, str], scalars: dict[str, str], constexprs: dict, arch: int, num_warps=4):
    names = kernel.arg_names
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = scalars.get(name, "i32")
    src = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": 2})
    return compiled.metadata.shared


def attention_case(dt: str, native: bool, head_dim: int, max_query_len: int, arch: int) -> int:
    config = tile_config(max_query_len, 4, head_dim)  # the launcher's own rules
    launch = config.pop("launch")
    return build(
        _paged_attn_fwd,
        {"Q": dt, "K_cache": dt, "V_cache": dt, "Out": dt,
         "query_start_loc": "i32", "seq_lens": "i32", "block_tables": "i32"},
        {"qk_scale": "fp32"},
        dict(config, BLOCK_SIZE=16, NATIVE_DOT=native),
        arch, num_warps=launch["num_warps"],
    )


def cases():
    for arch in (80, 90):
        for dt, native in (("bf16", True), ("fp16", True), ("fp32", False)):
            for head_dim, max_query_len in ((128, 512), (128, 1), (96, 512), (64, 512)):
                yield f"attention-sm{arch}-{dt}-d{head_dim}-q{max_query_len}", partial(
                    attention_case, dt, native, head_dim, max_query_len, arch)
    for dt in ("bf16", "fp16", "fp32"):
        yield f"kv-cache-{dt}", lambda dt=dt: build(
            _write_kv_cache, {"K": dt, "V": dt, "K_cache": dt, "V_cache": dt, "slot_mapping": "i64"}, {},
            dict(NUM_HEADS=8, HEAD_DIM=128, H_PAD=8, D_PAD=128, BLOCK_SIZE=16), 90)
        for residual in (False, True):
            yield f"rms-norm-{dt}-residual{residual}", lambda dt=dt, residual=residual: build(
                _rms_norm_fwd, {"X": dt, "R": dt, "W": dt, "Out": dt, "R_out": dt}, {"eps": "fp32"},
                dict(BLOCK=4096, HAS_RESIDUAL=residual), 90, num_warps=16)
        yield f"rotary-{dt}", lambda dt=dt: build(
            _rotary_fwd, {"Q": dt, "K": dt, "positions": "i64", "cos_sin": "fp32"}, {},
            dict(HALF=64, HALF_PAD=64, HQ_PAD=32, HK_PAD=8), 90)
        yield f"silu-and-mul-{dt}", lambda dt=dt: build(
            _silu_and_mul_fwd, {"X": dt, "Out": dt}, {}, dict(BLOCK=1024), 90)


def main() -> int:
    results = {}
    for name, fn in cases():
        try:
            results[name] = fn()
        except Exception as exc:  # report every case
            results[name] = f"ERROR {type(exc).__name__}: {exc}"[:2000]
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
