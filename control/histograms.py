"""Cumulative bucket histograms, as the gateways and engines expose them: sums, deltas, and the
estimates the SLO signals read from them.

A histogram is cumulative counts per finite upper bound plus the total (the ``+Inf`` bucket).
Two snapshots of one make a window (:meth:`Histogram.since`, a counter reset handled); the
p99 of a window is interpolated linearly inside the bucket that holds it, and the SLO
attainment (the share of observations at or under a target) the same way — as Prometheus'
``histogram_quantile`` does. The estimate is only as fine as the buckets: the gateway's
boundaries are dense around each SLO target (:func:`cadenza.gateway.metrics.latency_buckets`),
so a p99 near the target is within a few per cent of the truth.

Pure arithmetic: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts of one histogram.

    Attributes:
        bounds: finite upper bounds, ascending (the ``+Inf`` bucket is implied).
        counts: cumulative counts, one per bound, then the total (``len(bounds) + 1`` values).
    """

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.bounds) + 1:
            raise ValueError(f"{len(self.bounds)} bounds need {len(self.bounds) + 1} counts, got {len(self.counts)}")

    @property
    def total(self) -> float:
        return self.counts[-1]

    @property
    def finite(self) -> bool:
        """Every count a finite, non-negative number (else the series is unusable: unknown)."""
        return all(math.isfinite(c) and c >= 0 for c in self.counts)

    @classmethod
    def from_buckets(cls, per: Mapping[float, float]) -> Histogram:
        """From ``{le: cumulative count}`` as exposed or queried. A missing ``+Inf`` bucket takes the
        last finite one's count; counts that go down from one bound to the next (scrape races,
        ``increase()`` extrapolation) are raised to the running maximum, as Prometheus'
        ``histogram_quantile`` does. NaN and negative counts are kept, for :attr:`finite` to refuse."""
        finite = sorted(b for b in per if math.isfinite(b))
        counts = [per[b] for b in finite] + [per.get(math.inf, per[finite[-1]] if finite else 0.0)]
        if all(math.isfinite(c) and c >= 0 for c in counts):
            for i in range(1, len(counts)):
                counts[i] = max(counts[i], counts[i - 1])
        return cls(tuple(finite), tuple(counts))

    def __add__(self, other: Histogram) -> Histogram:
        """Sum of two histograms with the same bounds (two gateway pods).

        Raises:
            ValueError: different bounds.
        """
        if other.bounds != self.bounds:
            raise ValueError("cannot add histograms with different bucket bounds")
        return Histogram(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts)))

    def since(self, older: Histogram | None) -> Histogram:
        """What was observed after ``older`` (itself when ``older`` is None, has other bounds, or
        is larger anywhere, i.e. the counters were reset in between)."""
        if older is None or older.bounds != self.bounds or any(o > n for o, n in zip(older.counts, self.counts)):
            return self
        return Histogram(self.bounds, tuple(n - o for n, o in zip(self.counts, older.counts)))

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0 < q < 1), interpolated linearly inside its bucket; None when empty.

        A quantile in the ``+Inf`` bucket is reported as the largest finite bound (a lower bound
        of the truth, as Prometheus does).
        """
        total = self.total
        if total <= 0:
            return None
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts):
            if count >= rank:
                width = count - lower_count
                return lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width else 1.0)
            lower_bound, lower_count = bound, count
        return self.bounds[-1] if self.bounds else None

    def share_at_most(self, x: float) -> float | None:
        """Share of observations ``<= x``, interpolated inside the bucket holding ``x``; None when empty."""
        total = self.total
        if total <= 0:
            return None
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts):
            if x <= bound:
                frac = (x - lower_bound) / (bound - lower_bound) if bound > lower_bound else 1.0
                return (lower_count + frac * (count - lower_count)) / total
            lower_bound, lower_count = bound, count
        return lower_count / total  # x is past the last finite bound: the +Inf bucket counts as over

    def mass_share_at_least(self, x: float) -> float | None:
        """Share (0-1) of the observed values' sum held by observations ``>= x``: for a histogram
        of prompt lengths, the share of prompt tokens in prompts at least ``x`` long. Each
        bucket's observations are spread evenly over it (so a bucket holds count x its midpoint,
        and the part of the bucket holding ``x`` above it is interpolated); the ``+Inf`` bucket's
        sit at the largest finite bound. An estimate, as fine as the buckets; None when empty."""
        above = total = 0.0
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            n = count - lower_count
            if n > 0:
                if math.isinf(bound):  # past the last finite bound: counted there, a lower bound of the truth
                    mass, part = n * lower_bound, n * lower_bound if x <= lower_bound else 0.0
                else:
                    mass = n * (lower_bound + bound) / 2
                    cut = min(bound, max(lower_bound, x))  # the observations from ``cut`` up are >= x
                    part = n * (bound - cut) / (bound - lower_bound) * (cut + bound) / 2 if bound > lower_bound else (
                        mass if x <= bound else 0.0)
                total, above = total + mass, above + part
            lower_bound, lower_count = bound, count
        return above / total if total > 0 else None

