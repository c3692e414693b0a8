"""The SLO controller in the simulation: the operator's own control loop
(:class:`~cadenza.control.loop.ControlLoop`), fed with windows built the way the operator builds
them, acting through the fleet after the delays that matter.

Every ``interval_s`` of virtual time the loop ticks (:func:`sim_controller`). Its source,
:class:`FleetSource`, reads per class a fast and a slow window ending ``scrape_delay_s`` ago (what
a scrape-based signal lags by): the latency observations the gateway would have recorded in them,
binned into the gateway's own histogram buckets (:func:`cadenza.gateway.metrics.latency_buckets`
around the SLO targets) and read by the operator's :func:`~cadenza.control.signals.window_of` —
so the p99 it sees is the interpolated bucket figure, as in production — plus the engines' queue
depth and KV usage at the tick, and the pool's prefill figures: the share of the tokens the
engines computed in the window that were prompt tokens (their counters, read at each tick), the
selective rule's threshold (what the serving replicas' cost models give on the modelled link, as
the gateway takes it, with or without prefill replicas: :meth:`~cadenza.sim.fleet.Fleet.threshold`)
and the share of the window's prompt tokens in prompts at least that long. Then
:func:`~cadenza.control.decide.decide` with the pool's shape, the colocated engines' live knobs and
the loop's history, and :class:`FleetActuation` carries the decision out:

- **retune**: the colocated replicas take the knobs ``retune_delay_s`` later (a ``PUT
  /admin/config`` round);
- **reshape** ``dedicate``: one colocated replica stops taking batch and background traffic
  ``reshape_delay_s`` later (the gateway's routing update); its batch work in flight finishes
  there; ``merge`` gives it back, with the colocated replicas' knobs;
- **reshape** ``disaggregate``: one colocated replica stops taking any traffic ``reshape_delay_s``
  later, finishes what it runs, takes the prefill role's knobs and serves as a ``prefill``
  replica: the gateway's router then moves long prompts to it (:mod:`cadenza.sim.disagg`);
  ``aggregate`` takes one back out of the prefill role into colocated, with the colocated
  replicas' knobs (the prompts it is prefilling finish there).

While a move is under way (from the decision to the replica serving in its new role) the
actuation gives the loop nothing to decide from, as the in-place actuation does. The replica
count is not the controller's; start-up delays of new replicas do not arise here.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from cadenza.control.decide import Shape
from cadenza.control.histograms import Histogram
from cadenza.control.history import AGGREGATE, DEDICATE, DISAGGREGATE, MERGE
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
        self._threshold: int | None = None
        # The engines' token counters at each record: (time, prefill tokens, all tokens), from 0 at 0.
        self._counted: tuple[list[float], list[int], list[int]] = ([0.0], [0], [0])

    def record(self, now: float) -> None:
        """The engines' load now: each class's longest queue, the fullest engine's KV usage (0-1),
        their prefill and decode token counters, and the selective rule's threshold."""
        replicas = self.fleet.replicas.values()
        self._queue = {cls: max((len(r.scheduler.queues[cls]) for r in replicas), default=0) for cls in CLASSES}
        self._kv = max((r.block_manager.num_used_blocks / r.block_manager.num_blocks for r in replicas), default=0.0)
        prefill = sum(r.scheduler.stats.prefill_tokens_admitted for r in replicas)
        decode = sum(r.scheduler.stats.decode_tokens for r in replicas)
        times, prefills, totals = self._counted
        if now > times[-1]:
            times.append(now), prefills.append(prefill), totals.append(prefill + decode)
        self._threshold = self.fleet.threshold()

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
        return replace(w, queue_depth=self._queue[cls], kv_usage=self._kv, prefill_share=self.prefill_share(start, end),
                       min_prompt_tokens=None if self._threshold is None else float(self._threshold),
                       long_prompt_share=self.long_prompt_share(start, end))

    def prefill_share(self, start: float, end: float) -> float | None:
        """Of the tokens the engines computed between the last records at or before ``start``
        and ``end``, the share that were prompt tokens (None: none computed, or no record between)."""
        times, prefills, totals = self._counted
        lo, hi = bisect.bisect_right(times, start) - 1, bisect.bisect_right(times, end) - 1
        tokens = totals[hi] - totals[lo]
        return (prefills[hi] - prefills[lo]) / tokens if tokens > 0 else None

    def long_prompt_share(self, start: float, end: float) -> float | None:
        """Of the prompt tokens the replicas took in ``(start, end]``, the share in prompts at
        least the last recorded threshold long (None: no threshold, or no prompt)."""
        if self._threshold is None:
            return None
        times = self.fleet.prompts_t
        lo, hi = bisect.bisect_right(times, start), bisect.bisect_right(times, end)
        prompts = np.asarray(self.fleet.prompts_n[lo:hi], dtype=np.int64)
        total = int(prompts.sum())
        return float(prompts[prompts >= self._threshold].sum()) / total if total else None


@dataclass
class FleetActuation:
    """The :class:`~cadenza.control.loop.Actuation` of a simulated fleet: routing and knobs
    changed after their delays.

    Args:
        fleet: the simulated pool.
        retune_delay_s, reshape_delay_s: seconds from a decision to its effect.
        prefill_knobs: the live knobs a replica takes in the prefill role (admin API names; a
            None step-time target clears it); None: it keeps its own.
        drain_poll_s: how often a replica leaving for the prefill role is checked for work left.

    Attributes:
        actions: every decision other than ``hold``, acted on or not.
        decisions: every evaluation, holds included.
        moving: the move under way (None: none), from its decision until the replica serves in
            its new role.
    """

    fleet: Fleet
    retune_delay_s: float = 1.0
    reshape_delay_s: float = 10.0
    prefill_knobs: Mapping[str, float | None] | None = None
    drain_poll_s: float = 0.5
    actions: list[Action] = field(default_factory=list)
    decisions: list[Evaluation] = field(default_factory=list)
    moving: str | None = None

    @staticmethod
    def shape(fleet: Fleet) -> tuple[Shape, list[str], list[str]]:
        """The pool's shape, its colocated replicas and its interactive-only ones (a replica on
        its way to the prefill role is in neither, nor in the shape)."""
        roles = fleet.roles()
        batch = set(roles.get("batch", ()))
        colocated = [n for n in roles.get("interactive", ()) if n in batch]
        dedicated = [n for n in roles.get("interactive", ()) if n not in batch]
        return Shape(len(colocated), len(dedicated), len(roles.get("prefill", ()))), colocated, dedicated

    @staticmethod
    def knobs(fleet: Fleet, colocated: list[str]) -> dict[str, float | None]:
        """The live knobs rung 1 moves, as the first colocated replica runs them (None without one)."""
        if not colocated:
            return dict.fromkeys(KNOBS.values())
        config = fleet.replicas[colocated[0]].scheduler.config
        return {name: getattr(config.policy if BY_NAME[name].section == "policy" else config, name)
                for name in KNOBS.values()}

    def prepare(self, now: float) -> tuple[Shape, dict[str, float | None]] | None:
        if self.moving is not None:
            return None
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
            self.moving = decision.move
            fleet.at(now + self.reshape_delay_s, lambda f: self._move(f, decision.move))

    def status(self) -> dict[str, Any]:
        return {}

    def _move(self, fleet: Fleet, move: str | None) -> None:
        """Route the move's replica for its new role (a replica leaving for prefill: first to
        nothing, then :meth:`_drain`). A move the pool cannot make now is dropped: a split
        without a colocated replica, one that would leave interactive no replica that decodes, a
        give-back with nothing to give back (decide() never asks for those; it may ask to move
        the last colocated replica when batch and background have no traffic)."""
        roles = fleet.roles()
        _shape, colocated, dedicated = self.shape(fleet)
        prefill, done = roles.get("prefill", []), True
        if move == DEDICATE and colocated:
            fleet.set_roles({**roles, "batch": [n for n in roles["batch"] if n != colocated[-1]]})
        elif move == MERGE and dedicated:
            self._colocated_knobs(fleet, colocated, [dedicated[-1]])
            fleet.set_roles({**roles, "batch": [*roles["batch"], dedicated[-1]]})
        elif move == DISAGGREGATE and len(colocated) + len(dedicated) > 1 and colocated:
            moved = colocated[-1]
            fleet.set_roles({role: [n for n in names if n != moved] for role, names in roles.items()})
            done = False
            self._drain(fleet, moved)
        elif move == AGGREGATE and prefill:
            moved = prefill[-1]
            self._colocated_knobs(fleet, colocated, [moved])
            fleet.set_roles({"interactive": [*roles["interactive"], moved], "batch": [*roles["batch"], moved],
                             "prefill": prefill[:-1]})
        if done:
            self.moving = None

    def _drain(self, fleet: Fleet, name: str) -> None:
        """``name`` serves nothing: once it has finished what it ran, make it a prefill replica."""
        replica = fleet.replicas[name]
        if replica.has_work or replica.in_flight:
            fleet.at(fleet.clock.now + self.drain_poll_s, lambda f: self._drain(f, name))
            return
        if self.prefill_knobs is not None:
            fleet.reconfigure([name], self.prefill_knobs)
        roles = fleet.roles()
        fleet.set_roles({**roles, "prefill": [*roles.get("prefill", []), name]})
        self.moving = None

    def _colocated_knobs(self, fleet: Fleet, colocated: list[str], names: list[str]) -> None:
        """Give ``names`` the knobs the colocated replicas run (theirs unchanged without any)."""
        if colocated:
            fleet.reconfigure(names, {k: v for k, v in self.knobs(fleet, colocated).items()})


def sim_controller(spec: ControllerSpec, fleet: Fleet, *, interval_s: float = 15.0, scrape_delay_s: float = 15.0,
                   retune_delay_s: float = 1.0, reshape_delay_s: float = 10.0, start_s: float = 0.0,
                   prefill_knobs: Mapping[str, float | None] | None = None) -> ControlLoop:
    """The control loop of a simulated ``auto`` pool, attached to ``fleet``: its first tick at
    ``start_s + interval_s``, then every ``interval_s`` (the operator's timer) on the fleet's clock.

    Args:
        spec: the pool's SLOs and controller settings (``ControllerSpec.from_pool_spec``).
        scrape_delay_s: how old the newest observation the windows see is (:class:`FleetSource`).
        retune_delay_s, reshape_delay_s: seconds from a decision to its effect (:class:`FleetActuation`).
        prefill_knobs: the live knobs of the pool's prefill role (:class:`FleetActuation`).
    """
    loop = ControlLoop(FleetSource(fleet, spec, scrape_delay_s), spec,
                       FleetActuation(fleet, retune_delay_s, reshape_delay_s, prefill_knobs),
                       clock=lambda: fleet.clock.now, interval_s=interval_s)

    def tick(f: Fleet) -> None:
        loop.tick()
        f.at(loop.next_tick_at, tick)

    fleet.at(start_s + interval_s, tick)
    return loop
