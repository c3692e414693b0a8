"""The runner's host time per step, fitted from a measured step table: an eager runner's
dispatch, and a CUDA-graph runner's replay.

On a fast GPU cadenza's eager runner is host-bound: it issues every kernel of a step from Python,
builds the step's inputs and synchronises for sampling, and the device waits for it. One H200
(``data/gpu/h200/``: Llama-3.1-8B shapes, no CUDA graphs) took ~12 ms for a decode step at 1 to 64
rows alike, against a memory floor of 3.8 ms at one row. A profile carries that cost as
``dispatch_per_step_s + dispatch_per_row_s x rows`` (:class:`~cadenza.sim.hardware.HardwareProfile`),
and a step takes the longer of it and the device's roofline time (:mod:`cadenza.sim.roofline`).

:func:`fit_dispatch` finds the two figures the way :mod:`cadenza.sim.calibrate` fits its pieces:
given which steps the dispatch bounds (its prediction above the device's), a least-squares fit of
their measured seconds, relative (each weighted by ``1 / t``, so a short step counts as much as a
long one), the figures kept non-negative; then the bound steps are chosen again with the new
figures, until the choice settles (at most :data:`MAX_ROUNDS`). The start takes the steps whose
device time is under half their measured time. The device side is the profile as given.

A runner that replays CUDA graphs leaves the host less: the inputs built and copied before the
launch, the launch, the sampled tokens read after it, serial with the device
(``graph_per_step_s + graph_per_row_s x rows``, added to the device's time). :func:`fit_graph_replay`
fits those two figures to the steps of a table measured with graphs on that the profile says were
graphed (:func:`~cadenza.sim.roofline.replays_graph`), by the same relative least squares of their
seconds, the device's time held as the profile gives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cadenza.sim.calibrate import MeasuredStep, solve_relative, step_errors
from cadenza.sim.hardware import HardwareProfile
from cadenza.sim.roofline import Roofline, replays_graph

MAX_ROUNDS = 20


@dataclass(frozen=True, slots=True)
class DispatchFit:
    """:func:`fit_dispatch`'s result.

    Attributes:
        per_step_s, per_row_s: the fitted dispatch, seconds per step and per row.
        bound_steps: steps the dispatch bounds (of those fitted).
        mean_abs_error, p90_abs_error: ``|predicted - measured| / measured`` of the steps' runner
            seconds with the fitted dispatch, mean and 90th percentile.
    """

    per_step_s: float
    per_row_s: float
    bound_steps: int
    mean_abs_error: float
    p90_abs_error: float

    def profile(self, hw: HardwareProfile, name: str) -> HardwareProfile:
        """``hw`` with this dispatch, named ``name``."""
        return hw.with_factors(name=name, dispatch_per_step_s=self.per_step_s, dispatch_per_row_s=self.per_row_s)


@dataclass(frozen=True, slots=True)
class ReplayFit:
    """:func:`fit_graph_replay`'s result.

    Attributes:
        per_step_s, per_row_s: a graphed step's fitted host time, seconds per step and per row.
        graphed_steps: steps of the table the profile graphs (those fitted).
        mean_abs_error, p90_abs_error: ``|predicted - measured| / measured`` of the graphed steps'
            runner seconds with the fitted figures, mean and 90th percentile.
    """

    per_step_s: float
    per_row_s: float
    graphed_steps: int
    mean_abs_error: float
    p90_abs_error: float

    def profile(self, hw: HardwareProfile, name: str) -> HardwareProfile:
        """``hw`` (a profile with ``cuda_graphs``) with this replay time, named ``name``."""
        return hw.with_factors(name=name, graph_per_step_s=self.per_step_s, graph_per_row_s=self.per_row_s)


def device_seconds(steps: list[MeasuredStep], roofline: Roofline) -> np.ndarray:
    """Each step's device time on ``roofline`` (seconds; no dispatch, no scheduler)."""
    return np.array([roofline.step_time(s.composition).device_s for s in steps])


def fit_dispatch(steps: list[MeasuredStep], roofline: Roofline) -> DispatchFit:
    """Fit ``dispatch_per_step_s`` and ``dispatch_per_row_s`` to ``steps`` measured on the device
    ``roofline.hw`` describes (see the module docstring).

    Raises:
        ValueError: fewer than two steps the dispatch could bound (nothing to fit).
    """
    device = device_seconds(steps, _with_dispatch(roofline, 0.0, 0.0))
    measured = np.array([s.seconds for s in steps])
    rows = np.array([float(s.composition.num_rows) for s in steps])
    bound = device < 0.5 * measured
    w = np.zeros(2)
    for _ in range(MAX_ROUNDS):
        if bound.sum() < 2:
            raise ValueError(f"{int(bound.sum())} steps are bound by the host's dispatch: nothing to fit")
        x = np.column_stack([np.ones(int(bound.sum())), rows[bound]])
        w = solve_relative(x, measured[bound], {}, nonnegative=(0, 1))
        again = w[0] + w[1] * rows > device
        if (again == bound).all():
            break
        bound = again
    errors = step_errors(steps, _with_dispatch(roofline, float(w[0]), float(w[1])))
    return DispatchFit(float(w[0]), float(w[1]), int(bound.sum()), float(errors.mean()),
                       float(np.percentile(errors, 90)))


def fit_graph_replay(steps: list[MeasuredStep], roofline: Roofline) -> ReplayFit:
    """Fit ``graph_per_step_s`` and ``graph_per_row_s`` to the steps of ``steps`` (a table measured
    with CUDA graphs on) that ``roofline.hw`` graphs: ``seconds = device + g0 + g_r x rows``,
    relative least squares, both kept non-negative (see the module docstring). The eager steps of
    the table are not fitted: they keep the profile's dispatch.

    Raises:
        ValueError: ``roofline.hw`` has no ``cuda_graphs``, or fewer than two graphed steps.
    """
    if not roofline.hw.cuda_graphs:
        raise ValueError(f"{roofline.hw.name} replays no CUDA graphs: start from a profile with cuda_graphs "
                         "(h200-graphs), or fit an eager dispatch")
    graphed = [s for s in steps if replays_graph(roofline.hw, s.composition)]
    if len(graphed) < 2:
        raise ValueError(f"{len(graphed)} steps of {len(steps)} are graphed (decode-only, or one prefill chunk "
                         f"of at most {roofline.hw.graph_max_prefill_tokens} tokens): nothing to fit")
    device = device_seconds(graphed, roofline)
    rows = np.array([float(s.composition.num_rows) for s in graphed])
    measured = np.array([s.seconds for s in graphed])
    x = np.column_stack([np.ones(len(graphed)), rows, device])
    w = solve_relative(x, measured, {2: 1.0}, nonnegative=(0, 1))
    fitted = Roofline(roofline.dims, roofline.hw.with_factors(graph_per_step_s=float(w[0]),
                                                              graph_per_row_s=float(w[1])), roofline.tp)
    errors = step_errors(graphed, fitted)
    return ReplayFit(float(w[0]), float(w[1]), len(graphed), float(errors.mean()),
                     float(np.percentile(errors, 90)))


def _with_dispatch(roofline: Roofline, per_step_s: float, per_row_s: float) -> Roofline:
    """``roofline`` with this eager dispatch on every step (no graphs)."""
    hw = roofline.hw.with_factors(dispatch_per_step_s=per_step_s, dispatch_per_row_s=per_row_s, cuda_graphs=False)
    return Roofline(roofline.dims, hw, roofline.tp)
