"""The SLO controller in the simulation: the operator's own :func:`decide`, fed with windows built
the way the operator builds them, acting through the fleet after the delays that matter.

Every ``interval_s`` of virtual time the controller reads, per class, a fast and a slow window
ending ``scrape_delay_s`` ago (what a scrape-based signal lags by): the latency observations the
gateway would have recorded in them, binned into the gateway's own histogram buckets
(:func:`cadenza.gateway.metrics.latency_buckets` around the SLO targets) and read by the
operator's :func:`~cadenza.control.signals.window_of` — so the p99 it sees is the interpolated
bucket figure, as in production — plus the engines' queue depth and KV usage now. Then
:func:`~cadenza.control.decide.decide` with the pool's shape, the colocated engines' live
knobs and its stored history, and the decision is carried out:

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

from cadenza.gateway.metrics import latency_buckets
from cadenza.control.decide import Decision, Shape, decide
from cadenza.control.history import DEDICATE, MERGE, History
from cadenza.control.spec import ControllerSpec
from cadenza.control.histograms import Histogram
from cadenza.control.signals import ClassWindow, Signals, window_of
from cadenza.node.core.policy import CLASSES
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


@dataclass
class SimController:
    """:func:`decide` every ``interval_s`` over ``fleet`` (attach with :meth:`attach`).

    Args:
        spec: the pool's SLOs and controller settings (``ControllerSpec.from_pool_spec``).
        interval_s: seconds between evaluations (the operator's timer).
        scrape_delay_s: how old the newest observation the windows see is.
        retune_delay_s, reshape_delay_s: seconds from a decision to its effect.
    """

    spec: ControllerSpec
    interval_s: float = 15.0
    scrape_delay_s: float = 15.0
    retune_delay_s: float = 1.0
    reshape_delay_s: float = 10.0
    history: History = field(default_factory=History)
    actions: list[Action] = field(default_factory=list)
    # (time, signals, shape, knobs, history before, decision) of every evaluation
    decisions: list[tuple[float, Signals, Shape, dict, History, Decision]] = field(default_factory=list)

    def __post_init__(self) -> None:
        targets = [v / 1e3 for slo in self.spec.slo.values() for v in slo.values() if v]
        self._bounds = tuple(latency_buckets(targets))

    def attach(self, fleet: Fleet, start_s: float = 0.0) -> None:
        fleet.at(start_s + self.interval_s, self.evaluate)

    # -- what the controller reads ---------------------------------------------------------------

    def signals(self, fleet: Fleet, now: float) -> Signals:
        end = now - self.scrape_delay_s
        queue = {cls: max((len(r.scheduler.queues[cls]) for r in fleet.replicas.values()), default=0) for cls in CLASSES}
        kv = max((r.block_manager.num_used_blocks / r.block_manager.num_blocks for r in fleet.replicas.values()),
                 default=0.0)

        def window(cls: str, span: float) -> ClassWindow:
            obs = fleet.observations.get(cls, Observations())
            start = max(0.0, end - span)
            ttft = _histogram(obs.ttft_t, obs.ttft_s, start, end, self._bounds)
            itl = _histogram(obs.itl_t, obs.itl_s, start, end, self._bounds)
            w = window_of(ttft, itl, self.spec.slo.get(cls, {}), self.spec.min_samples, end - start)
            return replace(w, queue_depth=queue[cls], kv_usage=kv)

        return Signals({c: window(c, self.spec.fast_window_s) for c in CLASSES},
                       {c: window(c, self.spec.slow_window_s) for c in CLASSES})

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
        if not colocated:
            return {"chunk_size": None, "token_budget": None, "step_time_target_ms": None}
        config = fleet.replicas[colocated[0]].scheduler.config
        return {"chunk_size": config.chunk_size, "token_budget": config.token_budget,
                "step_time_target_ms": config.policy.step_time_target_ms}

    # -- one evaluation --------------------------------------------------------------------------

    def evaluate(self, fleet: Fleet) -> None:
        now = fleet.clock.now
        signals = self.signals(fleet, now)
        shape, colocated, dedicated = self.shape(fleet)
        knobs = self.knobs(fleet, colocated)
        before = self.history
        decision = decide(signals, shape, knobs, before, self.spec, now)
        self.history = decision.history
        self.decisions.append((now, signals, shape, knobs, before, decision))
        if decision.action != "hold":
            self.actions.append(Action(now, decision.action, decision.reason, decision.act,
                                       decision.knobs, decision.move))
        if decision.act and decision.action == "retune":
            changes: dict[str, Any] = {k: (int(v) if k != "step_time_target_ms" else v)
                                       for k, v in (decision.knobs or {}).items()}
            fleet.at(now + self.retune_delay_s, lambda f: f.reconfigure(self.shape(f)[1], changes))
        elif decision.act and decision.action == "reshape":
            fleet.at(now + self.reshape_delay_s, lambda f: self._move(f, decision.move))
        fleet.at(now + self.interval_s, self.evaluate)

    def _move(self, fleet: Fleet, move: str | None) -> None:
        roles = fleet.roles()
        _shape, colocated, dedicated = self.shape(fleet)
        if move == DEDICATE and len(colocated) > 1:
            moved = colocated[-1]
            fleet.set_roles({"interactive": roles["interactive"], "batch": [n for n in roles["batch"] if n != moved]})
        elif move == MERGE and dedicated:
            fleet.set_roles({"interactive": roles["interactive"], "batch": [*roles["batch"], dedicated[-1]]})
