"""The GPU probe: ``python -m bench.gpu_probe [--quick] [--out DIR]`` on a CUDA machine, no downloads.

What the engine reaches on the device against what the device allows, each figure a ratio of
two things measured in the same run (issue 29: the kernels reach the hardware, the engine is
host-bound). The models have real shapes — Llama-3.1-8B and SmolLM2-135M, the dimensions of
``sim/models/*.json`` — with seeded random weights drawn on the device (the engine core's
``weights_seed``), bf16, Triton backend, prefix caching off, token budget 2,048, chunk 512; the
engine core (the real scheduler and runner) runs every step.

1. **Decode against the memory floor**: 1, 8, 32 and 128 streams of 512-token contexts
   decoding (Llama-3.1-8B shapes): tok/s, and the floor — the bytes a step reads (the weights
   and the KV: the simulator's roofline memory terms) over the device's copy bandwidth measured
   in this run (:func:`bench.gpu_check.copy_bandwidth`) — as a fraction of the step time.
   Target at batch 1: >= 0.75.
2. **GPU-busy share** at batch 32: the union of the CUDA kernels' intervals (``torch.profiler``)
   over the profiled steps' wall time. Target >= 0.85.
3. **CUDA graphs on / off**: the decode step at batch 1 and 32 with ``cuda_graphs`` True, then
   False (two engines, one after the other). Target at batch 1: off / on >= 2.5.
4. **A mixed step**: 32 decodes + one 512-token chunk, against a decode-only step plus a
   chunk-only step (medians). Target: mixed / (decode + chunk) <= 0.7.
5. **The stall behind a long prompt**: the max ITL of 32 decoding streams while a 16,384-token
   prompt is prefilled, chunk 512 against unchunked (the budget then holding the whole prompt).
   Target: chunked / unchunked <= 0.1.
6. **Prefill throughput**: one 2,048-token chunk alone, its FLOPs (the roofline's: 2 x params x
   tokens + attention) per second, against a bf16 8,192-cube matmul's on the same device, and
   against the ~2,048-token prefill steps of the H200 table in ``data/gpu/h200`` (taken before
   CUDA graphs): no regression, >= 0.95 of it (compared on an H200 only).
7. **A step table** for ``cadenza sim calibrate``, CUDA graphs on
   (:func:`bench.gpu_check.step_table`), written to ``DIR/gpu-probe-steps-MODEL.jsonl`` (``DIR``:
   ``--out``, default ``gpu-probe``).

Last line: one JSON object, ``benchmark: "gpu_probe"``, ``ratio`` (section 1 at batch 1),
``target``, each other ratio with its target, ``pass``, the device, torch, Triton and CUDA
versions and every section's figures (also written to ``DIR/gpu-probe.json``).

``--quick`` (under 4 minutes on an H100/H200): batches 1 and 32, fewer steps; Llama-3.1-8B
shapes for sections 1-3 (the targets), SmolLM2-135M shapes for 4-7 (a 4,096-token long prompt,
its model being 8,192 long). Without CUDA, ``--quick`` runs the same sections on the CPU with a
tiny model (the tests' tiny Llama shapes, float32, torch backend), sections 2 and 3 reported as
skipped (they need CUDA), in seconds; without ``--quick`` it exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench.common import arguments, report
from bench.gpu_check import copy_bandwidth, step_table
from bench.probe_engine import Driver, free_device, model_folder
from bench.probe_figures import (RECORDED, RECORDED_DEVICE, busy_seconds, calibration_base, composition,
                                 floor_fraction, kernel_intervals, max_gap, recorded_tflops, result_line, step_bytes,
                                 step_flops)
from cadenza.node.core.config import EngineConfig
from cadenza.node.engine.engine_core import EngineCore
from cadenza.sim.calibrate import load_step_table
from cadenza.sim.model_dims import SHIPPED, ModelDims, load_model_dims
from cadenza.sim.roofline import StepComposition

MODEL_SECTIONS = ("mixed", "stall", "prefill")
NEEDS_CUDA = "skipped: needs a CUDA GPU (torch.cuda.is_available() is False)"


@dataclass(frozen=True)
class Shape:
    """The sizes of a run: the defaults are the full probe's; :data:`QUICK` and :data:`CPU_QUICK`
    are ``--quick``'s with and without CUDA. ``decode_model`` serves sections 1-3, ``model`` 4-7
    (a shipped model's name, or ``tiny``)."""

    decode_model: str = "llama-3.1-8b"
    model: str = "llama-3.1-8b"
    batches: tuple[int, ...] = (1, 8, 32, 128)
    graph_batches: tuple[int, ...] = (1, 32)
    busy_batch: int = 32
    context: int = 512
    warmup_steps: int = 8
    decode_steps: int = 64
    profile_steps: int = 16
    chunk: int = 512
    mixed_decodes: int = 32
    trials: int = 8
    streams: int = 32
    long_prompt: int = 16384
    prefill_tokens: int = 2048
    matmul_n: int = 8192
    copy_bytes: int = 1 << 30
    table_steps: int = 3000
    kv_cache_bytes: int = 16 << 30
    device: str = "cuda"
    dtype: str = "bfloat16"
    backend: str = "triton"


QUICK = replace(Shape(), model="smollm2-135m", batches=(1, 32), decode_steps=24, profile_steps=8, trials=5,
                long_prompt=4096, table_steps=300)
CPU_QUICK = Shape(decode_model="tiny", model="tiny", batches=(1, 4), graph_batches=(1, 4), busy_batch=4, context=32,
                  warmup_steps=2, decode_steps=8, profile_steps=4, chunk=32, mixed_decodes=4, trials=3, streams=4,
                  long_prompt=256, prefill_tokens=128, matmul_n=256, copy_bytes=32 << 20, table_steps=24,
                  kv_cache_bytes=64 << 20, device="cpu", dtype="float32", backend="torch")


# -- the engine ------------------------------------------------------------------------------------


def build_engine(folder: Path, shape: Shape, cuda_graphs: bool = True) -> EngineCore:
    """An engine core on ``folder``'s shapes with weights drawn from seed 0 (token budget 2,048,
    chunk ``shape.chunk``, 256 sequences, prefix caching off)."""
    config = EngineConfig.from_knobs(str(folder), device=shape.device, dtype=shape.dtype,
                                     attention_backend=shape.backend, cuda_graphs=cuda_graphs,
                                     token_budget=2048, chunk_size=shape.chunk, max_num_seqs=256,
                                     kv_cache_bytes=shape.kv_cache_bytes, prefix_caching=False)
    return EngineCore(config, weights_seed=0)


# -- the sections -----------------------------------------------------------------------------------


def decode_row(drive: Driver, batch: int, shape: Shape) -> dict:
    """``batch`` streams of ``shape.context`` tokens decoding: step time, tok/s, mean context."""
    ids = drive.streams(batch, shape.context, shape.warmup_steps + shape.decode_steps + 4)
    for _ in range(shape.warmup_steps):
        drive.core.step()
    seconds, records = drive.decode_steps(shape.decode_steps, batch)
    drive.stop(ids)
    context = sum(r.decode_context_tokens for r in records) / len(records)
    return {"batch": batch, "step_ms": round(seconds * 1e3, 3), "tokens_per_s": round(batch / seconds, 1),
            "context_tokens": round(context, 1)}


def decode(drive: Driver, shape: Shape, dims: ModelDims, dtype_bytes: int, copy_gb_s: float,
           batches: Sequence[int]) -> dict:
    """Section 1: a decode row per batch, each against its memory floor."""
    rows = []
    for batch in batches:
        row = decode_row(drive, batch, shape)
        step = StepComposition(0, batch, round(row["context_tokens"]), 0.0, batch, batch)
        nbytes = step_bytes(dims, step, dtype_bytes)
        row |= {"bytes_per_step": int(nbytes), "floor_ms": round(nbytes / (copy_gb_s * 1e9) * 1e3, 3),
                "floor_fraction": round(floor_fraction(nbytes, copy_gb_s, row["step_ms"] * 1e-3), 4)}
        print(f"decode batch {batch:>3} ({dims.name}): {row['step_ms']:.2f} ms/step, {row['tokens_per_s']:.0f} tok/s; "
              f"memory floor {row['floor_ms']:.2f} ms -> {row['floor_fraction']:.2f} of it")
        rows.append(row)
    return {"model": dims.name, "copy_gb_s": round(copy_gb_s, 1), "rows": rows}


def gpu_busy(drive: Driver, shape: Shape) -> dict:
    """Section 2: the CUDA kernels' busy time over the wall time of profiled decode steps."""
    from torch.profiler import ProfilerActivity, profile

    batch = shape.busy_batch
    ids = drive.streams(batch, shape.context, shape.warmup_steps + shape.profile_steps + 4)
    for _ in range(shape.warmup_steps):
        drive.core.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        seconds, _records = drive.decode_steps(shape.profile_steps, batch)
    drive.stop(ids)
    busy = busy_seconds(kernel_intervals(prof.events())) / shape.profile_steps
    share = busy / seconds
    print(f"GPU busy at batch {batch}: kernels {busy * 1e3:.2f} ms of a {seconds * 1e3:.2f} ms step (profiled) "
          f"-> {share:.2f} (target >= 0.85)")
    return {"batch": batch, "kernel_ms": round(busy * 1e3, 3), "step_ms_profiled": round(seconds * 1e3, 3),
            "share": round(share, 4)}


def graphs(on_rows: Sequence[dict], drive_off: Driver, shape: Shape) -> dict:
    """Section 3: the decode rows of the graphs-on engine against the same on a graphs-off one."""
    on = {r["batch"]: r["step_ms"] for r in on_rows if r["batch"] in shape.graph_batches}
    off = {b: decode_row(drive_off, b, shape)["step_ms"] for b in on}
    speedup = {b: round(off[b] / on[b], 3) for b in on}
    for b in on:
        print(f"CUDA graphs at batch {b}: off {off[b]:.2f} ms, on {on[b]:.2f} ms -> {speedup[b]:.2f}x")
    return {"on_ms": on, "off_ms": off, "speedup": speedup}


def mixed(drive: Driver, shape: Shape) -> dict:
    """Section 4: a chunk alone, then decodes with and without a chunk, interleaved (medians; the
    first of each is a warm-up)."""
    chunk, decodes = shape.chunk, shape.mixed_decodes
    chunk_alone, mixed_s, decode_s = [], [], []
    for _ in range(shape.trials + 1):
        drive.add(chunk, 1)
        seconds, _record = drive.timed_step(chunk, 0)
        chunk_alone.append(seconds)
    ids = drive.streams(decodes, shape.context, 2 * shape.trials + 8)
    for _ in range(shape.trials + 1):
        drive.add(chunk, 1)
        for kind, times in ((chunk, mixed_s), (0, decode_s)):
            seconds, _record = drive.timed_step(kind, decodes)
            times.append(seconds)
    drive.stop(ids)
    m, d, c = (statistics.median(xs[1:]) * 1e3 for xs in (mixed_s, decode_s, chunk_alone))
    ratio = m / (d + c)
    print(f"mixed step ({decodes} decodes + {chunk}-token chunk): {m:.2f} ms vs decode {d:.2f} + chunk {c:.2f} ms "
          f"-> {ratio:.2f} (target <= 0.7)")
    return {"mixed_ms": round(m, 3), "decode_ms": round(d, 3), "chunk_ms": round(c, 3), "ratio": round(ratio, 4)}


def stall(drive: Driver, shape: Shape) -> dict:
    """Section 5: the streams' max ITL while a long prompt is prefilled, chunked then unchunked
    (live reconfiguration of one engine), and the long prompt's TTFT."""
    streams, long = shape.streams, shape.long_prompt
    runs = {}
    for label, knobs in (("chunked", {"chunk_size": shape.chunk, "token_budget": 2048}),
                         ("unchunked", {"chunk_size": None, "token_budget": long + streams})):
        drive.core.reconfigure(knobs)
        ids = drive.streams(streams, shape.context, long // shape.chunk + shape.warmup_steps + 16)
        for _ in range(shape.warmup_steps):
            drive.core.step()
        prompt = drive.prompt(long)
        drive.core.step()  # each stream's last token before the long prompt arrives
        arrivals_at = time.perf_counter()
        arrivals = {rid: [arrivals_at] for rid in ids}
        target = drive.add(long, 1, prompt)
        ttft, limit = None, long // shape.chunk + 16
        for _ in range(limit):
            deltas, _ = drive.core.step()
            now = time.perf_counter()
            for d in deltas:
                if d.request_id == target:
                    ttft = now - arrivals_at
                elif d.request_id in arrivals:
                    arrivals[d.request_id].append(now)
            if ttft is not None:
                break
        drive.stop(ids)
        if ttft is None:
            raise RuntimeError(f"{label}: the {long}-token prompt got no token in {limit} steps")
        runs[label] = {"max_itl_ms": round(max_gap(arrivals.values()) * 1e3, 2), "ttft_ms": round(ttft * 1e3, 2)}
    drive.core.reconfigure({"chunk_size": shape.chunk, "token_budget": 2048})
    ratio = runs["chunked"]["max_itl_ms"] / runs["unchunked"]["max_itl_ms"]
    print(f"stall behind a {long}-token prompt, {streams} streams: max ITL chunked "
          f"{runs['chunked']['max_itl_ms']:.1f} ms, unchunked {runs['unchunked']['max_itl_ms']:.1f} ms "
          f"-> {ratio:.3f} (target <= 0.1)")
    return {**runs, "long_prompt": long, "chunk": shape.chunk, "ratio": round(ratio, 4)}


def prefill(drive: Driver, shape: Shape, dims: ModelDims, matmul_tflops: float, device: str) -> dict:
    """Section 6: one chunk of ``shape.prefill_tokens`` alone: TFLOP/s against the matmul's and
    against the recorded H200 table of the same model (that comparison on an H200 only)."""
    tokens = shape.prefill_tokens
    drive.core.reconfigure({"chunk_size": tokens, "token_budget": max(2048, tokens)})
    times = []
    for _ in range(shape.trials + 1):
        drive.add(tokens, 1)
        seconds, record = drive.timed_step(tokens, 0)
        times.append(seconds)
    drive.core.reconfigure({"chunk_size": shape.chunk, "token_budget": 2048})
    seconds = statistics.median(times[1:])
    tflops = step_flops(dims, composition(record)) / seconds / 1e12
    out = {"tokens": tokens, "step_ms": round(seconds * 1e3, 3), "tflops": round(tflops, 4),
           "matmul_tflops": round(matmul_tflops, 4), "matmul_fraction": round(tflops / matmul_tflops, 4)}
    table = RECORDED / f"steps-{dims.name}.jsonl"
    recorded = recorded_tflops(load_step_table(table), dims, tokens) if table.exists() else None
    if recorded is not None:
        out["recorded_tflops"] = round(recorded, 2)
    if recorded is not None and shape.dtype == "bfloat16" and RECORDED_DEVICE in device:
        out["ratio_vs_recorded"] = round(tflops / recorded, 4)
    else:
        out["ratio_vs_recorded"] = None
        out["not_compared"] = (f"the recorded table is {RECORDED_DEVICE}, {dims.name}, bf16; this run is {device}, "
                               f"{shape.dtype}" + ("" if recorded is not None else ", and no table of its model"))
    print(f"prefill ({tokens}-token chunk, {dims.name}): {tflops:.1f} TFLOP/s, {out['matmul_fraction']:.2f} of a "
          f"matmul's {matmul_tflops:.1f}" + (f"; {out['ratio_vs_recorded']:.2f} of the recorded {recorded:.1f} "
                                             "(target >= 0.95)" if out["ratio_vs_recorded"] is not None else ""))
    return out


# -- the run ----------------------------------------------------------------------------------------


def cpu_bench(fn: Callable[[], object], reps: int = 5) -> float:
    """Median milliseconds of ``fn`` after one warm-up call (``triton.testing.do_bench``'s
    contract, on the CPU)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def matmul_tflops(do_bench: Callable, n: int, dtype: torch.dtype, device: str) -> float:
    """TFLOP/s of an ``n`` x ``n`` by ``n`` x ``n`` matmul (``2 n^3`` FLOPs)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / (do_bench(lambda: a @ b) * 1e-3) / 1e12


def environment(device: str) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda}


def guarded(sections: dict, name: str, fn: Callable[[], dict]) -> None:
    """Run one section into ``sections[name]``; a failure is reported there, and the rest run."""
    try:
        sections[name] = fn()
    except Exception as exc:  # every section reports even if one fails
        print(f"{name}: FAILED: {type(exc).__name__}: {exc}")
        sections[name] = {"error": f"{type(exc).__name__}: {exc}"}


def on_engine(sections: dict, names: Sequence[str], build: Callable[[], Driver],
              body: Callable[[Driver], None]) -> None:
    """Build an engine (a failure is the error of every section in ``names``), run ``body`` on
    it, and free its memory before the next is built."""
    try:
        drive = build()
    except Exception as exc:  # every section reports even if one fails
        print(f"engine for {', '.join(names)}: FAILED: {type(exc).__name__}: {exc}")
        sections.update({name: {"error": f"engine: {type(exc).__name__}: {exc}"} for name in names})
        return
    try:
        body(drive)
    finally:
        del drive
        free_device()


def run(shape: Shape, out: Path) -> dict:
    """Every section on ``shape``; the result line (:func:`result_line`)."""
    cuda = shape.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        from triton.testing import do_bench
    else:
        do_bench = cpu_bench
    dtype = getattr(torch, shape.dtype)
    dtype_bytes = torch.finfo(dtype).bits // 8
    env = environment(shape.device)
    sections: dict[str, dict] = {}
    copy_gb_s = copy_bandwidth(do_bench, shape.copy_bytes, shape.device)
    mm_tflops = matmul_tflops(do_bench, shape.matmul_n, dtype, shape.device)
    print(f"{env['device']}: copy {copy_gb_s:.0f} GB/s (read + write), {shape.dtype} matmul {mm_tflops:.1f} TFLOP/s")
    out.mkdir(parents=True, exist_ok=True)
    same = shape.model == shape.decode_model
    folders = {name: model_folder(name, out / "gpu-probe-models") for name in {shape.decode_model, shape.model}}
    dims = {name: load_model_dims(folder) for name, folder in folders.items()}

    def engine(name: str, cuda_graphs: bool = True) -> Callable[[], Driver]:
        return lambda: Driver(build_engine(folders[name], shape, cuda_graphs), sync)

    def model_sections(drive: Driver) -> None:
        guarded(sections, "mixed", lambda: mixed(drive, shape))
        guarded(sections, "stall", lambda: stall(drive, shape))
        guarded(sections, "prefill", lambda: prefill(drive, shape, dims[shape.model], mm_tflops, env["device"]))

    def graphs_on(drive: Driver) -> None:
        batches = sorted(set(shape.batches) | set(shape.graph_batches))
        guarded(sections, "decode", lambda: decode(drive, shape, dims[shape.decode_model], dtype_bytes, copy_gb_s,
                                                   batches))
        if cuda:
            guarded(sections, "gpu_busy", lambda: gpu_busy(drive, shape))
        if same:
            model_sections(drive)

    on_engine(sections, ["decode", "gpu_busy", *(MODEL_SECTIONS if same else ())], engine(shape.decode_model),
              graphs_on)
    rows = sections["decode"].get("rows")
    if not cuda:
        sections["gpu_busy"] = {"skipped": f"{NEEDS_CUDA}: the profiler's CUDA kernel times"}
        sections["graphs"] = {"skipped": f"{NEEDS_CUDA}: CUDA graphs exist on a CUDA device only "
                                         "(cuda_graphs is ignored on the CPU)"}
    elif rows:
        on_engine(sections, ["graphs"], engine(shape.decode_model, cuda_graphs=False),
                  lambda drive: guarded(sections, "graphs", lambda: graphs(rows, drive, shape)))
    else:
        sections["graphs"] = {"error": "no decode rows with graphs on to compare (see section decode)"}
    if not same:
        on_engine(sections, MODEL_SECTIONS, engine(shape.model), model_sections)
    shipped = (SHIPPED / f"{shape.model}.json").exists()
    guarded(sections, "step_table", lambda: step_table(
        out / f"gpu-probe-steps-{shape.model}.jsonl", folders[shape.model], shape.device, shape.table_steps,
        weights_seed=0, sim_model=shape.model if shipped else str(folders[shape.model]),
        base=calibration_base(env["device"]), attention_backend=shape.backend, dtype=shape.dtype))
    result = result_line(sections, env)
    (out / "gpu-probe.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-probe"),
                        help="folder for the step table, the models' config.json and gpu-probe.json "
                             "(default: gpu-probe)")
    args = arguments(__doc__, parser)
    if torch.cuda.is_available():
        os.environ.pop("TRITON_INTERPRET", None)  # native kernels (tests set it on machines without CUDA)
        shape = QUICK if args.quick else Shape()
    elif args.quick:
        print("no CUDA GPU: the sections run on the CPU with a tiny model; those that need CUDA are skipped")
        shape = CPU_QUICK
    else:
        print("gpu_probe needs a CUDA GPU (torch.cuda.is_available() is False); "
              "`python -m bench.gpu_probe --quick` runs its code paths on the CPU")
        return 2
    start = time.perf_counter()
    result = run(shape, args.out)
    print(f"gpu probe: {time.perf_counter() - start:.0f} s")
    report(result, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
