"""The GPU check: ``python -m bench.gpu_check`` on a machine with a CUDA GPU (about 3-5 minutes).

1. **Kernel and GPU tests, natively**: ``pytest`` of :data:`GPU_TESTS` (the kernels, the Triton
   backend's parity, CUDA graphs, the probe's CUDA parts) with the Triton interpreter off.
2. **Decode attention bandwidth**: 64 sequences x 4,096 cached tokens, one query each,
   Llama-3-8B attention shape (32 query heads, 8 KV heads, head dim 128, bf16, block 16): bytes of
   K and V read per launch / time, against the device's copy bandwidth (a 1 GiB
   ``Tensor.copy_``, read + write). Target on Hopper: >= 70 %.
3. **Prefill-chunk attention throughput**: 4 prompts of 2,048 tokens with empty prefixes, same
   heads: causal FLOPs / time, against ``torch.nn.functional.scaled_dot_product_attention`` on the
   same shapes (K/V expanded to all heads beforehand; SDPA pinned to its FlashAttention-2 kernel).
   Target on Hopper: >= 0.7x SDPA.
4. **One engine step**: SmolLM2-135M-Instruct, bf16, 32 decoding requests (512-token prompts) plus
   a 512-token prefill chunk, Triton backend against torch backend (median of several steps).
5. **A step table for the simulator**: the same engine (Triton backend) through waves of requests
   of mixed lengths, each step's composition and seconds written to ``gpu-steps.jsonl`` (the
   step log's format): ``cadenza sim calibrate --steps gpu-steps.jsonl --model smollm2-135m
   --base h200-roofline --out my-gpu.json`` (the base: this GPU's data-sheet profile) fits a profile of
   this GPU from it.

6. **The GPU probe**: ``python -m bench.gpu_probe --quick`` in its own process (about 4
   minutes; :mod:`bench.gpu_probe`: the engine against the device's floors, Llama-3.1-8B shapes),
   its lines echoed, its files in ``gpu-probe/`` and its result line kept under ``probe``.

Prints each figure and, last, one JSON line with ``benchmark``, ``ratio`` (decode bandwidth
fraction), ``target``, the other ratios and the probe's line.

``--quick``: the same sections on the smallest shapes (kernel tests not marked ``slow``, 8 x 1,024
decode, one 512-token prefill, the tests' tiny random Llama for the engine sections, 64 steps of
step table). Without a CUDA GPU, ``--quick`` runs the sections that need none, the step table on
the CPU and the probe's CPU quick run, and reports the others as skipped (exit 0); without
``--quick`` it exits 2.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import arguments, bench_model

ROOT = Path(__file__).resolve().parents[1]
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


@dataclass(frozen=True)
class Shape:
    """The sections' sizes: the defaults are the full check's, :data:`QUICK` is ``--quick``'s."""

    decode_seqs: int = 64
    decode_context: int = 4096
    prefill_seqs: int = 4
    prefill_len: int = 2048
    engine_decodes: int = 32
    engine_prompt: int = 512
    engine_chunk: int = 512
    engine_long: int = 4096
    table_steps: int = 3000
    kernel_tests_args: tuple[str, ...] = ()


QUICK = Shape(decode_seqs=8, decode_context=1024, prefill_seqs=1, prefill_len=512, engine_decodes=8, engine_prompt=64,
              engine_chunk=128, engine_long=256, table_steps=64, kernel_tests_args=("-m", "not slow"))


# Every test that runs natively on a CUDA GPU (each skips, or runs slowly under the interpreter, on a CPU).
GPU_TESTS = ("tests/kernels", "tests/node/test_triton_backend.py", "tests/node/test_cuda_graphs_gpu.py",
             "tests/node/test_random_weights.py", "tests/bench/test_gpu_probe_cuda.py")


def kernel_tests(extra: tuple[str, ...] = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", *extra, *GPU_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    print(f"kernel tests (native): {tail} ({time.perf_counter() - start:.0f} s)")
    if proc.returncode:
        print(proc.stdout[-4000:], proc.stderr[-2000:])
    return {"passed": proc.returncode == 0, "summary": tail}


def paged_inputs(num_seqs: int, context: int, query: int, dtype=torch.bfloat16):
    """Contiguous block tables over a cache holding every sequence's ``context + query`` tokens."""
    seq_len = context + query
    blocks = -(-seq_len // BLOCK)
    k_cache = torch.randn(num_seqs * blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(num_seqs * blocks, device="cuda", dtype=torch.int32).view(num_seqs, blocks)
    q = torch.randn(num_seqs * query, HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    qsl = torch.arange(0, num_seqs + 1, device="cuda", dtype=torch.int32) * query
    lens = torch.full((num_seqs,), seq_len, device="cuda", dtype=torch.int32)
    return q, k_cache, v_cache, qsl, lens, tables


def copy_bandwidth(do_bench, nbytes: int = 2**30, device: str = "cuda") -> float:
    """The device's copy bandwidth, GB/s: a ``Tensor.copy_`` of ``nbytes`` (1 GiB), counted read +
    write, timed by ``do_bench`` (a callable -> milliseconds, as ``triton.testing.do_bench``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src))
    return 2 * nbytes / (copy_ms * 1e-3) / 1e9


def decode_bandwidth(do_bench, num_seqs: int = 64, context: int = 4096) -> dict:
    from cadenza.kernels.attention import paged_attention

    q, kc, vc, qsl, lens, tables = paged_inputs(num_seqs, context - 1, 1)
    ms = do_bench(lambda: paged_attention(q, kc, vc, qsl, lens, tables, HEAD_DIM**-0.5, max_query_len=1))
    kv_bytes = 2 * num_seqs * context * KV_HEADS * HEAD_DIM * q.element_size()
    attn_gbs = kv_bytes / (ms * 1e-3) / 1e9
    copy_gbs = copy_bandwidth(do_bench)
    fraction = attn_gbs / copy_gbs
    print(f"decode attention: {attn_gbs:.0f} GB/s ({ms:.3f} ms) vs copy {copy_gbs:.0f} GB/s -> {fraction:.2f} (target >= 0.70)")
    return {"attention_gb_s": round(attn_gbs, 1), "copy_gb_s": round(copy_gbs, 1), "fraction": round(fraction, 3)}


def prefill_throughput(do_bench, num_seqs: int = 4, length: int = 2048) -> dict:
    import torch.nn.functional as F

    from cadenza.kernels.attention import paged_attention
    from cadenza.kernels.reference import write_kv_cache

    q, kc, vc, qsl, lens, tables = paged_inputs(num_seqs, 0, length)
    k = torch.randn(num_seqs * length, KV_HEADS, HEAD_DIM, device="cuda", dtype=q.dtype)
    v = torch.randn_like(k)
    slots = (tables.view(num_seqs, -1, 1) * BLOCK + torch.arange(BLOCK, device="cuda")).view(num_seqs, -1)[:, :length]
    write_kv_cache(k, v, kc, vc, slots.reshape(-1).long())
    ours = do_bench(lambda: paged_attention(q, kc, vc, qsl, lens, tables, HEAD_DIM**-0.5, max_query_len=length))
    group = HEADS // KV_HEADS
    qs = q.view(num_seqs, length, HEADS, HEAD_DIM).transpose(1, 2)
    ks = k.view(num_seqs, length, KV_HEADS, HEAD_DIM).transpose(1, 2).repeat_interleave(group, 1).contiguous()
    vs = v.view(num_seqs, length, KV_HEADS, HEAD_DIM).transpose(1, 2).repeat_interleave(group, 1).contiguous()
    qs = qs.contiguous()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def flash_sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # the baseline is FlashAttention-2, pinned
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    sdpa = do_bench(flash_sdpa)
    flops = num_seqs * 2 * length * length * HEAD_DIM * HEADS  # causal: half of 4·L²·D per head
    ours_tf, sdpa_tf = flops / (ours * 1e-3) / 1e12, flops / (sdpa * 1e-3) / 1e12
    print(f"prefill attention: {ours_tf:.0f} TFLOP/s vs SDPA (flash) {sdpa_tf:.0f} TFLOP/s -> "
          f"{ours_tf / sdpa_tf:.2f}x (target >= 0.7)")
    return {"tflops": round(ours_tf, 1), "sdpa_tflops": round(sdpa_tf, 1), "ratio": round(ours_tf / sdpa_tf, 3)}


def engine_step(model: Path, shape: Shape = Shape()) -> dict:
    from cadenza.node.frontend.llm import Engine
    from cadenza.node.core.request import SamplingParams

    times = {}
    for backend in ("torch", "triton"):
        engine = Engine.from_model(model, device="cuda", dtype="bfloat16", attention_backend=backend,
                                   token_budget=2 * shape.engine_chunk, chunk_size=shape.engine_chunk, max_num_seqs=64,
                                   kv_cache_bytes=4 << 30,
                                   prefix_caching=False)  # every step computes what it says (no cache hits)
        decode = SamplingParams(max_tokens=min(1000, engine.max_model_len - shape.engine_prompt), temperature=0,
                                ignore_eos=True)
        for i in range(shape.engine_decodes):
            engine.add_request(f"d{i}", [100 + i % 50] * shape.engine_prompt, decode)
        while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.num_waiting:
            engine.step()
        engine.add_request("long", [7] * shape.engine_long, SamplingParams(max_tokens=1, temperature=0))
        steps = []
        for _ in range(6):
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - start)
        times[backend] = statistics.median(steps[1:]) * 1e3
        del engine
        torch.cuda.empty_cache()
    speedup = times["torch"] / times["triton"]
    print(f"engine step ({shape.engine_decodes} decodes + {shape.engine_chunk}-token chunk, {model.name} bf16): "
          f"triton {times['triton']:.1f} ms, "
          f"torch {times['torch']:.1f} ms -> {speedup:.2f}x")
    return {"triton_ms": round(times["triton"], 2), "torch_ms": round(times["torch"], 2), "speedup": round(speedup, 3)}


def step_table(path: Path, model: Path, device: str = "cuda", max_steps: int = 3000, weights_seed: int | None = None,
               sim_model: str = "smollm2-135m", base: str | None = None, **knobs: object) -> dict:
    """Waves of random requests (prompts 16-4,096 tokens, at most the model's length less the
    output; outputs 1-256, 1 to 128 at once) through the engine core (token budget 2,048, chunk
    1,024, 256 sequences, as ``data/gpu/h200``'s tables were taken), every step logged to ``path``
    as ``cadenza serve --step-log`` logs it. ``weights_seed``: draw the weights
    (:class:`~cadenza.node.engine.engine_core.EngineCore`) instead of loading ``model``'s;
    ``sim_model`` (a shipped model or a ``config.json`` folder of ``model``'s shapes) and ``base``
    (a hardware profile; default: this device's, :func:`bench.probe_figures.calibration_base`): the
    printed calibration command's; ``knobs``: engine settings over these (``attention_backend``,
    ``dtype``, ...)."""
    import random

    from bench.probe_figures import calibration_base

    from cadenza.node.core.config import EngineConfig
    from cadenza.node.engine.engine_core import EngineCore
    from cadenza.node.core.messages import AddRequest
    from cadenza.node.core.request import SamplingParams
    from cadenza.node.frontend.step_log import StepLog

    config = EngineConfig.from_knobs(str(model), **{
        "device": device, "dtype": "bfloat16" if device == "cuda" else "auto", "token_budget": 2048,
        "chunk_size": 1024, "max_num_seqs": 256, "prefix_caching": False,
        "kv_cache_bytes": (4 << 30) if device == "cuda" else (256 << 20), **knobs})
    core = EngineCore(config, weights_seed=weights_seed)
    if base is None:
        base = calibration_base(torch.cuda.get_device_name() if device == "cuda" else "cpu")
    path.unlink(missing_ok=True)
    log = StepLog(path)
    rng, steps, wave = random.Random(0), 0, 0
    vocab = core.model_config.vocab_size
    while steps < max_steps:
        for i in range(rng.choice([1, 4, 16, 64, 128])):
            length, output = int(2 ** rng.uniform(4, 12)), rng.randint(1, 256)
            prompt = [rng.randrange(min(100, vocab // 2), min(40000, vocab))
                      for _ in range(min(length, core.max_model_len - output))]
            core.add_request(AddRequest(f"w{wave}-{i}", prompt, SamplingParams(max_tokens=output, temperature=0,
                                                                               ignore_eos=True)))
        while core.has_unfinished_requests() and steps < max_steps:
            _deltas, record = core.step()
            if record is not None:
                log.write(record)
            steps += 1
        wave += 1
    log.close()
    calibrate = f"cadenza sim calibrate --steps {path} --model {sim_model} --base {base} --out my-gpu.json"
    print(f"step table: {steps} steps in {wave} waves -> {path} ({calibrate})")
    return {"steps": steps, "path": str(path), "calibrate": calibrate}


def probe(out: Path) -> dict:
    """``python -m bench.gpu_probe --quick --out OUT`` in a process of its own (a CUDA context of
    its own: nothing of the sections above holds device memory there), its lines echoed as they
    come; its result line.

    Raises:
        RuntimeError: it exited with an error; ValueError: its last line is not JSON.
    """
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "bench.gpu_probe", "--quick", "--out", str(out)],
                            env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, text=True)
    last = ""
    for line in proc.stdout:
        print(f"  probe: {line}", end="")
        last = line
    if proc.wait():
        raise RuntimeError(f"python -m bench.gpu_probe --quick exited {proc.returncode}")
    return json.loads(last)


def cpu_only(path: Path) -> int:
    """``--quick`` without a CUDA GPU: the sections that need no GPU — the step table on the CPU
    (on the tiny model) and the probe's CPU quick run — the others reported as skipped."""
    skipped = "skipped: needs a CUDA GPU (torch.cuda.is_available() is False)"
    print(f"no CUDA GPU: the step table and the probe run on the CPU; the other sections are {skipped}")
    table = step_table(path, bench_model(True), device="cpu", max_steps=QUICK.table_steps)
    try:
        probe_line = probe(path.parent / "gpu-probe")
    except (RuntimeError, ValueError) as exc:
        print(f"probe: FAILED: {exc}")
        probe_line = {"error": str(exc)}
    print(json.dumps({"benchmark": "gpu_check", "ratio": None, "target": 0.7, "device": "cpu",
                      "torch": torch.__version__,
                      **{name: {"skipped": skipped} for name in ("kernel_tests", "decode", "prefill", "engine_step")},
                      "step_table": table, "probe": probe_line, "pass": False, "quick": True}))
    return 0


def main() -> int:
    args = arguments(__doc__)
    shape = QUICK if args.quick else Shape()
    steps_path = Path("gpu-steps.jsonl")
    if not torch.cuda.is_available():
        if args.quick:
            return cpu_only(steps_path)
        print("gpu_check needs a CUDA GPU (torch.cuda.is_available() is False)")
        return 2
    os.environ.pop("TRITON_INTERPRET", None)
    from triton.testing import do_bench

    model = bench_model(args.quick)
    result: dict = {"benchmark": "gpu_check", "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, fn in (("kernel_tests", lambda: kernel_tests(shape.kernel_tests_args)),
                     ("decode", lambda: decode_bandwidth(do_bench, shape.decode_seqs, shape.decode_context)),
                     ("prefill", lambda: prefill_throughput(do_bench, shape.prefill_seqs, shape.prefill_len)),
                     ("engine_step", lambda: engine_step(model, shape)),
                     ("step_table", lambda: step_table(steps_path, model, max_steps=shape.table_steps)),
                     ("probe", lambda: probe(steps_path.parent / "gpu-probe"))):
        try:
            result[name] = fn()
        except Exception as exc:  # report every section even if one fails
            print(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
    result["ratio"] = result["decode"].get("fraction")
    result["target"] = 0.7
    result["prefill_ratio"] = result["prefill"].get("ratio")
    result["prefill_target"] = 0.7
    result["engine_step_speedup"] = result["engine_step"].get("speedup")
    result["pass"] = bool(
        result["kernel_tests"].get("passed") and (result["ratio"] or 0) >= 0.7 and (result["prefill_ratio"] or 0) >= 0.7
    )
    if args.quick:
        result["quick"] = True
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
