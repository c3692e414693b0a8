"""Scheduler + block manager cost per step, no model: ``python -m bench.scheduler_overhead``.

256 requests decode while N wait (N = 100, 1,000, 10,000; they cannot be admitted:
``max_num_seqs`` = 256, and the interactive queue bound is raised to hold them). A step is
``schedule()`` plus ``update_from_output()`` with one fake token per row. Prefix caching is on, as
it is by default: every decode registers its full blocks (SHA-256 block hashes), and the
identical prompts make the 256 admissions after the first hit the cache (the hit rate is printed).
Configurations are measured interleaved, several rounds, median per step.
Targets: ≤ 150 µs per step with 1,000 waiting (nano-vllm's simpler scheduler took 167–182 µs on this
machine); growth from 100 to 10,000 waiting < 1.5x. ``--quick``: one round of 20 steps, 32 decoding.
"""

from __future__ import annotations

import gc
import statistics
import time

from bench.common import arguments, machine, report
from cadenza.node.core.block_manager import KVBlockManager
from cadenza.node.core.config import SchedulerConfig
from cadenza.node.core.policy import Policy
from cadenza.node.core.request import Request, SamplingParams
from cadenza.node.core.scheduler import Scheduler

RUNNING, PROMPT, STEPS, ROUNDS = 256, 64, 400, 7
QUICK_RUNNING, QUICK_STEPS, QUICK_ROUNDS = 32, 20, 1
WAITING = (100, 1_000, 10_000)


def build(num_waiting: int, running: int = RUNNING) -> Scheduler:
    policy = Policy().updated({"classes": {"interactive": {"max_queue_depth": max(WAITING)}}})
    config = SchedulerConfig(token_budget=512, chunk_size=256, max_num_seqs=running, max_model_len=8192,
                             prefix_caching=True, policy=policy)
    sched = Scheduler(config, KVBlockManager(num_blocks=running * 160 + 64, block_size=16))
    sp = SamplingParams(max_tokens=4096, temperature=0, ignore_eos=True)
    for i in range(running):
        sched.add_request(Request(f"run{i}", [1] * PROMPT, sp, arrival_time=float(i)))
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running) or sched.num_waiting:
        step(sched)
    for i in range(num_waiting):
        sched.add_request(Request(f"wait{i}", [1] * PROMPT, sp, arrival_time=1e6 + i))
    return sched


def step(sched: Scheduler) -> None:
    out = sched.schedule()
    sched.update_from_output(out, [7] * out.num_sampled)


def time_steps(sched: Scheduler, steps: int = STEPS) -> float:
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(steps):
            step(sched)
        return (time.perf_counter() - start) / steps * 1e6
    finally:
        gc.enable()


def main() -> None:
    args = arguments(__doc__)
    running, steps, rounds = (QUICK_RUNNING, QUICK_STEPS, QUICK_ROUNDS) if args.quick else (RUNNING, STEPS, ROUNDS)
    samples: dict[int, list[float]] = {n: [] for n in WAITING}
    hit_rate = 0.0
    for _ in range(rounds):
        for n in WAITING:
            sched = build(n, running)
            assert sched.num_running == running and sched.num_waiting == n
            stats = sched.stats
            hit_rate = stats.prefix_cache_hit_tokens / stats.prefix_cache_queried_tokens
            samples[n].append(time_steps(sched, steps))
    print(f"prefix caching on: {hit_rate:.1%} of the admitted prompts' tokens hit the cache")
    median = {n: statistics.median(v) for n, v in samples.items()}
    for n in WAITING:
        print(f"{running} decoding, {n:>6} waiting: {median[n]:7.1f} µs/step (min {min(samples[n]):.1f})")
    growth = median[10_000] / median[100]
    print(f"growth 100 -> 10,000 waiting: {growth:.2f}x (target < 1.5x); "
          f"1,000 waiting: {median[1_000]:.0f} µs (target ≤ 150 µs)")
    report({
        "benchmark": "scheduler_overhead",
        "ratio": round(growth, 3),
        "target": 1.5,
        "step_us_1000_waiting": round(median[1_000], 1),
        "step_us_target": 150,
        "step_us": {str(n): round(m, 1) for n, m in median.items()},
        "prefix_caching": True,
        "prefix_cache_hit_rate": round(hit_rate, 4),
        "pass": growth < 1.5 and median[1_000] <= 150,
        "machine": machine(),
    }, quick=args.quick)


if __name__ == "__main__":
    main()
