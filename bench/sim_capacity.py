"""Capacity at SLO in the simulator, chunked prefill against prefill-first: ``python -m bench.sim_capacity``.

Mistral-7B (v0.1 dims) on one A100-80G profile, the first 1,000 requests of the Azure 2023
conversation trace (prompts capped at 4,096 tokens and outputs at 1,024, so every request fits an
8,192-token ``max_model_len``), arrivals rescaled to each tested rate. SLO as Sarathi-Serve's
capacity runs: P99 time between tokens at most 100 ms (its strict, "100 ms-class" SLO for this
model and GPU) and the median TTFT at most 2 s (its median scheduling-delay bound), with nothing
dropped. Policies, same trace and cost model: cadenza's scheduler with 512-token chunks and a
512-token budget (Sarathi-Serve's setting for the strict SLO), and prefill-first unchunked
scheduling (:class:`cadenza.sim.baselines.PrefillFirstScheduler`, vLLM V0's default, an
8,192-token budget). Capacity by bisection (:mod:`cadenza.sim.sweep`, 2 % tolerance). Prefix
caching on (the default; synthetic prompts never repeat, so nothing hits). Target: chunked
capacity >= 2.0x prefill-first's (Sarathi-Serve reports 2.6x on this setup). Last line JSON.
``--quick``: the first 100 requests, bisection to 50 %.
"""

from __future__ import annotations

import time

from bench.common import arguments, conv_trace, machine, report
from cadenza.node.core.config import SchedulerConfig
from cadenza.node.core.scheduler import Scheduler
from cadenza.loadgen.trace import scale_trace
from cadenza.sim.baselines import PrefillFirstScheduler
from cadenza.sim.hardware import PROFILES
from cadenza.sim.model_dims import load_model_dims
from cadenza.sim.roofline import Roofline
from cadenza.sim.fleet import simulate_replica
from cadenza.sim.sweep import at_rate, capacity_at_slo

REQUESTS, TOLERANCE = 1000, 0.02
QUICK_REQUESTS, QUICK_TOLERANCE = 100, 0.5
TARGETS = {"itl_ms": ("p99", 100.0), "ttft_ms": ("p50", 2000.0)}
POLICIES = {
    "chunked (cadenza, 512-token chunks)": (SchedulerConfig(token_budget=512, chunk_size=512, max_num_seqs=256,
                                                             max_model_len=8192), Scheduler),
    "prefill-first, unchunked": (SchedulerConfig(token_budget=8192, chunk_size=None, max_num_seqs=256,
                                                 max_model_len=8192), PrefillFirstScheduler),
}


def main() -> None:
    args = arguments(__doc__)
    requests, tolerance = (QUICK_REQUESTS, QUICK_TOLERANCE) if args.quick else (REQUESTS, TOLERANCE)
    base = scale_trace(conv_trace(), num_requests=requests, max_input_len=4096, max_output_len=1024).requests
    model = Roofline(load_model_dims("mistral-7b"), PROFILES["a100-80g"])
    capacity, wall = {}, {}
    for name, (config, cls) in POLICIES.items():
        started = time.perf_counter()
        found = capacity_at_slo(lambda rate, c=config, k=cls: simulate_replica(at_rate(base, rate), c, model,
                                                                               scheduler_cls=k)[1],
                                TARGETS, low=0.25, high=0.5, tolerance=tolerance)
        wall[name] = time.perf_counter() - started
        capacity[name] = found.rate
        at = next(s for r, ok, s in reversed(found.runs) if ok and r == found.rate) if found.rate else None
        figures = (f"ITL p99 {at.itl_ms['p99']:.0f} ms, TTFT p50 {at.ttft_ms['p50']:.0f} ms there"
                   if at else "no rate met")
        print(f"{name:>36}: {found.rate:.2f} req/s at SLO ({figures}; {len(found.runs)} runs, {wall[name]:.0f} s)")
    chunked, first = capacity.values()
    ratio = chunked / first if first else float("inf")
    print(f"capacity at SLO, chunked / prefill-first: {ratio:.2f}x (target >= 2.0; Sarathi-Serve reports 2.6x)")
    report({
        "benchmark": "sim_capacity",
        "ratio": round(ratio, 3),
        "target": 2.0,
        "capacity_req_s": {k: round(v, 3) for k, v in capacity.items()},
        "slo": {"itl_p99_ms": 100.0, "ttft_p50_ms": 2000.0, "dropped": 0},
        "setup": {"model": "mistral-7b", "hardware": "a100-80g", "trace": "azure2023 conv", "requests": requests,
                  "prompts_capped": 4096, "outputs_capped": 1024},
        "wall_s": {k: round(v, 1) for k, v in wall.items()},
        "prefix_caching": True, "prefix_cache_hit_rate": 0.0,
        "pass": ratio >= 2.0,
        "machine": machine(),
    }, quick=args.quick)


if __name__ == "__main__":
    main()
