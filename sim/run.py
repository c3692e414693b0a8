"""A trace through one simulated replica on the virtual clock, and the latency report of it.

The loop is event-driven: while the replica has work, each step runs from the clock's time and the
clock jumps to the step's end; requests that arrived meanwhile are queued then (their TTFT counts
from their true arrival); an idle replica jumps to the next arrival. Nothing here sleeps, so a run
takes what the scheduler's own code takes per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cadenza.node.core.admission import AdmissionError
from cadenza.node.core.config import SchedulerConfig
from cadenza.node.core.scheduler import Scheduler
from cadenza.node.replay.trace import TraceRequest
from cadenza.sim.replica import RequestTimes, SimReplica, VirtualClock
from cadenza.sim.roofline import Roofline


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Percentiles (milliseconds) of a set of requests' timelines, and how many there were.

    Attributes:
        requests: requests that finished; rejected: refused at admission.
        ttft_ms, itl_ms, tpot_ms: ``{"p50", "p95", "p99"}`` (TPOT: a request's mean gap).
        output_tokens_per_s: output tokens over the virtual span from the first arrival to the
            last finish.
    """

    requests: int
    rejected: int
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tpot_ms: dict[str, float]
    output_tokens_per_s: float


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not len(values):
        return {"p50": float("nan"), "p95": float("nan"), "p99": float("nan")}
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    return {f"p{q}": float(np.percentile(arr, q)) for q in (50, 95, 99)}


def summarize(times: Sequence[RequestTimes], rejected: int = 0) -> LatencySummary:
    """The latency report of finished timelines (unfinished ones are left out)."""
    done = [t for t in times if t.finished_s is not None]
    gaps = [g for t in done for g in t.itl_s]
    tpot = [(t.token_s[-1] - t.token_s[0]) / (len(t.token_s) - 1) for t in done if len(t.token_s) > 1]
    tokens = sum(len(t.token_s) for t in done)
    span = (max(t.finished_s for t in done) - min(t.arrival_s for t in done)) if done else 0.0
    return LatencySummary(len(done), rejected, _percentiles([t.ttft_s for t in done]), _percentiles(gaps),
                          _percentiles(tpot), tokens / span if span > 0 else 0.0)


def simulate_replica(trace: Sequence[TraceRequest], config: SchedulerConfig, roofline: Roofline,
                     block_size: int = 16, max_steps: int = 10_000_000,
                     scheduler_cls: type[Scheduler] = Scheduler) -> tuple[SimReplica, LatencySummary]:
    """Replay ``trace`` (arrivals in seconds, lengths in tokens) against one simulated replica
    whose scheduler is ``scheduler_cls`` (cadenza's, or a baseline).

    Raises:
        RuntimeError: the replica stopped making progress with requests left (a scheduler bug),
            or ran past ``max_steps``.
    """
    clock = VirtualClock()
    replica = SimReplica(config, roofline, clock, block_size, scheduler_cls=scheduler_cls)
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    rejected, nxt = 0, 0
    while nxt < len(order) or replica.has_work:
        if not replica.has_work:
            clock.now = max(clock.now, trace[order[nxt]].arrival_s)
        while nxt < len(order) and trace[order[nxt]].arrival_s <= clock.now:
            i = order[nxt]
            nxt += 1
            try:
                replica.add_request(f"r{i}", i, trace[i].input_len, trace[i].output_len, trace[i].arrival_s)
            except AdmissionError:
                rejected += 1
        if replica.step() is None:
            if nxt < len(order):
                clock.now = max(clock.now, trace[order[nxt]].arrival_s)
                continue
            if replica.has_work:
                raise RuntimeError(f"the replica stopped with {len(replica.scheduler.requests)} requests left")
            break
        clock.now = replica.busy_until
        if replica.steps > max_steps:
            raise RuntimeError(f"more than {max_steps} steps")
    return replica, summarize(list(replica.times.values()), rejected)
