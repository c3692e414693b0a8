"""Capacity at SLO: the highest request rate at which a policy still meets its latency targets,
found by bisection over the trace's time scale.

A rate is *met* when every request was served (none dropped) and each named percentile is within
its target (``{"itl_ms": ("p99", 100.0), "ttft_ms": ("p50", 2000.0)}``: Sarathi-Serve's capacity
is the highest load at which the P99 time between tokens stays under its SLO while the median
scheduling delay stays under 2 s). Latency grows with load, so met-ness is taken as monotone in
the rate: the search halves the rate until it is met (at most 10 times), doubles it until it
fails, then bisects until the bracket is within ``tolerance`` (relative).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cadenza.loadgen.trace import TraceRequest
from cadenza.sim.report import LatencySummary

Targets = Mapping[str, tuple[str, float]]  # summary field -> (percentile, limit in ms)


def slo_met(summary: LatencySummary, targets: Targets) -> bool:
    """Nothing dropped, and every target's percentile within its limit."""
    if summary.rejected or not summary.requests:
        return False
    return all(getattr(summary, name)[q] <= limit for name, (q, limit) in targets.items())


def pool_slo_met(result: Any, slo: Mapping[str, Mapping[str, float]]) -> bool:
    """A fleet run (:class:`~cadenza.sim.fleet.FleetResult`) within a ServingPool's SLOs: nothing
    dropped, and for each class with targets and requests, its p99 TTFT within ``ttftP99Ms`` and
    its p99 ITL within ``itlP99Ms``."""
    if result.dropped:
        return False
    for cls, targets in slo.items():
        summary = result.by_class.get(cls)
        if summary is None or not summary.requests:
            continue
        if targets.get("ttftP99Ms") and not summary.ttft_ms["p99"] <= targets["ttftP99Ms"]:
            return False
        if targets.get("itlP99Ms") and not summary.itl_ms["p99"] <= targets["itlP99Ms"]:
            return False
    return True


def at_rate(trace: Sequence[TraceRequest], rate: float) -> list[TraceRequest]:
    """``trace`` with its arrivals stretched or squeezed to ``rate`` requests/s on average (its
    lengths, classes and tenants kept).

    Raises:
        ValueError: fewer than two requests, or all arriving at once (no rate to scale).
    """
    span = trace[-1].arrival_s - trace[0].arrival_s if len(trace) > 1 else 0.0
    if not span > 0:
        raise ValueError("a trace needs two or more requests spread over time to be scaled to a rate")
    factor = (len(trace) - 1) / rate / span
    return [dataclasses.replace(r, arrival_s=r.arrival_s * factor) for r in trace]


@dataclass
class Capacity:
    """The result of a sweep.

    Attributes:
        rate: the highest rate found met (requests/s; 0.0 if even ``low / 1024`` failed).
        runs: every (rate, met, result) evaluated, in order.
    """

    rate: float
    runs: list[tuple[float, bool, Any]] = field(default_factory=list)


def capacity_at_slo(run: Callable[[float], Any], targets: Targets | None, low: float, high: float,
                    tolerance: float = 0.03, max_runs: int = 40,
                    check: Callable[[Any], bool] | None = None) -> Capacity:
    """The highest rate in requests/s at which ``run(rate)`` meets ``targets``.

    Args:
        run: simulates the workload at a rate (e.g. the trace with its time scale set so).
        targets: what a :class:`LatencySummary` from ``run`` must meet (:func:`slo_met`).
        low, high: the first bracket; ``low`` halves while it is not met, ``high`` doubles while
            it is.
        check: instead of ``targets``, whether ``run``'s result is met (e.g. :func:`pool_slo_met`).

    Raises:
        ValueError: ``0 < low < high`` does not hold.
    """
    if not 0 < low < high:
        raise ValueError(f"need 0 < low < high, got {low}, {high}")
    result = Capacity(0.0)

    def met(rate: float) -> bool:
        summary = run(rate)
        ok = check(summary) if check is not None else slo_met(summary, targets or {})
        result.runs.append((rate, ok, summary))
        return ok

    floor = low / 1024
    while not met(low):  # the first bracket is already too fast: search down
        if low / 2 < floor or len(result.runs) >= max_runs:
            return result
        low, high = low / 2, low
    while met(high):
        low, high = high, 2 * high
        if len(result.runs) >= max_runs:
            result.rate = low
            return result
    while high / low > 1 + tolerance and len(result.runs) < max_runs:
        mid = (low * high) ** 0.5
        if met(mid):
            low = mid
        else:
            high = mid
    result.rate = low
    return result
