"""Hybrid mode against the two static shapes: ``python -m bench.hybrid``.

``cadenza up`` with two replicas of SmolLM2-135M-Instruct (one core each) on a bursty workload
from the Azure 2023 traces: steady conversation traffic as ``interactive`` (the conversation
trace, slowed 4x, lengths /8, outputs capped at 32) plus bursts of long code-trace prompts as
``batch`` (six prompts of the code trace, /2 and capped at 1,024 tokens, every 60 s). Sized to the
machine: on one core a SmolLM2 decode step takes ~200 ms and a 256-token prefill chunk adds
~1 s, so the interactive SLO (ITL p99 500 ms) breaks when big chunks meet interactive decodes.
Three runs, same workload, one after the other: static ``colocated`` (both replicas mix all
classes, chunk 256), static ``dedicated`` (one interactive replica with chunk 64 and a 400 ms
step-time target, one batch replica) and ``auto`` (the SLO controller, windows of 10 s / 30 s,
bounds chunk 64-256 and step-time target 400-1200 ms, retune factor 0.25: one step to the bound).

Per run: per 15 s window the interactive TTFT / ITL p99 and whether the interactive SLO held
(both under target; a window with fewer than 5 requests is not judged), the share of judged
windows that held, batch output throughput, goodput (requests/s meeting every SLO), the controller's actions and failed requests.
Targets: no failed request in any run; ``auto`` holds the interactive SLO in at least as many
windows as the better static shape (``ratio`` = auto share / best static share, target >= 1) with
batch throughput >= 90 % of colocated's; at most 2 reshapes per burst. A figure of the windows
(with the controller's actions) is written to ``docs/img/hybrid.png`` with ``--plot``.

``--quick``: the tests' tiny random Llama, 8 s per run of the conversation trace at its recorded
rate, in windows of 4 s judged from one request, bursts of two code prompts every 4 s from 1 s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from bench import pool_runs
from bench.common import CONV_TRACE, ROOT, arguments, machine, prompt_ids, quick_model, report
from bench.pool_runs import Job, summarize
from cadenza.loadgen.trace import load_trace, scale_trace
from cadenza.node.embedded import ensure_embedded_model

CODE_TRACE = ROOT / "data" / "traces" / "azure2023" / "AzureLLMInferenceTrace_code.csv"
SLO = {"interactive": {"ttftP99Ms": 4000, "itlP99Ms": 600}, "batch": {"ttftP99Ms": 20000}}


@dataclass(frozen=True)
class Shape:
    """A run's sizes: the defaults are the recorded run's, :data:`QUICK` is ``--quick``'s.

    ``duration_s`` of traffic judged in windows of ``window_s`` (a window with fewer than
    ``min_window_requests`` interactive requests is not judged); the conversation trace slowed
    ``time_scale`` times; ``burst_size`` code prompts every ``burst_every_s`` from
    ``first_burst_s``. The pool serves ``model_path`` (None: the embedded model) as ``model_name``.
    """

    duration_s: float = 180.0
    window_s: float = 15.0
    burst_every_s: float = 60.0
    burst_size: int = 6
    first_burst_s: float = 10.0
    time_scale: float = 4.0
    min_window_requests: int = 5
    max_model_len: int = 2048
    model_name: str = "SmolLM2-135M-Instruct"
    model_path: str | None = None


FULL = Shape()
QUICK = Shape(duration_s=8.0, window_s=4.0, burst_every_s=4.0, burst_size=2, first_burst_s=1.0, time_scale=1.0,
              min_window_requests=1, max_model_len=1024, model_name="tiny")


def workload(model, shape: Shape = FULL) -> list[Job]:
    conv, _ = scale_trace(load_trace(CONV_TRACE), time_scale=shape.time_scale, length_scale=1 / 8, max_input_len=256,
                          max_output_len=32, duration_s=shape.duration_s)
    code, _ = scale_trace(load_trace(CODE_TRACE), length_scale=1 / 2, max_input_len=768, max_output_len=32,
                          num_requests=shape.burst_size * 3)
    bursts = [(shape.first_burst_s + shape.burst_every_s * (i // shape.burst_size) + 0.5 * (i % shape.burst_size), r)
              for i, r in enumerate(code)]
    bursts = [(t, r) for t, r in bursts if t < shape.duration_s]
    lengths = [r.input_len for r in conv] + [r.input_len for _, r in bursts]
    prompts = prompt_ids(model, lengths, seed=11)
    jobs = [Job(r.arrival_s, "interactive", prompts[i], max(8, r.output_len)) for i, r in enumerate(conv)]
    jobs += [Job(t, "batch", prompts[len(conv) + i], max(8, r.output_len)) for i, (t, r) in enumerate(bursts)]
    return sorted(jobs, key=lambda j: j.at)


def pool_yaml(mode: str, shape: Shape = FULL) -> dict:
    model = {"name": shape.model_name} | ({"source": {"path": shape.model_path}} if shape.model_path else {})
    spec = {
        "model": model, "replicas": 2, "mode": mode,
        "engine": {"tokenBudget": 512, "chunkSize": 256, "maxModelLen": shape.max_model_len},
        "dedicated": {"interactiveReplicas": 1, "engine": {"chunkSize": 64, "stepTimeTargetMs": 400}},
        "slo": SLO,
        "controller": {"fastWindowSeconds": 10, "windowSeconds": 30, "minSamples": 4, "cooldownSeconds": 60,
                       "retuneFactor": 0.25,
                       "dwellSeconds": 30, "staleSeconds": 20,
                       "bounds": {"chunkSize": {"min": 64, "max": 256}, "stepTimeTargetMs": {"min": 400, "max": 1200}}},
    }
    return {"apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool",
            "metadata": {"name": f"bench-{mode}", "namespace": "default"}, "spec": spec}


def run_pool(mode: str, jobs: list[Job], workdir: Path, shape: Shape = FULL) -> dict:
    run = pool_runs.run_pool(mode, pool_yaml(mode, shape), jobs, workdir, shape.model_name)
    return summarize(mode, run, slo=SLO, duration_s=shape.duration_s, window_s=shape.window_s,
                     min_window_requests=shape.min_window_requests)


def plot(runs: dict, path: Path, shape: Shape = FULL) -> None:
    """Per run, each window's worse interactive figure as a share of its target (TTFT p99 / 4 s or
    ITL p99 / 600 ms: over 1 is a miss), coloured by the verdict, with bursts and actions marked."""

    def bursts(ax) -> None:
        for b in range(int(shape.duration_s // shape.burst_every_s)):
            ax.axvline(shape.first_burst_s + b * shape.burst_every_s, color="tab:orange", lw=1, alpha=0.6)

    pool_runs.plot(runs, path, slo=SLO, window_s=shape.window_s, background=bursts, note="; orange: batch bursts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", action="store_true", help="write docs/img/hybrid.png")
    parser.add_argument("--replot", type=Path, metavar="LOG",
                        help="only redraw the figure from a saved run's output (its last line)")
    parser.add_argument("--modes", default="colocated,dedicated,auto",
                        help="runs to make, comma-separated (the ratio needs all three)")
    args = arguments(__doc__, parser)
    if args.quick and args.plot:
        parser.error("--plot redraws docs/img/hybrid.png from a recorded run, not from a --quick one")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.replot:
        plot(json.loads(args.replot.read_text().strip().splitlines()[-1])["runs"], ROOT / "docs" / "img" / "hybrid.png")
        return
    if args.quick:
        shape = replace(QUICK, model_path=str(quick_model()))
        model = Path(shape.model_path)
    else:
        shape, model = FULL, ensure_embedded_model()
    jobs = workload(model, shape)
    n_batch = sum(j.cls == "batch" for j in jobs)
    print(f"workload: {len(jobs) - n_batch} interactive + {n_batch} batch requests over {shape.duration_s:.0f} s "
          f"(bursts of {shape.burst_size} long code prompts every {shape.burst_every_s:.0f} s); "
          f"SLO {SLO['interactive']}")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-hybrid-") as tmp:
        for mode in modes:
            runs[mode] = run_pool(mode, jobs, Path(tmp), shape)
            r = runs[mode]
            print(f"{mode:>9}: windows (TTFT p99 / ITL p99 ms): "
                  + " ".join(f"{w['ttft_p99_ms']}/{w['itl_p99_ms']}{'' if w['slo_met'] else '!' if w['slo_met'] is False else '?'}"
                          for w in r["windows"]))
            print(f"{mode:>9}: SLO held in {r['slo_windows_share']:.0%} of windows; batch "
                  f"{r['batch_output_tokens_per_s']} tok/s (TTFT p99 {r['batch_ttft_p99_s']} s, last done at "
                  f"{r['batch_done_at_s']} s); goodput {r['goodput_req_per_s']} req/s; "
                  f"failed {r['failed']}; actions {[(a['at_s'], a['action'], a['move'] or a['knobs']) for a in r['actions']]}")
    if set(modes) != {"colocated", "dedicated", "auto"}:
        return
    best_static = max(runs["colocated"]["slo_windows_share"], runs["dedicated"]["slo_windows_share"])
    ratio = runs["auto"]["slo_windows_share"] / best_static if best_static else float("inf")
    batch_ratio = (runs["auto"]["batch_output_tokens_per_s"] / runs["colocated"]["batch_output_tokens_per_s"]
                   if runs["colocated"]["batch_output_tokens_per_s"] else 0.0)
    bursts = int(shape.duration_s // shape.burst_every_s)
    if args.plot:
        plot(runs, ROOT / "docs" / "img" / "hybrid.png", shape)
    report({
        "benchmark": "hybrid",
        "ratio": round(ratio, 3),
        "target": 1.0,
        "batch_throughput_ratio": round(batch_ratio, 3),
        "batch_throughput_target": 0.9,
        "failed": {m: r["failed"] for m, r in runs.items()},
        "reshapes_per_burst": round(runs["auto"]["reshapes"] / bursts, 2),
        "runs": {m: {k: v for k, v in r.items() if k != "windows"} | {"windows": r["windows"]} for m, r in runs.items()},
        "pass": ratio >= 1 and batch_ratio >= 0.9 and not any(r["failed"] for r in runs.values())
        and runs["auto"]["reshapes"] <= 2 * bursts,
        "machine": machine(),
    }, quick=args.quick)


if __name__ == "__main__":
    main()
