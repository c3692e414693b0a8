"""Fit a hardware profile's factors to measured steps: ``cadenza sim calibrate``.

The input is a table of steps, each its composition and measured seconds — the step log
``cadenza serve --step-log`` writes (JSONL), or a CSV with the same columns
(:data:`TABLE_COLUMNS`; ``host_seconds`` optional). The output is the base profile with fitted
factors, the JSON file ``--hardware`` takes.

The method. The roofline (:mod:`cadenza.sim.roofline`) predicts a step's device time as

    t = max(Lc / e_g, Lm / e_m) + max(Hc / e_g, Hm / e_m) + P / e_a
        + max(Dc / e_a, Dm / e_m) + AR + c0 + c_r x rows

from its terms at the peaks (``Roofline.unit_terms``: linear layers, LM head, prefill and decode
attention, compute ``c`` and memory ``m``), the all-reduce ``AR`` (not fitted) and a fixed cost
per step and per row. The GEMM efficiency ``e_g`` is a curve over the GEMM's rows ``M`` (the
step's tokens; the LM head's sampled rows): one knot per power of two the table has steps near,
linear between them (small-``M`` GEMMs run other kernels and reach less of the peak; on this
project's CPU runner a step of 4 rows costs nearly twice one of 3). ``1/e_g(M)`` is then a
weighted sum of the knots' inverse efficiencies, and given which side of each ``max`` is active,
``t`` is linear in ``w = (1/e_g at each knot, 1/e_m, 1/e_a, c0, c_r)``; so the fit alternates (as for a piecewise-linear
regression with known pieces): pick each step's active sides from the current ``w``, solve the
least-squares problem for ``w``, repeat until no side changes (at most :data:`MAX_ROUNDS`). The
residuals are relative (each row weighted by ``1 / t``), so a 5 ms decode step counts as much as a
500 ms prefill; the constants are kept non-negative (a negative one is fixed at zero and the rest
refitted) and a factor the table cannot identify (its term zero in every step: no prefill
attention measured, say) keeps the base profile's value. Both forms are fitted — compute and
memory overlapping (``max``, a GPU) and adding (``overlap`` off: on this project's CPU runner a
decode step's time grows with its rows long before the weight stream is hidden) — and the one
of the lower mean error is kept. The host side is fitted apart, as
``host_seconds = h0 + h_r x rows``, when the table has it. The fitted profile has no separate
dispatch term and no graph replay (``c0`` and ``c_r`` absorb the runner's host time, eager or
graphed); :mod:`cadenza.sim.dispatch` fits them apart, beside a data-sheet device.

A fitted efficiency above 1 says the base's peak is too low (a CPU has no data-sheet figure, and
``--base cpu`` starts from nominal ones): the peak is raised to the throughput reached and the
efficiency set to 1, so the profile stays valid and predicts the same times.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cadenza.node.core.step import STEP_LOG_FIELDS
from cadenza.sim.hardware import GB, TFLOPS, HardwareProfile, ProfileError
from cadenza.sim.roofline import Roofline, StepComposition, UnitTerms

TABLE_COLUMNS = STEP_LOG_FIELDS[:-1]  # required; host_seconds is optional
MAX_ROUNDS = 20
POOR_FIT = 0.25  # a mean error above this is reported as a poor fit
_TINY = 1e-12
_FREE = 1e-9  # the inverse efficiency of a term the fit finds costs nothing (NNLS's zero, kept positive)
_MAX_VALUE = 2.0 ** 53  # larger counts or seconds are not measurements
_COUNTS = ("prefill_tokens", "decode_tokens", "decode_context_tokens", "num_rows", "num_sampled")


@dataclass(frozen=True, slots=True)
class MeasuredStep:
    """One row of the table: what the step computed, its device seconds, and the scheduler's
    seconds beside them (None when the table has no ``host_seconds``)."""

    composition: StepComposition
    seconds: float
    host_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Calibration:
    """A fit's result.

    Attributes:
        profile: the base profile with the fitted factors.
        steps: steps fitted.
        rounds: alternations until the active sides settled.
        mean_abs_error: mean ``|predicted - measured| / measured`` of the device time, over the table.
        p90_abs_error: its 90th percentile.
        fixed: factors the table could not identify (no step has their term: kept from the base).
        free: factors whose term the fit found to cost nothing (run at the full peak).
    """

    profile: HardwareProfile
    steps: int
    rounds: int
    mean_abs_error: float
    p90_abs_error: float
    fixed: tuple[str, ...]
    free: tuple[str, ...] = ()

    @property
    def poor(self) -> bool:
        """The fit misses the table by more than :data:`POOR_FIT` on average."""
        return self.mean_abs_error > POOR_FIT


def cpu_base(name: str = "cpu") -> HardwareProfile:
    """A nominal profile of this host for ``--base cpu``: float32 (the CPU runner's dtype), the
    machine's memory, and round peaks a calibration replaces (no single link, no tensor parallel)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 16 * GB
    return HardwareProfile(name, peak_flops=1 * TFLOPS, memory_bandwidth=20 * GB, memory_bytes=float(memory),
                           link_bandwidth=10 * GB, gemm_efficiency=1.0, attention_efficiency=1.0,
                           memory_efficiency=1.0, step_overhead_s=0.0, host_per_step_s=0.0, host_per_row_s=0.0,
                           dtype_bytes=4)


def load_step_table(path: str | Path) -> list[MeasuredStep]:
    """Read a step table: JSONL (the step log) or CSV with a header, :data:`TABLE_COLUMNS` each.

    Raises:
        ValueError: no rows, a missing column, or a value that is not a non-negative number (the
            message names the line); steps of zero tokens or zero seconds are skipped.
        OSError: the file cannot be read.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    first = next((line.strip() for line in lines if line.strip()), "")
    if first.startswith("["):
        raise ValueError(f"{path}:1: a step table holds one JSON object a line (or a CSV header), not a list")
    if first.startswith("{"):
        rows = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
        records = []
        for n, line in rows:
            try:
                records.append((n, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
    else:
        reader = csv.DictReader(lines)
        records = [(n, row) for n, row in enumerate(reader, 2)]
    steps = []
    for n, record in records:
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{n}: not an object")
        missing = [c for c in TABLE_COLUMNS if c not in record]
        if missing:
            raise ValueError(f"{path}:{n}: missing column(s) {', '.join(missing)} (need {', '.join(TABLE_COLUMNS)})")
        try:
            if any(isinstance(record[c], bool) for c in TABLE_COLUMNS):
                raise ValueError
            values = {c: float(record[c]) for c in TABLE_COLUMNS}
            host = record.get("host_seconds")
            host = None if host in (None, "") else float(host)
        except (TypeError, ValueError):
            raise ValueError(f"{path}:{n}: every column must be a number") from None
        if not all(0 <= v <= _MAX_VALUE for v in values.values()) or (host is not None and not 0 <= host <= _MAX_VALUE):
            raise ValueError(f"{path}:{n}: values must be finite, >= 0 and at most {_MAX_VALUE:g}")
        if any(values[c] != int(values[c]) for c in _COUNTS):
            raise ValueError(f"{path}:{n}: {', '.join(_COUNTS)} must be whole numbers")
        comp = StepComposition(int(values["prefill_tokens"]), int(values["decode_tokens"]),
                               int(values["decode_context_tokens"]), values["prefill_attention_tokens"],
                               int(values["num_rows"]), int(values["num_sampled"]))
        if comp.num_tokens and values["seconds"] > 0:
            steps.append(MeasuredStep(comp, values["seconds"], host))
    if not steps:
        raise ValueError(f"{path}: no steps with tokens and a positive time")
    return steps


def _basis(tokens: float, knots: Sequence[float]) -> np.ndarray:
    """Weights of the GEMM-curve knots at ``tokens`` (linear between knots, level beyond them);
    no knots: one constant column."""
    if not knots:
        return np.ones(1)
    out = np.zeros(len(knots))
    if tokens <= knots[0]:
        out[0] = 1.0
    elif tokens >= knots[-1]:
        out[-1] = 1.0
    else:
        k = int(np.searchsorted(knots, tokens)) - 1
        f = (tokens - knots[k]) / (knots[k + 1] - knots[k])
        out[k], out[k + 1] = 1.0 - f, f
    return out


def _design(terms: list[UnitTerms], steps: list[MeasuredStep], w: np.ndarray, overlap: bool,
            knots: Sequence[float]) -> np.ndarray:
    """Columns (one GEMM column per knot, memory, attention, per step, per row): with
    ``overlap``, each max's active side chosen by ``w``; without, both sides of every term."""
    k = max(1, len(knots))
    wm, wa = w[k], w[k + 1]
    x = np.zeros((len(terms), k + 4))
    for i, (u, s) in enumerate(zip(terms, steps)):
        for compute, memory, m in ((u.linear_compute_s, u.linear_memory_s, s.composition.num_tokens),
                                   (u.lm_head_compute_s, u.lm_head_memory_s, s.composition.num_sampled)):
            basis = _basis(m, knots)
            slower = float(basis @ w[:k]) * compute >= wm * memory
            if not overlap or slower:
                x[i, :k] += compute * basis
            if not overlap or not slower:
                x[i, k] += memory
        x[i, k + 1] += u.prefill_attention_s
        slower = wa * u.decode_attention_compute_s >= wm * u.decode_attention_memory_s
        if not overlap or slower:
            x[i, k + 1] += u.decode_attention_compute_s
        if not overlap or not slower:
            x[i, k] += u.decode_attention_memory_s
        x[i, k + 2] = 1.0
        x[i, k + 3] = s.composition.num_rows
    return x


def curve_knots(steps: list[MeasuredStep]) -> list[float]:
    """Powers of two spanning the table's GEMM sizes (step tokens, sampled rows), each kept only
    where enough steps (3, or 2 % of the table) lie between its neighbours: a knot with little
    data near it is not fitted, and one the fit drives to no cost at all is dropped afterwards."""
    sizes = np.array([m for s in steps for m in (s.composition.num_tokens, s.composition.num_sampled) if m > 0],
                     dtype=np.float64)
    top = 1
    while top < sizes.max():
        top *= 2
    knots = [float(2 ** e) for e in range(int(np.log2(top)) + 1)]
    kept, enough = [], max(3, len(steps) // 50)
    for i, t in enumerate(knots):
        lo = knots[i - 1] if i else 0.0
        hi = knots[i + 1] if i + 1 < len(knots) else float("inf")
        if ((sizes > lo) & (sizes < hi)).sum() >= enough:
            kept.append(t)
    return kept


def solve_relative(x: np.ndarray, y: np.ndarray, fixed: dict[int, float], nonnegative: tuple[int, ...]) -> np.ndarray:
    """Least squares of ``x w ~ y`` relative to ``y``, with the columns in ``fixed`` held at their
    values and those in ``nonnegative`` clamped at zero (fixed there, the rest refitted)."""
    fixed = dict(fixed)
    weight = 1.0 / y
    while True:
        free = [j for j in range(x.shape[1]) if j not in fixed]
        target = y - sum(x[:, j] * v for j, v in fixed.items()) if fixed else y
        a = x[:, free] * weight[:, None]
        scale = np.maximum(np.abs(a).max(axis=0), _TINY)
        sol, *_ = np.linalg.lstsq(a / scale, target * weight, rcond=None)
        w = np.zeros(x.shape[1])
        for j, v in fixed.items():
            w[j] = v
        w[free] = sol / scale
        negative = [j for j in free if j in nonnegative and w[j] < 0]
        if not negative:
            return w
        fixed.update({j: 0.0 for j in negative})


def calibrate(steps: list[MeasuredStep], roofline: Roofline, name: str | None = None,
              curve: bool = True) -> Calibration:
    """Fit ``roofline.hw``'s efficiency factors and fixed costs to ``steps``, with compute and
    memory overlapping (the roofline's ``max``) and adding (``overlap`` off), and keep the form
    of the lower mean error (see the module docstring).

    Args:
        curve: fit the GEMM efficiency per power of two of rows (``gemm_curve``); else one figure.

    Raises:
        ValueError: fewer steps than unknowns.
    """
    knots = curve_knots(steps) if curve else []
    if len(steps) < len(knots) + 5:
        raise ValueError(f"need at least {len(knots) + 5} measured steps to fit {len(knots) + 4} factors, "
                         f"got {len(steps)}")
    hw = roofline.hw
    terms = [roofline.unit_terms(s.composition) for s in steps]
    y = np.maximum(np.array([s.seconds - u.allreduce_s for s, u in zip(steps, terms)]), _TINY)
    fits = []
    for overlap in (True, False):
        form_knots = list(knots)
        while True:  # a knot the data drives to a free GEMM is dropped (its neighbours interpolate)
            fit = _fit(terms, steps, y, hw, overlap, form_knots)
            dropped = [form_knots[j] for j in fit[5] if j < len(form_knots)]
            if not dropped or len(form_knots) <= 1:
                break
            form_knots = [t for t in form_knots if t not in dropped]
        fits.append((*fit, form_knots))
    w, overlap, rounds, errors, unidentified, free, knots = min(fits, key=lambda f: float(f[3].mean()))
    # c0 and c_r absorb the runner's host time (dispatch or graph replay): the profile adds no other
    fitted = _profile(hw, w, name, knots, free).with_factors(overlap=overlap, dispatch_per_step_s=0.0,
                                                             dispatch_per_row_s=0.0, cuda_graphs=False)
    host = [(s.composition.num_rows, s.host_seconds) for s in steps if s.host_seconds is not None]
    if len(host) >= 2:
        hx = np.array([[1.0, r] for r, _ in host])
        hy = np.maximum(np.array([h for _, h in host]), _TINY)
        h0, hr = solve_relative(hx, hy, {}, nonnegative=(0, 1))
        fitted = fitted.with_factors(host_per_step_s=float(h0), host_per_row_s=float(hr))
    k = max(1, len(knots))
    names = [f"gemm_efficiency at {int(t)} tokens" for t in knots] or ["gemm_efficiency"]
    names += ["memory_efficiency", "attention_efficiency"]
    return Calibration(fitted, len(steps), rounds, float(errors.mean()), float(np.percentile(errors, 90)),
                       tuple(names[j] for j in sorted(unidentified) if j < k + 2),
                       tuple(names[j] for j in free if j not in unidentified))


def _fit(terms: list[UnitTerms], steps: list[MeasuredStep], y: np.ndarray, hw: HardwareProfile, overlap: bool,
         knots: Sequence[float]):
    """One form's fit: ``(w, overlap, rounds, relative errors, unidentified factor columns)``."""
    k = max(1, len(knots))
    gemm = [1 / hw.gemm_efficiency_at(t) for t in knots] or [1 / hw.gemm_efficiency]
    w = np.array([*gemm, 1 / hw.memory_efficiency, 1 / hw.attention_efficiency, hw.step_overhead_s,
                  hw.device_per_row_s])
    factors, constants = range(k + 2), (k + 2, k + 3)
    rounds, previous, unidentified = 0, None, {}
    while rounds < MAX_ROUNDS:
        rounds += 1
        x = _design(terms, steps, w, overlap, knots)
        unidentified = {j: w[j] for j in factors if not x[:, j].any()}
        held = dict(unidentified)
        while True:  # a term the data says costs nothing (a factor at or below zero) is made free
            w_new = solve_relative(x, y, held, nonnegative=constants)
            free = {j: _FREE for j in factors if j not in held and not w_new[j] > 0}
            if not free:
                break
            held.update(free)
        w = w_new
        sides = _design(terms, steps, w, overlap, knots) != 0
        if not overlap or (previous is not None and np.array_equal(sides, previous)):
            break
        previous = sides
    errors = np.abs(_design(terms, steps, w, overlap, knots) @ w - y) / y
    return w, overlap, rounds, errors, unidentified, [j for j in factors if w[j] == _FREE]


def _profile(hw: HardwareProfile, w: np.ndarray, name: str | None, knots: Sequence[float],
             free: Sequence[int] = ()) -> HardwareProfile:
    """The profile of fitted ``w``: efficiencies from the inverse factors, the peaks raised where a
    factor says the kernels beat them. A free term (the fit found it costs nothing) runs at the
    peaks the others set, at full efficiency: as cheap as a valid profile can make it."""
    k = max(1, len(knots))
    gemm_flops = [hw.peak_flops / wg for wg in w[:k]]
    attn_flops = hw.peak_flops / w[k + 1]
    bandwidth = hw.memory_bandwidth / w[k]
    flops = [f for j, f in enumerate([*gemm_flops, attn_flops]) if (j if j < k else k + 1) not in free]
    peak = max(hw.peak_flops, *flops) if flops else hw.peak_flops
    memory_bandwidth = max(hw.memory_bandwidth, bandwidth) if k not in free else hw.memory_bandwidth
    gemm_flops = [peak if j in free else f for j, f in enumerate(gemm_flops)]
    attn_flops = peak if k + 1 in free else attn_flops
    bandwidth = memory_bandwidth if k in free else bandwidth
    curve = tuple((t, f / peak) for t, f in zip(knots, gemm_flops))
    try:
        return hw.with_factors(
            name=name or f"{hw.name}-calibrated", peak_flops=peak, memory_bandwidth=memory_bandwidth,
            gemm_efficiency=gemm_flops[-1] / peak, gemm_curve=curve, attention_efficiency=attn_flops / peak,
            memory_efficiency=bandwidth / memory_bandwidth, step_overhead_s=float(w[k + 2]),
            device_per_row_s=float(w[k + 3]))
    except ProfileError as exc:
        raise ValueError(f"the fit gave an invalid profile ({exc}): too few or too alike steps?") from exc


def step_errors(steps: list[MeasuredStep], roofline: Roofline) -> np.ndarray:
    """``|predicted - measured| / measured`` of each step's runner time on ``roofline`` (a held-out
    table's per-step error): the step log's ``seconds``, the runner's time (``StepTime.runner_s``:
    the device and the host's dispatch or graph replay, not the scheduler's time, which the log
    keeps apart)."""
    out = []
    for s in steps:
        t = roofline.step_time(s.composition).runner_s
        out.append(abs(t - s.seconds) / s.seconds)
    return np.array(out)
