"""Carrying out the SLO controller's decisions in place, the same way on Kubernetes and locally.

:class:`Actuator` holds one pool's controller loop — windows from gateway and engine scrapes, the live
settings each replica's role asks for, a move in progress, :func:`~.controller.decide` — and
reaches the world only through a :class:`Backend`: pods with labels in a cluster
(:mod:`.k8s_roles`), processes behind a gateway config file under ``cadenza up``
(:mod:`.local_control`). Each :meth:`Actuator.tick`:

1. records a scrape of the pool's gateways and engines (or, with ``spec.controller.prometheus``,
   reads the windows from a Prometheus-compatible API instead);
2. gives every ready replica its role's live settings (``GET /admin/config``, ``PUT`` what
   differs), and only then routes it: interactive to every replica, batch and background to
   colocated ones — so a replica that restarted, or a new pod, serves nothing with wrong settings;
3. advances a move in progress, or else decides and carries out the decision.

Moves, in the order that drops and slows nothing:

- *dedicate* (colocated -> interactive): stop routing batch to the replica, wait until it has no
  batch or background request running or waiting (at most ``drainTimeoutSeconds``; past it, the
  replica is routed batch again and stays colocated until the next try), apply the interactive
  settings, then label it interactive;
- *merge* (interactive -> colocated): apply the colocated settings, label it colocated, route batch;
- *retune*: the new knobs to every colocated replica.

No replica is started or stopped and no model reloaded. The state that must outlive the process
(:class:`State`: the controller's history, the knobs, the shape, a drain in progress) is plain
data the backend stores — in the pool's status in a cluster.
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

from cadenza.control.decide import Decision, Shape, decide
from cadenza.control.history import DEDICATE, History, rfc3339
from cadenza.control.spec import ControllerSpec
from cadenza.pool.engine_args import live_document
from cadenza.pool.spec import Pool
from cadenza.control.prometheus import signal_source
from cadenza.control.signals import Signals, read_signals

logger = logging.getLogger("cadenza.controller")
LIVE_KNOBS = ("token_budget", "chunk_size", "step_time_target_ms")
DRAIN_TIMEOUT_S = 120.0
# A replica's queue counts come from its engine's published stats (at most ~0.2 s plus a step old)
# and requests routed just before the routing change may still be on their way: "no batch work"
# counts only once the drain is this old.
DRAIN_SETTLE_S = 2.0
COLOCATED, INTERACTIVE = "colocated", "interactive"


@dataclass
class Replica:
    """One engine replica as the actuator sees it.

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
    """How an :class:`Actuator` reaches a pool's replicas and gateways."""

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
    """What must outlive the process: the controller's history, the colocated knobs, each
    replica's role, and a drain in progress (replica name, since)."""

    history: History = field(default_factory=History)
    knobs: dict[str, Any] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    draining: tuple[str, float] | None = None
    last_retune: dict[str, Any] | None = None  # time, from, to, reason, signals
    last_shift: dict[str, Any] | None = None

    def to_status(self) -> dict[str, Any]:
        doc = {**self.history.to_status(), "knobs": dict(self.knobs), "roles": dict(self.roles)}
        if self.draining:
            doc["draining"] = {"replica": self.draining[0], "since": self.draining[1]}
        for key, value in (("lastRetuneDetail", self.last_retune), ("lastShiftDetail", self.last_shift)):
            if value:
                doc[key] = value
        return doc

    @classmethod
    def from_status(cls, doc: Mapping[str, Any] | None, knobs: Mapping[str, Any]) -> State:
        """What a previous process stored (``knobs``: the spec's, when none were stored)."""
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
        return cls(History.from_status(doc), {**knobs, **valid}, roles, draining, *details)


class Actuator:
    """One pool's controller loop over a :class:`Backend` (see the module docstring).

    Args:
        pool: the pool (its spec gives the SLOs, bounds and role settings).
        backend: where the replicas and gateways are.
        admin: the client holding the pool's admin token.
        state: what the last process stored (a fresh one by default).
        clock: seconds since the epoch (injected in tests).
    """

    def __init__(self, pool: Pool, backend: Backend, admin: AdminClient, state: State | None = None,
                 clock: Callable[[], float] = time.time, tracer: Tracer | None = None) -> None:
        self.pool, self.backend, self.admin, self.clock = pool, backend, admin, clock
        self.tracer = tracer or trace.get_tracer("cadenza.controller")
        self.spec = ControllerSpec.from_pool_spec(pool.spec)
        self.source = signal_source(pool.spec, backend.scrape, keep_s=self.spec.slow_window_s + 120)
        self.state = state or State(knobs=spec_knobs(pool.spec))
        self.drain_timeout_s = float((pool.spec.get("controller") or {}).get("drainTimeoutSeconds", DRAIN_TIMEOUT_S))
        self.last: Decision | None = None
        self.last_shape: Shape | None = None  # replicas per role at the last tick
        self._unreachable: set[str] = set()  # replicas whose admin API failed, until it answers
        self._last_kind = ""

    def update(self, pool: Pool) -> None:
        """A changed spec: new SLOs, bounds and role settings from the next tick."""
        self.pool, self.spec = pool, ControllerSpec.from_pool_spec(pool.spec)

    @property
    def interval_s(self) -> float:
        """Seconds between ticks: a few scrapes per fast window."""
        return max(1.0, min(15.0, self.spec.fast_window_s / 4))

    # -- one evaluation ------------------------------------------------------------------------

    def tick(self) -> Decision | None:
        """Scrape, give replicas their settings and routing, advance a drain or decide and act.
        Never raises for a replica or gateway that does not answer: that part waits a tick."""
        now = self.clock()
        self.source.record(now)
        replicas = self.backend.replicas()
        self._assign_roles(replicas)
        self.last_shape = self.shape(replicas)
        self._reconcile(replicas)
        if self.state.draining is not None:
            self._advance_drain(replicas, now)
            return None
        decision = decide(self.signals(now), self.shape(replicas), self.state.knobs, self.state.history, self.spec, now)
        self.state.history, self.last = decision.history, decision
        kind = re.sub(r"[\d.]+", "#", decision.reason)  # actions always; a hold when its kind changes
        level = logging.INFO if decision.action != "hold" or kind != self._last_kind else logging.DEBUG
        logger.log(level, "controller %s: %s — %s%s", self.pool.name, decision.action, decision.reason,
                   "" if decision.act or decision.action == "hold" else " (not acted on: advisory or frozen)")
        self._last_kind = kind
        if decision.act:
            signals = self._figures(now)
            with self.tracer.start_as_current_span("cadenza.controller.act", attributes={
                    "cadenza.pool.name": self.pool.name, "cadenza.controller.action": decision.action,
                    "cadenza.controller.move": decision.move or "", "cadenza.controller.reason": decision.reason,
                    **{f"cadenza.signal.{k}": v for k, v in signals.items() if v is not None}}):
                self._record(decision, replicas, signals, now)
                self._carry_out(decision, replicas, now)
        return decision

    def _figures(self, now: float) -> dict[str, Any]:
        """The slow-window figures the decision read, for the record (per class with an SLO)."""
        out: dict[str, Any] = {}
        for cls, window in self.signals(now).slow.items():
            if cls in self.spec.slo and window.known:
                for key, value in (("ttft_p99_ms", window.ttft_p99_ms), ("itl_p99_ms", window.itl_p99_ms),
                                   ("queue_depth", window.queue_depth), ("preemptions", window.preemptions)):
                    out[f"{cls}.{key}"] = round(value, 1) if isinstance(value, float) else value
                if cls == "interactive":  # the pool's figures, the same in every class's window
                    out["kv_usage"] = None if window.kv_usage is None else round(window.kv_usage, 3)
                    out["predicted_step_p99_ms"] = (None if window.predicted_step_p99_ms is None
                                                    else round(window.predicted_step_p99_ms, 1))
        return out

    def _record(self, decision: Decision, replicas: list[Replica], signals: dict, now: float) -> None:
        entry = {"time": rfc3339(now), "reason": decision.reason,
                 "signals": {k: v for k, v in signals.items() if v is not None}}
        if decision.action == "retune":
            self.state.last_retune = {**entry, "from": {k: self.state.knobs.get(k) for k in decision.knobs},
                                      "to": dict(decision.knobs)}
        else:
            shape = self.shape(replicas)
            after = (shape.colocated - 1, shape.interactive + 1) if decision.move == DEDICATE else (
                shape.colocated + 1, shape.interactive - 1)
            self.state.last_shift = {**entry, "move": decision.move,
                                     "from": {"colocated": shape.colocated, "interactive": shape.interactive},
                                     "to": {"colocated": after[0], "interactive": after[1]}}

    def signals(self, now: float) -> Signals:
        spec = self.spec
        return read_signals(self.source, now, spec.slo, spec.fast_window_s, spec.slow_window_s,
                            min_samples=spec.min_samples, stale_s=spec.stale_s)

    def shape(self, replicas: list[Replica]) -> Shape:
        roles = [self.state.roles.get(r.name, COLOCATED) for r in replicas]
        return Shape(roles.count(COLOCATED), roles.count(INTERACTIVE))

    def status(self) -> dict[str, Any]:
        """``status.controller`` / the state file: the stored state and the last decision."""
        doc = self.state.to_status()
        if self.last is not None:
            doc["lastDecision"] = {"action": self.last.action, "reason": self.last.reason, "acted": self.last.act}
            doc["sloMet"] = dict(self.last.slo_met)
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


def spec_knobs(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The colocated knobs a pool starts with: its ``spec.engine``'s (engine defaults when unset)."""
    engine = spec.get("engine") or {}
    doc = live_document(engine)
    return {"token_budget": doc["token_budget"], "chunk_size": doc["chunk_size"],
            "step_time_target_ms": engine.get("stepTimeTargetMs")}
