"""The SLO controller in the simulation: the operator's own control loop
(:class:`~cadenza.control.loop.ControlLoop`), fed with windows built the way the operator builds
them, acting through the fleet after the delays that matter.

Every ``interval_s`` of virtual time the loop ticks (:func:`sim_controller`). Its source,
:class:`FleetSource`, reads per class a fast and a slow window ending ``scrape_delay_s`` ago (what
a scrape-based signal lags by): the latency observations the gateway would have recorded in them,
binned into the gateway's own histogram buckets (:func:`cadenza.gateway.metrics.latency_buckets`
around the SLO targets) and read by the operator's :func:`~cadenza.control.signals.window_of` —
so the p99 it sees is the interpolated bucket figure, as in production — plus the engines' queue
depth and KV usage at the tick. Then :func:`~cadenza.control.decide.decide` with the pool's shape,
the colocated engines' live knobs and the loop's history, and :class:`FleetActuation` carries the
decision out:

- **retune**: the colocated replicas take the knobs ``retune_delay_s`` later (a ``PUT
  /admin/config`` round);
- **reshape** ``dedicate``: one colocated replica stops taking batch and background traffic
  ``reshape_delay_s`` later (the gateway's routing update); its batch work in flight finishes
  there; ``merge`` gives it back.

The replica count is not the controller's; start-up delays of new replicas do not arise here.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from cadenza.control.decide import Shape
from cadenza.control.histograms import Histogram
from cadenza.control.history import DEDICATE, MERGE
from cadenza.control.loop import ControlLoop, Evaluation
from cadenza.control.signals import ClassWindow, window_of
from cadenza.control.spec import ControllerSpec
from cadenza.gateway.metrics import latency_buckets
from cadenza.node.core.knobs import BY_NAME
from cadenza.node.core.policy import CLASSES
from cadenza.pool.live_knobs import KNOBS
from cadenza.sim.fleet import Fleet, Observations


@dataclass(frozen=True, slots=True)
class Action:
    """A decision the controller acted on (or advised), at virtual time ``time_s``."""

    time_s: float
    action: str
    reason: str
    acted: bool
    knobs: Mapping[str, float] | None = None
    move: str | None = None


def _histogram(times: list[float], values: list[float], start: float, end: float,
               bounds: tuple[float, ...]) -> Histogram:
    """The observations with time in ``(start, end]``, as cumulative bucket counts."""
    lo, hi = bisect.bisect_right(times, start), bisect.bisect_right(times, end)  # the lists grow: no copy
    window = np.sort(np.asarray(values[lo:hi], dtype=np.float64))
    cumulative = np.searchsorted(window, bounds, side="right").astype(float)
    return Histogram(bounds, (*cumulative.tolist(), float(len(window))))


class FleetSource:
    """The :class:`~cadenza.control.signals.SignalSource` of a simulated fleet.

    Args:
        fleet: whose observations and replicas are read.
        spec: the pool's SLOs (the histogram buckets are the gateway's around their targets).
        scrape_delay_s: how old the newest observation the windows see is.
    """

    def __init__(self, fleet: Fleet, spec: ControllerSpec, scrape_delay_s: float = 15.0) -> None:
        self.fleet, self.scrape_delay_s = fleet, scrape_delay_s
        targets = [v / 1e3 for slo in spec.slo.values() for v in slo.values() if v]
        self.bounds = tuple(latency_buckets(targets))
        self._queue: dict[str, int] = {}
        self._kv = 0.0

    def record(self, now: float) -> None:
        """The engines' load now: each class's longest queue, the fullest engine's KV usage (0-1)."""
        replicas = self.fleet.replicas.values()
        self._queue = {cls: max((len(r.scheduler.queues[cls]) for r in replicas), default=0) for cls in CLASSES}
        self._kv = max((r.block_manager.num_used_blocks / r.block_manager.num_blocks for r in replicas), default=0.0)

    def window(self, cls: str, window_s: float, now: float, slo: Mapping[str, float], *, min_samples: int,
               stale_s: float) -> ClassWindow:
        """``cls`` over ``window_s`` seconds ending ``scrape_delay_s`` before ``now``, with the load
        of the last :meth:`record` (never stale: the simulator misses no scrape)."""
        end = now - self.scrape_delay_s
        obs = self.fleet.observations.get(cls, Observations())
        start = max(0.0, end - window_s)
        ttft = _histogram(obs.ttft_t, obs.ttft_s, start, end, self.bounds)
        itl = _histogram(obs.itl_t, obs.itl_s, start, end, self.bounds)
        w = window_of(ttft, itl, slo, min_samples, end - start)
        return replace(w, queue_depth=self._queue[cls], kv_usage=self._kv)


@dataclass
class FleetActuation:
    """The :class:`~cadenza.control.loop.Actuation` of a simulated fleet: routing and knobs
    changed after their delays.

    Args:
        fleet: the simulated pool.
        retune_delay_s, reshape_delay_s: seconds from a decision to its effect.

    Attributes:
        actions: every decision other than ``hold``, acted on or not.
        decisions: every evaluation, holds included.
    """

    fleet: Fleet
    retune_delay_s: float = 1.0
    reshape_delay_s: float = 10.0
    actions: list[Action] = field(default_factory=list)
    decisions: list[Evaluation] = field(default_factory=list)

    @staticmethod
    def shape(fleet: Fleet) -> tuple[Shape, list[str], list[str]]:
        """The pool's shape, its colocated replicas and its interactive-only ones."""
        roles = fleet.roles()
        batch = set(roles.get("batch", ()))
        colocated = [n for n in roles.get("interactive", ()) if n in batch]
        dedicated = [n for n in roles.get("interactive", ()) if n not in batch]
        return Shape(len(colocated), len(dedicated)), colocated, dedicated

    @staticmethod
    def knobs(fleet: Fleet, colocated: list[str]) -> dict[str, float | None]:
        """The live knobs rung 1 moves, as the first colocated replica runs them (None without one)."""
        if not colocated:
            return dict.fromkeys(KNOBS.values())
        config = fleet.replicas[colocated[0]].scheduler.config
        return {name: getattr(config.policy if BY_NAME[name].section == "policy" else config, name)
                for name in KNOBS.values()}

    def prepare(self, now: float) -> tuple[Shape, dict[str, float | None]]:
        shape, colocated, _dedicated = self.shape(self.fleet)
        return shape, self.knobs(self.fleet, colocated)

    def act(self, evaluation: Evaluation) -> None:
        """Record the evaluation and schedule what the decision changes."""
        decision, now, fleet = evaluation.decision, evaluation.time, self.fleet
        self.decisions.append(evaluation)
        if decision.action != "hold":
            self.actions.append(Action(now, decision.action, decision.reason, decision.act,
                                       decision.knobs, decision.move))
        if decision.act and decision.action == "retune":
            changes: dict[str, Any] = {k: BY_NAME[k].kind(v) for k, v in (decision.knobs or {}).items()}
            fleet.at(now + self.retune_delay_s, lambda f: f.reconfigure(self.shape(f)[1], changes))
        elif decision.act and decision.action == "reshape":
            fleet.at(now + self.reshape_delay_s, lambda f: self._move(f, decision.move))

    def status(self) -> dict[str, Any]:
        return {}

    def _move(self, fleet: Fleet, move: str | None) -> None:
        roles = fleet.roles()
        _shape, colocated, dedicated = self.shape(fleet)
        if move == DEDICATE and len(colocated) > 1:
            moved = colocated[-1]
            fleet.set_roles({"interactive": roles["interactive"], "batch": [n for n in roles["batch"] if n != moved]})
        elif move == MERGE and dedicated:
            fleet.set_roles({"interactive": roles["interactive"], "batch": [*roles["batch"], dedicated[-1]]})


def sim_controller(spec: ControllerSpec, fleet: Fleet, *, interval_s: float = 15.0, scrape_delay_s: float = 15.0,
                   retune_delay_s: float = 1.0, reshape_delay_s: float = 10.0, start_s: float = 0.0) -> ControlLoop:
    """The control loop of a simulated ``auto`` pool, attached to ``fleet``: its first tick at
    ``start_s + interval_s``, then every ``interval_s`` (the operator's timer) on the fleet's clock.

    Args:
        spec: the pool's SLOs and controller settings (``ControllerSpec.from_pool_spec``).
        scrape_delay_s: how old the newest observation the windows see is (:class:`FleetSource`).
        retune_delay_s, reshape_delay_s: seconds from a decision to its effect (:class:`FleetActuation`).
    """
    loop = ControlLoop(FleetSource(fleet, spec, scrape_delay_s), spec,
                       FleetActuation(fleet, retune_delay_s, reshape_delay_s),
                       clock=lambda: fleet.clock.now, interval_s=interval_s)

    def tick(f: Fleet) -> None:
        loop.tick()
        f.at(loop.next_tick_at, tick)

    fleet.at(start_s + interval_s, tick)
    return loop
