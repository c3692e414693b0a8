"""Hybrid mode at fleet scale, in the simulator: ``python -m bench.sim_hybrid``.

Eight replicas of Llama-3.1-8B on H100 (the data-sheet profile) serve a bursty mixed workload
from the Azure 2023 traces: the conversation trace as steady ``interactive`` traffic (its first
hour at ``CONV_RATE`` times its rate) and bursts of the code trace as ``batch`` (every
``BURST_EVERY_S``, ``BURST_S`` seconds of code-trace requests at ``BURST_RATE`` times the code
trace's own rate, lengths as recorded). SLOs: interactive TTFT p99 <= 1 s and ITL p99 <= 50 ms,
batch TTFT p99 <= 60 s (a request meets its SLO when its TTFT and its own p99 ITL are within its
class's targets: vLLM's ``--goodput`` rule).

Three shapes of the same pool, same trace, same cost model: static ``colocated`` (every replica
serves both classes, chunked prefill with decode reservation), static ``dedicated`` (the best
split of interactive-only and batch replicas, every split tried) and ``auto`` (the SLO
controller moving replicas and retuning knobs at run time, with a 15 s scrape delay and a 10 s
reshape delay). Reported: goodput (requests/s within SLO), per-class attainment, drops, and
``auto``'s reshapes; then ``auto`` alone on a stationary segment (the conversation traffic with
no bursts) for its reshapes per simulated hour.

Targets (issue 13): ``auto`` goodput >= 1.3x the better static shape (``ratio``), zero dropped
requests, <= 4 reshapes per simulated hour on the stationary segment. Last line JSON.
"""

from __future__ import annotations

import argparse
import copy
import time

from bench.common import CONV_TRACE, ROOT, machine, report
from cadenza.node.replay.trace import TraceRequest, load_trace
from cadenza.sim.hardware import PROFILES
from cadenza.sim.model_dims import load_model_dims
from cadenza.sim.policies import Policy, PolicyRun, run_policy
from cadenza.sim.pool import fleet_layout
from cadenza.sim.roofline import Roofline

CODE_TRACE = ROOT / "data" / "traces" / "azure2023" / "AzureLLMInferenceTrace_code.csv"
REPLICAS = 8
DURATION_S = 600.0
CONV_RATE = 32
BURST_S, BURST_RATE = 200.0, 4.0
BURSTS = (200.0,)  # burst starts (s)
DEDICATED_CHUNK = 256
SPLITS = (5, 6, 7)  # interactive replicas of the dedicated shapes tried (fewer starve interactive further)
SLO = {"interactive": {"ttftP99Ms": 1000, "itlP99Ms": 50}, "batch": {"ttftP99Ms": 60000}}
POOL = {
    "apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool",
    "metadata": {"name": "bursty", "namespace": "default"},
    "spec": {"model": {"name": "Llama-3.1-8B-Instruct", "source": {"path": "/models/llama"}},
             "replicas": REPLICAS, "mode": "colocated",
             "engine": {"tokenBudget": 2048, "chunkSize": 1024, "maxNumSeqs": 256, "maxModelLen": 16384},
             "slo": SLO,
             "controller": {"fastWindowSeconds": 20, "windowSeconds": 60, "cooldownSeconds": 120, "minSamples": 200,
                            "bounds": {"chunkSize": {"min": 128, "max": 1024}}}},
}


def workload(bursts: bool = True, duration_s: float = DURATION_S) -> list[TraceRequest]:
    """The conversation trace as interactive (``CONV_RATE`` copies of its hour overlaid, each
    shifted by an equal share of it), with (``bursts``) the code trace's bursts as batch."""
    conv = load_trace(CONV_TRACE)
    span = conv[-1].arrival_s
    out = [TraceRequest((r.arrival_s + k * span / CONV_RATE) % span, r.input_len, r.output_len, "interactive", "chat")
           for k in range(int(CONV_RATE)) for r in conv]
    out = [r for r in out if r.arrival_s < duration_s]
    if bursts:
        code = load_trace(CODE_TRACE)
        i = 0
        for start in BURSTS:
            if start >= duration_s:
                break
            i %= len(code) - 1  # past its end, the code trace starts over
            offset = code[i].arrival_s
            while i < len(code) and (code[i].arrival_s - offset) / BURST_RATE < BURST_S:
                r = code[i]
                out.append(TraceRequest(start + (r.arrival_s - offset) / BURST_RATE, r.input_len, r.output_len,
                                        "batch", "code"))
                i += 1
    out = [r for r in out if r.input_len + r.output_len <= 16384 and r.input_len > 0]
    return sorted(out, key=lambda r: r.arrival_s)


def pool(mode: str, interactive: int | None = None) -> dict:
    doc = copy.deepcopy(POOL)
    doc["spec"]["mode"] = mode
    if interactive is not None:  # interactive replicas with small chunks, as a dedicated pool is meant to run
        doc["spec"]["dedicated"] = {"interactiveReplicas": interactive, "engine": {"chunkSize": DEDICATED_CHUNK}}
    return doc


def run(name: str, doc: dict, trace: list[TraceRequest], model: Roofline) -> PolicyRun:
    started = time.perf_counter()
    result = run_policy(Policy(name, fleet_layout(doc, model)), trace, model)
    met = ", ".join(f"{cls} {100 * (s.slo_attainment or 0):.1f} %" for cls, s in result.result.by_class.items())
    print(f"{name:>22}: goodput {result.goodput_rps:.2f} req/s; SLO met {met}; {result.result.dropped} dropped, "
          f"{result.reshapes} reshapes ({time.perf_counter() - started:.0f} s)")
    return result


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    model = Roofline(load_model_dims("llama-3.1-8b"), PROFILES["h100-sxm"])
    trace = workload()
    print(f"{len(trace)} requests over {DURATION_S:.0f} s: {sum(r.traffic_class == 'batch' for r in trace)} batch "
          f"in bursts of {BURST_S:.0f} s every {BURST_EVERY_S:.0f} s")
    runs = {"colocated": run("colocated", pool("colocated"), trace, model)}
    for k in SPLITS:
        runs[f"dedicated {k}+{REPLICAS - k}"] = run(f"dedicated {k}+{REPLICAS - k}", pool("dedicated", k), trace, model)
    auto = run("auto", pool("auto"), trace, model)
    best_name = max(runs, key=lambda n: runs[n].goodput_rps)
    best = runs[best_name].goodput_rps
    ratio = auto.goodput_rps / best if best else float("inf")
    print(f"auto / best static ({best_name}): {ratio:.2f}x goodput (target >= 1.3)")
    stationary = run("auto, no bursts", pool("auto"), workload(bursts=False), model)
    per_hour = stationary.reshapes / (DURATION_S / 3600.0)
    print(f"auto on the stationary segment: {per_hour:.1f} reshapes per simulated hour (target <= 4)")
    report({
        "benchmark": "sim_hybrid",
        "ratio": round(ratio, 3),
        "target": 1.3,
        "goodput_rps": {**{n: round(r.goodput_rps, 3) for n, r in runs.items()}, "auto": round(auto.goodput_rps, 3)},
        "best_static": best_name,
        "dropped": {**{n: r.result.dropped for n, r in runs.items()}, "auto": auto.result.dropped},
        "auto_reshapes": auto.reshapes,
        "stationary_reshapes_per_hour": per_hour,
        "slo": SLO,
        "setup": {"model": "llama-3.1-8b", "hardware": "h100-sxm", "replicas": REPLICAS, "duration_s": DURATION_S,
                  "conv_rate": CONV_RATE, "burst": {"every_s": BURST_EVERY_S, "length_s": BURST_S,
                                                    "rate": BURST_RATE}},
        "pass": ratio >= 1.3 and auto.result.dropped == 0 and per_hour <= 4,
        "machine": machine(),
    })


if __name__ == "__main__":
    main()
