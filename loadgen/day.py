"""A compressed day of traffic from the Azure 2023 traces, reproducible from a seed: interactive
load that follows a diurnal curve with minute-scale bursts, and batch load phased against it
with longer prompts while interactive is low (issue 31's workload; ``bench/sim_hybrid_day.py``).

The recipe (:class:`DayRecipe`; :meth:`Day.trace` builds the requests), for a day of
``duration_s`` seconds that stands for 24 hours (hour ``h = 24 t / duration_s``):

1. **The phase.** ``s(t) = (1 - cos(2 pi (h - peak_hour + 12) / 24)) / 2``: 0 at the interactive
   trough (``peak_hour - 12``), 1 at its peak (``peak_hour``).
2. **Interactive** (the conversation trace): a Poisson process of rate
   ``peak_rps x (1 / peak_to_trough + (1 - 1 / peak_to_trough) s(t)) x burst(t)``, each request's
   prompt and output lengths one of the trace's requests, drawn at random. ``burst(t)`` is 1
   outside bursts; bursts start as a Poisson process (one every ``burst_every_s`` on average),
   each lasting a uniform ``burst_s`` seconds at a uniform ``burst_factor`` (overlaps take the
   larger factor) — the minute-scale swings of Azure's online load (HyGen, arXiv 2501.14808).
3. **Batch** (the code trace): a Poisson process of rate
   ``batch_rps x (batch_floor + (1 - batch_floor)(1 - s(t)))``: highest at the interactive
   trough, ``batch_floor`` of that at its peak. Its lengths are drawn as interactive's, from the
   code trace, with the prompt scaled by ``1 + (batch_prompt_scale - 1)(1 - s(t))`` (longer
   prompts in the batch phase, as recorded at the interactive peak), rounded, capped so that
   prompt + output fits ``max_model_len``.

Every random draw comes from one ``numpy.random.Generator`` seeded with ``seed``, in a fixed
order (bursts, interactive, batch), so a recipe, a seed and the two traces give the same requests
anywhere. Arrival-time sampling is Lewis-Shedler thinning of a homogeneous process at the
largest rate. Pure: the traces are passed in (:func:`cadenza.loadgen.trace.load_trace` reads the
shipped CSVs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cadenza.loadgen.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class DayRecipe:
    """The shape of a compressed day (see the module docstring for how each is used).

    Attributes:
        duration_s: seconds of trace that stand for 24 hours.
        peak_rps: interactive requests/s at the diurnal peak, bursts aside.
        peak_to_trough: interactive peak rate over its trough rate (>= 1).
        peak_hour: hour of the represented day (0-24) at which interactive peaks.
        burst_every_s: mean seconds between burst starts (0: no bursts).
        burst_s: (shortest, longest) burst, seconds.
        burst_factor: (lowest, highest) rate multiplier in a burst.
        batch_rps: batch requests/s offered at the interactive trough.
        batch_floor: batch rate at the interactive peak, as a share of ``batch_rps`` (0-1).
        batch_prompt_scale: factor on batch prompt lengths at the interactive trough (>= 1; 1
            at the peak).
        max_model_len: prompt + output tokens a request may hold.

    Raises:
        ValueError: a value outside its range.
    """

    duration_s: float = 3600.0
    peak_rps: float = 20.0
    peak_to_trough: float = 4.0
    peak_hour: float = 15.0
    burst_every_s: float = 600.0
    burst_s: tuple[float, float] = (60.0, 180.0)
    burst_factor: tuple[float, float] = (1.3, 1.8)
    batch_rps: float = 5.0
    batch_floor: float = 0.25
    batch_prompt_scale: float = 2.0
    max_model_len: int = 16384

    def __post_init__(self) -> None:
        checks = {
            "duration_s": self.duration_s > 0, "peak_rps": self.peak_rps >= 0,
            "peak_to_trough": self.peak_to_trough >= 1, "peak_hour": 0 <= self.peak_hour <= 24,
            "burst_every_s": self.burst_every_s >= 0,
            "burst_s": 0 < self.burst_s[0] <= self.burst_s[1],
            "burst_factor": 1 <= self.burst_factor[0] <= self.burst_factor[1],
            "batch_rps": self.batch_rps >= 0, "batch_floor": 0 <= self.batch_floor <= 1,
            "batch_prompt_scale": self.batch_prompt_scale >= 1, "max_model_len": self.max_model_len >= 2,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"DayRecipe: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)} out of range")


@dataclass(frozen=True, slots=True)
class Burst:
    """A burst of interactive load: ``factor`` x the diurnal rate from ``start_s`` to ``end_s``."""

    start_s: float
    end_s: float
    factor: float


class Day:
    """One day of a :class:`DayRecipe` with its seed: its bursts drawn, its rates as functions
    of time (seconds from the day's start; arrays in, arrays out), and its requests (:meth:`trace`).
    """

    def __init__(self, recipe: DayRecipe, seed: int = 0) -> None:
        self.recipe, self.seed = recipe, seed
        self.bursts = self._draw_bursts(np.random.default_rng(seed))

    def _draw_bursts(self, rng: np.random.Generator) -> list[Burst]:
        r, out = self.recipe, []
        if r.burst_every_s <= 0:
            return out
        t = float(rng.exponential(r.burst_every_s))
        while t < r.duration_s:
            length, factor = rng.uniform(*r.burst_s), rng.uniform(*r.burst_factor)
            out.append(Burst(t, min(r.duration_s, t + length), float(factor)))
            t += float(rng.exponential(r.burst_every_s))
        return out

    def phase(self, t):
        """``s(t)``: 0 at the interactive trough, 1 at its peak."""
        hours = 24.0 * np.asarray(t, dtype=float) / self.recipe.duration_s
        return (1.0 - np.cos(2 * math.pi * (hours - self.recipe.peak_hour + 12.0) / 24.0)) / 2.0

    def burst(self, t):
        """The burst multiplier at ``t`` (1 outside bursts)."""
        t = np.asarray(t, dtype=float)
        factor = np.ones_like(t)
        for b in self.bursts:
            factor = np.where((t >= b.start_s) & (t < b.end_s), np.maximum(factor, b.factor), factor)
        return factor

    def interactive_rps(self, t):
        r = self.recipe
        return r.peak_rps * (1.0 / r.peak_to_trough + (1.0 - 1.0 / r.peak_to_trough) * self.phase(t)) * self.burst(t)

    def batch_rps(self, t):
        r = self.recipe
        return r.batch_rps * (r.batch_floor + (1.0 - r.batch_floor) * (1.0 - self.phase(t)))

    def batch_prompt_scale(self, t):
        return 1.0 + (self.recipe.batch_prompt_scale - 1.0) * (1.0 - self.phase(t))

    def _arrivals(self, rng: np.random.Generator, rate, highest: float) -> np.ndarray:
        """Arrival times (s, sorted) of a Poisson process of ``rate(t)`` <= ``highest``, by thinning."""
        duration = self.recipe.duration_s
        if highest <= 0:
            return np.zeros(0)
        t = np.sort(rng.uniform(0.0, duration, size=rng.poisson(highest * duration)))
        return t[rng.uniform(0.0, highest, size=len(t)) < rate(t)]

    @staticmethod
    def _lengths(rng: np.random.Generator, source: Sequence[TraceRequest], n: int) -> tuple[np.ndarray, np.ndarray]:
        if not source:
            raise ValueError("a day needs both traces, with at least one request each")
        pairs = np.array([(r.input_len, r.output_len) for r in source], dtype=np.int64)
        drawn = pairs[rng.integers(len(pairs), size=n)]
        return np.maximum(drawn[:, 0], 1), np.maximum(drawn[:, 1], 1)

    def trace(self, conv: Sequence[TraceRequest], code: Sequence[TraceRequest]) -> list[TraceRequest]:
        """The day's requests, sorted by arrival: interactive ones of tenant ``chat`` drawn from
        ``conv``, batch ones of tenant ``code`` drawn from ``code`` (module docstring); the same
        ones at every call.

        Raises:
            ValueError: an empty trace.
        """
        r, rng = self.recipe, np.random.default_rng(self.seed)
        self._draw_bursts(rng)  # the same draws as the bursts', so the requests follow them in the stream
        t_i = self._arrivals(rng, self.interactive_rps, r.peak_rps * max(1.0, r.burst_factor[1]))
        in_i, out_i = self._lengths(rng, conv, len(t_i))
        t_b = self._arrivals(rng, self.batch_rps, r.batch_rps)
        in_b, out_b = self._lengths(rng, code, len(t_b))
        out_i = np.minimum(out_i, r.max_model_len - 1)
        in_i = np.minimum(in_i, r.max_model_len - out_i)
        out_b = np.minimum(out_b, r.max_model_len - 1)
        in_b = np.minimum(np.rint(in_b * self.batch_prompt_scale(t_b)).astype(np.int64), r.max_model_len - out_b)
        out = [TraceRequest(float(t), int(p), int(o), "interactive", "chat") for t, p, o in zip(t_i, in_i, out_i)]
        out += [TraceRequest(float(t), int(p), int(o), "batch", "code") for t, p, o in zip(t_b, in_b, out_b)]
        return sorted(out, key=lambda q: q.arrival_s)
