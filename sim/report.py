"""The latency report of simulated requests: TTFT, ITL and TPOT percentiles from their timelines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cadenza.sim.replica import RequestTimes


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
