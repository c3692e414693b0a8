"""Carrying out the SLO controller's decisions in place, the same way on Kubernetes and locally.

:class:`InPlace` is the :class:`~cadenza.control.loop.Actuation` of a ``mode: auto`` pool: the live
settings each replica's role asks for, a move in progress, and the moves themselves. It reaches the
world only through a :class:`Backend` — pods with labels in a cluster
(:mod:`cadenza.operator.k8s_roles`), processes behind a gateway config file under ``cadenza up``
(:mod:`cadenza.local.actuation`) — and an :class:`AdminClient`. Each tick of its loop
(:func:`in_place_loop`), after the signals are read:

1. :meth:`InPlace.prepare` gives every ready replica its role's live settings (``GET
   /admin/config``, ``PUT`` what differs), and only then routes it: interactive to every replica,
   batch and background to colocated ones — so a replica that restarted, or a new pod, serves
   nothing with wrong settings; then it advances a move in progress (no decision that tick);
2. :meth:`InPlace.act` logs the decision and, when it acts, records why (the figures the decision
   read, in a ``cadenza.controller.act`` span and ``status.lastRetune`` / ``lastShift``) and
   carries it out.

Moves, in the order that drops and slows nothing:

- *dedicate* (colocated -> interactive): stop routing batch to the replica, wait until it has no
  batch or background request running or waiting (at most ``drainTimeoutSeconds``; past it, the
  replica is routed batch again and stays colocated until the next try), apply the interactive
  settings, then label it interactive;
- *merge* (interactive -> colocated): apply the colocated settings, label it colocated, route batch;
- *retune*: the new knobs to every colocated replica.

No replica is started or stopped and no model reloaded. The state that must outlive the process
(:class:`State`: the knobs, the roles, a drain in progress; the loop keeps the controller's
history beside it) is plain data the caller stores — in the pool's status in a cluster.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.client import HTTPException
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.trace import Tracer

from cadenza.control.decide import Decision, Shape
from cadenza.control.history import DEDICATE, History, rfc3339
from cadenza.control.loop import ControlLoop, Evaluation
from cadenza.control.prometheus import signal_source
from cadenza.control.scrape import KEEP_MARGIN_S
from cadenza.control.signals import Signals
from cadenza.control.spec import ControllerSpec, spec_knobs
from cadenza.pool.engine_args import live_document
from cadenza.pool.live_knobs import KNOBS
from cadenza.pool.spec import Pool

logger = logging.getLogger("cadenza.controller")
LIVE_KNOBS = tuple(KNOBS.values())  # the knobs rung 1 moves, by their admin API names
DRAIN_TIMEOUT_S = 120.0
# A replica's queue counts come from its engine's published stats (at most ~0.2 s plus a step old)
# and requests routed just before the routing change may still be on their way: "no batch work"
# counts only once the drain is this old.
DRAIN_SETTLE_S = 2.0
COLOCATED, INTERACTIVE = "colocated", "interactive"


@dataclass
class Replica:
    """One engine replica as the in-place actuation sees it.

    Attributes:
        name: pod or process name. url: its HTTP root. ready: answering (pod Ready).
        routed_interactive / routed_batch: the gateway sends it that traffic now.
    """

    name: str
    url: str
    ready: bool = True
    routed_interactive: bool = False
    routed_batch: bool = False


class Backend(Protocol):
    """How :class:`InPlace` reaches a pool's replicas and gateways."""

    def replicas(self) -> list[Replica]:
        """The pool's engine replicas now."""

    def scrape(self) -> dict[str, str] | None:
        """``/metrics`` of every reachable gateway and engine of the pool, by pod or process name;
        None when no gateway answered."""

    def route(self, replica: Replica, role: str, interactive: bool, batch: bool) -> None:
        """Make the gateways send ``replica`` interactive / batch traffic or not, recording ``role``."""


class AdminClient:
    """``GET/PUT /admin/config`` and ``GET /ready`` of replicas (blocking, short timeouts)."""

    def __init__(self, token: str, timeout_s: float = 5.0) -> None:
        self.token, self.timeout_s = token, timeout_s

    def _open(self, req: urllib.request.Request) -> dict:
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read())

    def get_config(self, url: str) -> dict:
        return self._open(urllib.request.Request(f"{url}/admin/config",
                                                 headers={"Authorization": f"Bearer {self.token}"}))

    def put_config(self, url: str, doc: Mapping[str, Any]) -> dict:
        return self._open(urllib.request.Request(
            f"{url}/admin/config", json.dumps(doc).encode(), method="PUT",
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}))

    def ready(self, url: str) -> dict:
        return self._open(urllib.request.Request(f"{url}/ready"))


@dataclass
class State:
    """What must outlive the process besides the controller's history: the colocated knobs, each
    replica's role, a drain in progress (replica name, since) and the last retune and shift."""

    knobs: dict[str, Any] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    draining: tuple[str, float] | None = None
    last_retune: dict[str, Any] | None = None  # time, from, to, reason, signals
    last_shift: dict[str, Any] | None = None

    def to_status(self) -> dict[str, Any]:
        doc = {"knobs": dict(self.knobs), "roles": dict(self.roles)}
        if self.draining:
            doc["draining"] = {"replica": self.draining[0], "since": self.draining[1]}
        for key, value in (("lastRetuneDetail", self.last_retune), ("lastShiftDetail", self.last_shift)):
            if value:
                doc[key] = value
        return doc

    @classmethod
    def from_status(cls, doc: Mapping[str, Any] | None, knobs: Mapping[str, Any]) -> State:
        """What a previous process stored in ``status.controller`` (``knobs``: the spec's, when
        none were stored); garbage fields are dropped."""
        doc = doc if isinstance(doc, Mapping) else {}
        stored = doc.get("knobs") if isinstance(doc.get("knobs"), Mapping) else {}
        # A stored knob must be a usable number (or an unset step-time target); else the spec's.
        valid = {k: v for k in LIVE_KNOBS if k in stored and (
            (v := stored[k]) is None and k == "step_time_target_ms"
            or isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0)}
        roles_doc = doc.get("roles") if isinstance(doc.get("roles"), Mapping) else {}
        roles = {k: v for k, v in roles_doc.items() if isinstance(k, str) and v in (COLOCATED, INTERACTIVE)}
        drain = doc.get("draining") if isinstance(doc.get("draining"), Mapping) else None
        draining = None
        since = drain.get("since") if drain else None
        if drain and isinstance(drain.get("replica"), str) and isinstance(since, int | float) and math.isfinite(since):
            draining = (drain["replica"], float(since))
        details = [d if isinstance(d := doc.get(k), Mapping) else None for k in ("lastRetuneDetail", "lastShiftDetail")]
        return cls({**knobs, **valid}, roles, draining, *details)


class InPlace:
    """Actuation in place over a :class:`Backend` (see the module docstring).

    Args:
        pool: the pool (its spec gives the role settings and the drain timeout).
        backend: where the replicas and gateways are.
        admin: the client holding the pool's admin token.
        state: what the last process stored (a fresh one, at the spec's knobs, by default).
        tracer: where the ``cadenza.controller.act`` spans go.

    Attributes:
        last_shape: replicas per role at the last tick (None before the first).
    """

    def __init__(self, pool: Pool, backend: Backend, admin: AdminClient, state: State | None = None,
                 tracer: Tracer | None = None) -> None:
        self.pool, self.backend, self.admin = pool, backend, admin
        self.tracer = tracer or trace.get_tracer("cadenza.controller")
        self.state = state or State(knobs=spec_knobs(pool.spec))
        self.drain_timeout_s = float((pool.spec.get("controller") or {}).get("drainTimeoutSeconds", DRAIN_TIMEOUT_S))
        self.last_shape: Shape | None = None
        self._replicas: list[Replica] = []  # as the last prepare() found them
        self._last: Decision | None = None
        self._unreachable: set[str] = set()  # replicas whose admin API failed, until it answers
        self._last_kind = ""

    # -- one tick ------------------------------------------------------------------------------

    def prepare(self, now: float) -> tuple[Shape, dict[str, Any]] | None:
        """Give replicas their settings and routing, then advance a drain (None: nothing to
        decide this tick) or say the shape and knobs. Never raises for a replica or gateway that
        does not answer: that part waits a tick."""
        replicas = self._replicas = self.backend.replicas()
        self._assign_roles(replicas)
        self.last_shape = self.shape(replicas)
        self._reconcile(replicas)
        if self.state.draining is not None:
            self._advance_drain(replicas, now)
            return None
        return self.shape(replicas), dict(self.state.knobs)

    def act(self, evaluation: Evaluation) -> None:
        """Log the decision (actions always; a hold when its kind changes) and, when it acts,
        record why and carry it out inside a ``cadenza.controller.act`` span."""
        decision, now = evaluation.decision, evaluation.time
        self._last = decision
        kind = re.sub(r"[\d.]+", "#", decision.reason)
        level = logging.INFO if decision.action != "hold" or kind != self._last_kind else logging.DEBUG
        logger.log(level, "controller %s: %s — %s%s", self.pool.name, decision.action, decision.reason,
                   "" if decision.act or decision.action == "hold" else " (not acted on: advisory or frozen)")
        self._last_kind = kind
        if not decision.act:
            return
        signals = figures(evaluation.signals, evaluation.spec)
        with self.tracer.start_as_current_span("cadenza.controller.act", attributes={
                "cadenza.pool.name": self.pool.name, "cadenza.controller.action": decision.action,
                "cadenza.controller.move": decision.move or "", "cadenza.controller.reason": decision.reason,
                **{f"cadenza.signal.{k}": v for k, v in signals.items() if v is not None}}):
            self._record(decision, evaluation.shape, signals, now)
            self._carry_out(decision, self._replicas, now)

    def _record(self, decision: Decision, shape: Shape, signals: dict, now: float) -> None:
        entry = {"time": rfc3339(now), "reason": decision.reason,
                 "signals": {k: v for k, v in signals.items() if v is not None}}
        if decision.action == "retune":
            self.state.last_retune = {**entry, "from": {k: self.state.knobs.get(k) for k in decision.knobs},
                                      "to": dict(decision.knobs)}
        else:
            after = (shape.colocated - 1, shape.interactive + 1) if decision.move == DEDICATE else (
                shape.colocated + 1, shape.interactive - 1)
            self.state.last_shift = {**entry, "move": decision.move,
                                     "from": {"colocated": shape.colocated, "interactive": shape.interactive},
                                     "to": {"colocated": after[0], "interactive": after[1]}}

    def shape(self, replicas: list[Replica]) -> Shape:
        roles = [self.state.roles.get(r.name, COLOCATED) for r in replicas]
        return Shape(roles.count(COLOCATED), roles.count(INTERACTIVE))

    def status(self) -> dict[str, Any]:
        """The stored state and, after a decision, each class's SLO met or not."""
        doc = self.state.to_status()
        if self._last is not None:
            doc["sloMet"] = dict(self._last.slo_met)
        return doc

    # -- roles, settings, routing -------------------------------------------------------------

    def _assign_roles(self, replicas: list[Replica]) -> None:
        """Forget replicas that are gone; a new one takes the place of a lost interactive replica
        (the shape is kept), else starts colocated."""
        names = {r.name for r in replicas}
        before = list(self.state.roles.values()).count(INTERACTIVE)
        self.state.roles = {n: role for n, role in self.state.roles.items() if n in names}
        missing = before - list(self.state.roles.values()).count(INTERACTIVE)
        for replica in replicas:
            if replica.name not in self.state.roles:
                self.state.roles[replica.name] = INTERACTIVE if missing > 0 else COLOCATED
                missing -= self.state.roles[replica.name] == INTERACTIVE
        if self.state.draining and self.state.draining[0] not in names:
            self.state.draining = None

    def settings(self, role: str) -> dict[str, Any]:
        """The live settings of a role: interactive's from the spec; colocated's with the knobs."""
        if role == INTERACTIVE:
            return live_document(self.pool.role_settings(INTERACTIVE).engine)
        doc = live_document(self.pool.spec.get("engine") or {})
        doc.update({k: v for k, v in self.state.knobs.items() if k != "step_time_target_ms" or v is not None})
        return doc

    def _apply(self, replica: Replica, role: str) -> bool:
        """Give ``replica`` the settings of ``role`` unless it has them; False if it did not answer."""
        want = self.settings(role)
        try:
            have = self.admin.get_config(replica.url)
            if any(have.get(k) != want[k] for k in LIVE_KNOBS if k in want):
                self.admin.put_config(replica.url, want)
                logger.info("controller %s: %s now runs the %s settings", self.pool.name, replica.name, role)
        except (OSError, HTTPException, ValueError, AttributeError, TypeError) as exc:
            # Once per outage at WARNING (a restarting replica fails every tick until it is back).
            level = logging.DEBUG if replica.name in self._unreachable else logging.WARNING
            self._unreachable.add(replica.name)
            logger.log(level, "controller %s: %s did not take the %s settings: %s", self.pool.name, replica.name,
                       role, exc)
            return False
        if replica.name in self._unreachable:
            self._unreachable.discard(replica.name)
            logger.info("controller %s: %s answers again", self.pool.name, replica.name)
        return True

    def _reconcile(self, replicas: list[Replica]) -> None:
        draining = self.state.draining[0] if self.state.draining else None
        for replica in replicas:
            if not replica.ready:
                continue
            role = self.state.roles[replica.name]
            if not self._apply(replica, role):
                continue
            batch = role == COLOCATED and replica.name != draining
            if (replica.routed_interactive, replica.routed_batch) != (True, batch):
                self.backend.route(replica, role, interactive=True, batch=batch)

    # -- moves --------------------------------------------------------------------------------

    def _carry_out(self, decision: Decision, replicas: list[Replica], now: float) -> None:
        if decision.action == "retune":
            self.state.knobs.update(decision.knobs)
            for replica in replicas:
                if replica.ready and self.state.roles[replica.name] == COLOCATED:
                    self._apply(replica, COLOCATED)
            return
        if decision.move == DEDICATE:
            candidates = [r for r in replicas if r.ready and self.state.roles[r.name] == COLOCATED]
            if not candidates:
                return
            replica = candidates[-1]
            self.state.draining = (replica.name, now)
            self.backend.route(replica, COLOCATED, interactive=True, batch=False)
            logger.info("controller %s: %s out of the batch routing; draining its batch work", self.pool.name,
                        replica.name)
            self._advance_drain(replicas, now)
            return
        candidates = [r for r in replicas if r.ready and self.state.roles[r.name] == INTERACTIVE]
        if candidates and self._apply(candidates[-1], COLOCATED):
            replica = candidates[-1]
            self.state.roles[replica.name] = COLOCATED
            self.backend.route(replica, COLOCATED, interactive=True, batch=True)
            logger.info("controller %s: %s back to colocated", self.pool.name, replica.name)

    def _advance_drain(self, replicas: list[Replica], now: float) -> None:
        name, since = self.state.draining
        replica = next((r for r in replicas if r.name == name), None)
        busy = None
        if replica is not None:
            try:
                classes = self.admin.ready(replica.url)["classes"]
                busy = sum(classes[c]["running"] + classes[c]["waiting"] for c in ("batch", "background"))
            except (OSError, HTTPException, ValueError, KeyError, TypeError):
                busy = None
        if busy == 0 and now - since >= DRAIN_SETTLE_S and self._apply(replica, INTERACTIVE):
            self.state.roles[name] = INTERACTIVE
            self.state.draining = None
            self.backend.route(replica, INTERACTIVE, interactive=True, batch=False)
            logger.info("controller %s: %s drained; serving interactive only", self.pool.name, name)
        elif now - since > self.drain_timeout_s:
            self.state.draining = None
            if replica is not None:
                self.backend.route(replica, COLOCATED, interactive=True, batch=True)
            logger.warning("controller %s: %s still had batch work after %.0f s: it stays colocated",
                           self.pool.name, name, now - since)


def figures(signals: Signals, spec: ControllerSpec) -> dict[str, Any]:
    """The slow-window figures a decision read, for its record: per class with an SLO and a known
    window, ``CLS.ttft_p99_ms`` / ``itl_p99_ms`` (ms) / ``queue_depth`` / ``preemptions``, and the
    pool's ``kv_usage`` (0-1) and ``predicted_step_p99_ms``."""
    out: dict[str, Any] = {}
    for cls, window in signals.slow.items():
        if cls in spec.slo and window.known:
            for key, value in (("ttft_p99_ms", window.ttft_p99_ms), ("itl_p99_ms", window.itl_p99_ms),
                               ("queue_depth", window.queue_depth), ("preemptions", window.preemptions)):
                out[f"{cls}.{key}"] = round(value, 1) if isinstance(value, float) else value
            if cls == "interactive":  # the pool's figures, the same in every class's window
                out["kv_usage"] = None if window.kv_usage is None else round(window.kv_usage, 3)
                out["predicted_step_p99_ms"] = (None if window.predicted_step_p99_ms is None
                                                else round(window.predicted_step_p99_ms, 1))
    return out


def in_place_loop(pool: Pool, backend: Backend, admin: AdminClient, stored: Mapping[str, Any] | None = None, *,
                  clock: Callable[[], float] = time.time, tracer: Tracer | None = None) -> ControlLoop:
    """The control loop of a ``mode: auto`` pool, acting in place over ``backend``.

    Args:
        stored: a ``status.controller`` document the loop continues from (history, knobs, roles, a
            drain in progress): what a previous operator stored, or what the caller knows of its
            replicas (``cadenza up``: each one's role); None: a fresh start.
        clock: epoch seconds (injected in tests).

    Its source is the one ``spec.controller.prometheus`` asks for, else a scrape of ``backend``.

    Raises:
        ValueError: controller bounds that are empty or inverted (:meth:`ControllerSpec.from_pool_spec`).
    """
    spec = ControllerSpec.from_pool_spec(pool.spec)
    actuation = InPlace(pool, backend, admin, State.from_status(stored, spec_knobs(pool.spec)), tracer)
    return ControlLoop(signal_source(pool.spec, backend.scrape, keep_s=spec.slow_window_s + KEEP_MARGIN_S),
                       spec, actuation, history=History.from_status(stored), clock=clock)


def follow(loop: ControlLoop, pool: Pool) -> None:
    """A changed spec: new SLOs, bounds and role settings from the next tick of an in-place ``loop``."""
    loop.update(ControllerSpec.from_pool_spec(pool.spec))
    loop.actuation.pool = pool
