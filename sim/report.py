"""The latency report of simulated requests: TTFT, ITL and TPOT percentiles from their timelines,
and SLO attainment and goodput as ``cadenza bench`` counts them (:mod:`cadenza.loadgen.report`:
a request meets its class's SLO when its TTFT is within ``ttftP99Ms`` and its own p99 ITL within
``itlP99Ms``, vLLM's ``--goodput`` rule; a dropped request meets none); what a fleet run
reports (:class:`FleetResult`), and the latency observations it records as the gateway's
histograms would (:class:`Observations`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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
        slo_met: finished requests within the class's SLO (all of them when it has none).
        slo_attainment: ``slo_met`` over the requests finished or rejected (None: none were).
        goodput_rps: ``slo_met`` per second of the run's span (None when no span was given).
    """

    requests: int
    rejected: int
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tpot_ms: dict[str, float]
    output_tokens_per_s: float
    slo_met: int = 0
    slo_attainment: float | None = None
    goodput_rps: float | None = None


def meets_slo(times: RequestTimes, slo: Mapping[str, float]) -> bool:
    """A finished request's TTFT within ``slo["ttftP99Ms"]`` and its p99 ITL within ``slo["itlP99Ms"]``
    (either absent: not checked)."""
    ttft, itl = slo.get("ttftP99Ms"), slo.get("itlP99Ms")
    if ttft and (times.ttft_s is None or times.ttft_s * 1e3 > ttft):
        return False
    gaps = times.itl_s
    return not (itl and gaps and float(np.percentile(gaps, 99)) * 1e3 > itl)


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    if not len(values):
        return {"p50": float("nan"), "p95": float("nan"), "p99": float("nan")}
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    return {f"p{q}": float(np.percentile(arr, q)) for q in (50, 95, 99)}


def summarize(times: Sequence[RequestTimes], rejected: int = 0, slo: Mapping[str, float] | None = None,
              span_s: float | None = None) -> LatencySummary:
    """The latency report of finished timelines (unfinished ones are left out), against ``slo``
    (``ttftP99Ms`` / ``itlP99Ms``, a ServingPool's per-class targets) over a run of ``span_s``."""
    done = [t for t in times if t.finished_s is not None]
    met = sum(meets_slo(t, slo or {}) for t in done)
    total = len(done) + rejected
    gaps = [g for t in done for g in t.itl_s]
    tpot = [(t.token_s[-1] - t.token_s[0]) / (len(t.token_s) - 1) for t in done if len(t.token_s) > 1]
    tokens = sum(len(t.token_s) for t in done)
    span = (max(t.finished_s for t in done) - min(t.arrival_s for t in done)) if done else 0.0
    return LatencySummary(len(done), rejected, _percentiles([t.ttft_s for t in done]), _percentiles(gaps),
                          _percentiles(tpot), tokens / span if span > 0 else 0.0, met,
                          met / total if total else None, met / span_s if span_s else None)


@dataclass(frozen=True, slots=True)
class FleetResult:
    """A fleet run: the latency report per traffic class, and the counts.

    Attributes:
        by_class: class -> :class:`LatencySummary` of its requests (``rejected``: dropped ones),
            against the class's SLO.
        dropped: requests no replica took (the gateway's 429, every tried replica's 429, or a
            replica's 400 or 413, which is not retried).
        steps: steps run per replica.
        span_s: virtual seconds from the first arrival to the last finish.
        kv_usage: ``mean`` (KV blocks in use over the replicas' capacity, averaged over the span)
            and ``peak`` (the highest any replica reached at a step's end).
        preemptions: requests preempted, by the victim's class.
        kv_transfer: with a ``prefill`` role, ``moved`` (prompts prefilled elsewhere), ``bytes``
            (their KV), ``fallbacks`` (moves no prefill replica took), ``kept_queued`` (prompts
            long enough for an idle prefill replica but not after the queue of the one they would
            have gone to) and ``min_prompt_tokens`` (the threshold with an idle prefill replica
            last computed; None: nothing was worth moving).
    """

    by_class: dict[str, LatencySummary]
    dropped: int
    steps: dict[str, int]
    span_s: float = 0.0
    kv_usage: dict[str, float] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)
    kv_transfer: dict[str, float | None] = field(default_factory=dict)


@dataclass
class Observations:
    """One class's latency observations in time order: TTFTs at their first token's time, and
    inter-token gaps at their later token's time (seconds)."""

    ttft_t: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    itl_t: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
