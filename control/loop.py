"""The SLO control loop: read a pool's signals once, decide, record, hand the decision to an actuation.

One loop runs the controller wherever it runs: in the operator (an ``auto`` pool, in place over its
pods; a fixed-mode pool with SLOs, advice only), under ``cadenza up`` (in place over local
processes) and in ``cadenza sim`` (the simulated fleet). Each :meth:`ControlLoop.tick` at ``now``
(the injected clock):

1. the source records what a window needs (a scrape; nothing for a Prometheus API) and every
   class's fast and slow window is read — **once**: the decision, the figures its record carries and
   the pool's status all use these signals (:attr:`ControlLoop.signals`), so a Prometheus source is
   queried for one reading per tick, never again for the status;
2. the :class:`Actuation` brings the pool in line with its roles (settings, routing, a move in
   progress) and says what to decide from: the shape and the colocated engines' live knobs — or
   nothing while a move is in progress;
3. :func:`~cadenza.control.decide.decide` with the loop's :class:`~cadenza.control.history.History`;
   the loop keeps the decision's history and the decision (:attr:`ControlLoop.last`), and hands the
   whole :class:`Evaluation` to the actuation, which carries it out, or records it as advice.

Actuations live where their world is: in place over replicas with an admin API
(:mod:`cadenza.control.in_place`, with a pods backend in the operator and a processes backend under
``cadenza up``), advice only for a fixed-mode pool (:mod:`cadenza.control.advisory`), and the
simulated fleet (:mod:`cadenza.sim.control`). The loop keeps its own schedule: :attr:`interval_s`
and :meth:`due` (the operator ticks at each resync instead; the simulator at virtual times).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from cadenza.control.decide import Decision, Shape, decide
from cadenza.control.history import History
from cadenza.control.signals import SignalSource, Signals, read_signals
from cadenza.control.spec import ControllerSpec

MAX_INTERVAL_S = 15.0  # the operator's resync: a loop never ticks less often than it


class Evaluation(NamedTuple):
    """One decision with everything :func:`~cadenza.control.decide.decide` read to make it.

    ``decide(signals, shape, knobs, history, spec, time) == decision``; ``history`` is the one
    decide() was given (``decision.history`` is the one it returned).
    """

    time: float
    signals: Signals
    shape: Shape
    knobs: Mapping[str, float | None]
    history: History
    spec: ControllerSpec
    decision: Decision


class Actuation(Protocol):
    """What a :class:`ControlLoop` acts through: the pool's replicas, as they are where it runs."""

    def prepare(self, now: float) -> tuple[Shape, Mapping[str, float | None]] | None:
        """Bring the pool in line with its roles (settings before routing; a move in progress
        advanced) and return its shape and the colocated engines' live knobs (``chunk_size``,
        ``token_budget``, ``step_time_target_ms``; None when unset) to decide from; None while a
        move in progress leaves nothing to decide this tick."""

    def act(self, evaluation: Evaluation) -> None:
        """Carry out ``evaluation.decision`` when its ``act`` is set (else only record it)."""

    def status(self) -> dict[str, Any]:
        """This actuation's fields of ``status.controller`` (the loop adds the history and the
        last decision)."""


class ControlLoop:
    """One pool's SLO controller: a signal source, its settings, an actuation (module docstring).

    Args:
        source: where the windows come from (:class:`~cadenza.control.signals.SignalSource`).
        spec: the pool's SLOs and controller settings.
        actuation: how decisions reach the pool.
        history: what a previous process stored (:meth:`History.from_status`); empty by default.
        clock: seconds (epoch seconds where the history is stored: RFC 3339 times in status).
        interval_s: seconds between ticks; None: a few per fast window (1 to 15 s).

    Attributes:
        signals: the last tick's signals (None before the first tick).
        last: the last decision made (a tick during a move makes none and keeps it).
    """

    def __init__(self, source: SignalSource, spec: ControllerSpec, actuation: Actuation, *,
                 history: History | None = None, clock: Callable[[], float] | None = None,
                 interval_s: float | None = None) -> None:
        self.source, self.spec, self.actuation = source, spec, actuation
        self.history = history if history is not None else History()
        self.clock = clock or time.time
        self._interval_s = interval_s
        self.signals: Signals | None = None
        self.last: Decision | None = None
        self.next_tick_at: float | None = None

    @property
    def interval_s(self) -> float:
        """Seconds between ticks: the one given, else a few scrapes per fast window."""
        if self._interval_s is not None:
            return self._interval_s
        return max(1.0, min(MAX_INTERVAL_S, self.spec.fast_window_s / 4))

    def due(self, now: float | None = None) -> bool:
        """A tick is due at ``now`` (the clock's by default): none yet, or an interval since the last."""
        now = self.clock() if now is None else now
        return self.next_tick_at is None or now >= self.next_tick_at

    def update(self, spec: ControllerSpec, source: SignalSource | None = None) -> None:
        """New settings from the next tick; a new ``source`` replaces the old (its windows start over)."""
        self.spec = spec
        if source is not None:
            self.source = source

    def read(self, now: float) -> Signals:
        """Every class's fast and slow window at ``now``, as the settings ask for them."""
        spec = self.spec
        return read_signals(self.source, now, spec.slo, spec.fast_window_s, spec.slow_window_s,
                            min_samples=spec.min_samples, stale_s=spec.stale_s)

    def tick(self, now: float | None = None) -> Decision | None:
        """Record and read the signals once, let the actuation prepare, decide and hand the
        decision on; the decision, or None while a move is in progress.

        Raises:
            whatever the source's ``record`` or the actuation raises (an API that failed):
            :attr:`signals` is read all the same, so the status still reports this tick's.
        """
        now = self.clock() if now is None else now
        self.next_tick_at = now + self.interval_s
        try:
            self.source.record(now)
        finally:
            self.signals = self.read(now)
        prepared = self.actuation.prepare(now)
        if prepared is None:
            return None
        shape, knobs = prepared
        before, spec = self.history, self.spec
        decision = decide(self.signals, shape, knobs, before, spec, now)
        self.history, self.last = decision.history, decision
        self.actuation.act(Evaluation(now, self.signals, shape, knobs, before, spec, decision))
        return decision

    def status(self) -> dict[str, Any]:
        """``status.controller`` (and the state file of ``cadenza up``): the history, the
        actuation's fields and the last decision."""
        doc = {**self.history.to_status(), **self.actuation.status()}
        if self.last is not None:
            doc["lastDecision"] = {"action": self.last.action, "reason": self.last.reason, "acted": self.last.act}
        return doc
