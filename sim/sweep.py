"""Capacity at SLO: the highest request rate at which a policy still meets its latency targets,
found by bisection over the trace's time scale.

A rate is *met* when every request was served (none dropped) and each named percentile is within
its target (``{"itl_ms": ("p99", 100.0), "ttft_ms": ("p50", 2000.0)}``: Sarathi-Serve's capacity
is the highest load at which the P99 time between tokens stays under its SLO while the median
scheduling delay stays under 2 s). Latency grows with load, so met-ness is taken as monotone in
the rate: the search doubles the rate until it fails, then bisects until the bracket is within
``tolerance`` (relative).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cadenza.sim.report import LatencySummary

Targets = Mapping[str, tuple[str, float]]  # summary field -> (percentile, limit in ms)


def slo_met(summary: LatencySummary, targets: Targets) -> bool:
    """Nothing dropped, and every target's percentile within its limit."""
    if summary.rejected or not summary.requests:
        return False
    return all(getattr(summary, name)[q] <= limit for name, (q, limit) in targets.items())


@dataclass
class Capacity:
    """The result of a sweep.

    Attributes:
        rate: the highest rate found met (requests/s; 0.0 if even ``low`` failed).
        runs: every (rate, met, summary) evaluated, in order.
    """

    rate: float
    runs: list[tuple[float, bool, LatencySummary]] = field(default_factory=list)


def capacity_at_slo(run: Callable[[float], LatencySummary], targets: Targets, low: float, high: float,
                    tolerance: float = 0.03, max_runs: int = 40) -> Capacity:
    """The highest rate in requests/s at which ``run(rate)`` meets ``targets``.

    Args:
        run: simulates the workload at a rate (e.g. the trace with its time scale set so).
        low, high: the first bracket; ``high`` doubles while it is still met.

    Raises:
        ValueError: ``0 < low < high`` does not hold.
    """
    if not 0 < low < high:
        raise ValueError(f"need 0 < low < high, got {low}, {high}")
    result = Capacity(0.0)

    def met(rate: float) -> bool:
        summary = run(rate)
        ok = slo_met(summary, targets)
        result.runs.append((rate, ok, summary))
        return ok

    if not met(low):
        return result
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
