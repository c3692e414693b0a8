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
per step and per row. Given which side of each ``max`` is active, ``t`` is linear in
``w = (1/e_g, 1/e_m, 1/e_a, c0, c_r)``; so the fit alternates (as for a piecewise-linear
regression with known pieces): pick each step's active sides from the current ``w``, solve the
least-squares problem for ``w``, repeat until no side changes (at most :data:`MAX_ROUNDS`). The
residuals are relative (each row weighted by ``1 / t``), so a 5 ms decode step counts as much as a
500 ms prefill; the constants are kept non-negative (a negative one is fixed at zero and the rest
refitted) and a factor the table cannot identify (its term zero in every step: no prefill
attention measured, say) keeps the base profile's value. Both forms are fitted — compute and
memory overlapping (``max``, a GPU) and adding (``overlap`` off: on this project's CPU runner a
decode step's time grows with its rows long before the weight stream is hidden) — and the one
of the lower mean error is kept. The host side is fitted apart, as
``host_seconds = h0 + h_r x rows``, when the table has it.

A fitted efficiency above 1 says the base's peak is too low (a CPU has no data-sheet figure, and
``--base cpu`` starts from nominal ones): the peak is raised to the throughput reached and the
efficiency set to 1, so the profile stays valid and predicts the same times.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cadenza.sim.hardware import GB, TFLOPS, HardwareProfile, ProfileError
from cadenza.sim.roofline import Roofline, StepComposition, UnitTerms

TABLE_COLUMNS = ("prefill_tokens", "decode_tokens", "decode_context_tokens", "prefill_attention_tokens",
                 "num_rows", "num_sampled", "seconds")
MAX_ROUNDS = 20
_TINY = 1e-12


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
        fixed: factors the table could not identify (kept from the base, or held where a fit
            drove them to zero).
    """

    profile: HardwareProfile
    steps: int
    rounds: int
    mean_abs_error: float
    p90_abs_error: float
    fixed: tuple[str, ...]


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
            values = {c: float(record[c]) for c in TABLE_COLUMNS}
            host = record.get("host_seconds")
            host = None if host in (None, "") else float(host)
        except (TypeError, ValueError):
            raise ValueError(f"{path}:{n}: every column must be a number") from None
        if any(not v >= 0 or v == float("inf") for v in values.values()) or (host is not None and not host >= 0):
            raise ValueError(f"{path}:{n}: values must be finite and >= 0")
        comp = StepComposition(int(values["prefill_tokens"]), int(values["decode_tokens"]),
                               int(values["decode_context_tokens"]), values["prefill_attention_tokens"],
                               int(values["num_rows"]), int(values["num_sampled"]))
        if comp.num_tokens and values["seconds"] > 0:
            steps.append(MeasuredStep(comp, values["seconds"], host))
    if not steps:
        raise ValueError(f"{path}: no steps with tokens and a positive time")
    return steps


def _design(terms: list[UnitTerms], rows: np.ndarray, w: np.ndarray, overlap: bool) -> np.ndarray:
    """Columns (gemm, memory, attention, per step, per row): with ``overlap``, each max's active
    side chosen by ``w``; without, both sides of every term."""
    wg, wm, wa = w[0], w[1], w[2]
    x = np.zeros((len(terms), 5))
    for i, u in enumerate(terms):
        for compute, memory in ((u.linear_compute_s, u.linear_memory_s), (u.lm_head_compute_s, u.lm_head_memory_s)):
            if not overlap or wg * compute >= wm * memory:
                x[i, 0] += compute
            if not overlap or wg * compute < wm * memory:
                x[i, 1] += memory
        x[i, 2] += u.prefill_attention_s
        if not overlap or wa * u.decode_attention_compute_s >= wm * u.decode_attention_memory_s:
            x[i, 2] += u.decode_attention_compute_s
        if not overlap or wa * u.decode_attention_compute_s < wm * u.decode_attention_memory_s:
            x[i, 1] += u.decode_attention_memory_s
    x[:, 3] = 1.0
    x[:, 4] = rows
    return x


def _solve(x: np.ndarray, y: np.ndarray, fixed: dict[int, float], nonnegative: tuple[int, ...]) -> np.ndarray:
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


def calibrate(steps: list[MeasuredStep], roofline: Roofline, name: str | None = None) -> Calibration:
    """Fit ``roofline.hw``'s efficiency factors and fixed costs to ``steps``, with compute and
    memory overlapping (the roofline's ``max``) and adding (``overlap`` off), and keep the form
    of the lower mean error (see the module docstring).

    Raises:
        ValueError: fewer than 5 steps (there are 5 unknowns).
    """
    if len(steps) < 5:
        raise ValueError(f"need at least 5 measured steps to fit 5 factors, got {len(steps)}")
    hw = roofline.hw
    terms = [roofline.unit_terms(s.composition) for s in steps]
    rows = np.array([s.composition.num_rows for s in steps], dtype=np.float64)
    y = np.maximum(np.array([s.seconds - u.allreduce_s for s, u in zip(steps, terms)]), _TINY)
    fits = [_fit(terms, rows, y, hw, overlap) for overlap in (True, False)]
    w, overlap, rounds, errors, unidentified = min(fits, key=lambda f: float(f[3].mean()))
    fitted = _profile(hw, w, name).with_factors(overlap=overlap)
    host = [(s.composition.num_rows, s.host_seconds) for s in steps if s.host_seconds is not None]
    if len(host) >= 2:
        hx = np.array([[1.0, r] for r, _ in host])
        hy = np.maximum(np.array([h for _, h in host]), _TINY)
        h0, hr = _solve(hx, hy, {}, nonnegative=(0, 1))
        fitted = fitted.with_factors(host_per_step_s=float(h0), host_per_row_s=float(hr))
    names = ("gemm_efficiency", "memory_efficiency", "attention_efficiency")
    return Calibration(fitted, len(steps), rounds, float(errors.mean()), float(np.percentile(errors, 90)),
                       tuple(names[j] for j in sorted(unidentified)))


def _fit(terms: list[UnitTerms], rows: np.ndarray, y: np.ndarray, hw: HardwareProfile, overlap: bool):
    """One form's fit: ``(w, overlap, rounds, relative errors, unidentified factor columns)``."""
    w = np.array([1 / hw.gemm_efficiency, 1 / hw.memory_efficiency, 1 / hw.attention_efficiency,
                  hw.step_overhead_s, hw.device_per_row_s])
    rounds, previous, unidentified = 0, None, {}
    while rounds < MAX_ROUNDS:
        rounds += 1
        x = _design(terms, rows, w, overlap)
        unidentified = {j: w[j] for j in range(3) if not x[:, j].any()}
        w_new = _solve(x, y, unidentified, nonnegative=(3, 4))
        bad = {j: w[j] for j in range(3) if j not in unidentified and not w_new[j] > 0}
        if bad:  # a factor the data drives to zero or below: hold it where it was
            unidentified.update(bad)
            w_new = _solve(x, y, unidentified, nonnegative=(3, 4))
        w = w_new
        sides = _design(terms, rows, w, overlap) != 0
        if not overlap or (previous is not None and np.array_equal(sides, previous)):
            break
        previous = sides
    errors = np.abs(_design(terms, rows, w, overlap) @ w - y) / y
    return w, overlap, rounds, errors, unidentified


def _profile(hw: HardwareProfile, w: np.ndarray, name: str | None) -> HardwareProfile:
    """The profile of fitted ``w``: efficiencies from the inverse factors, a peak raised where a
    factor says the kernels beat it."""
    gemm_flops = hw.peak_flops * hw.gemm_efficiency if not w[0] > 0 else hw.peak_flops / w[0]
    attn_flops = hw.peak_flops * hw.attention_efficiency if not w[2] > 0 else hw.peak_flops / w[2]
    bandwidth = hw.memory_bandwidth * hw.memory_efficiency if not w[1] > 0 else hw.memory_bandwidth / w[1]
    peak = max(hw.peak_flops, gemm_flops, attn_flops)
    memory_bandwidth = max(hw.memory_bandwidth, bandwidth)
    try:
        return hw.with_factors(
            name=name or f"{hw.name}-calibrated", peak_flops=peak, memory_bandwidth=memory_bandwidth,
            gemm_efficiency=gemm_flops / peak, attention_efficiency=attn_flops / peak,
            memory_efficiency=bandwidth / memory_bandwidth, step_overhead_s=float(w[3]), device_per_row_s=float(w[4]))
    except ProfileError as exc:
        raise ValueError(f"the fit gave an invalid profile ({exc}): too few or too alike steps?") from exc


def step_errors(steps: list[MeasuredStep], roofline: Roofline) -> np.ndarray:
    """``|predicted - measured| / measured`` of each step's device time on ``roofline`` (a held-out
    table's per-step error)."""
    out = []
    for s in steps:
        t = roofline.step_time(s.composition)
        predicted = t.total_s - roofline.hw.host_per_step_s - roofline.hw.host_per_row_s * s.composition.num_rows
        out.append(abs(predicted - s.seconds) / s.seconds)
    return np.array(out)
