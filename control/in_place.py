"""Carrying out the SLO controller's decisions in place, the same way on Kubernetes and locally.

:class:`InPlace` is the :class:`~cadenza.control.loop.Actuation` of a ``mode: auto`` pool: the live
settings each replica's role asks for, a move in progress, and the moves themselves. It reaches the
world only through a :class:`~cadenza.control.replicas.Backend` — pods with labels in a cluster
(:mod:`cadenza.operator.k8s_roles`), processes behind a gateway config file under ``cadenza up``
(:mod:`cadenza.local.actuation`) — and an :class:`~cadenza.control.replicas.AdminClient`. Each
tick of its loop (:func:`in_place_loop`), after the signals are read:

1. :meth:`InPlace.prepare` gives every ready replica its role's live settings (``GET
   /admin/config``, ``PUT`` what differs), and only then routes it (its role's routes,
   :data:`~cadenza.control.roles.ROUTES`) — so a replica that restarted, or a new pod, serves
   nothing with wrong settings; then it advances a move in progress (no decision that tick);
2. :meth:`InPlace.act` logs the decision and, when it acts, records why (the figures the decision
   read and the shape before and after, in a ``cadenza.controller.act`` span and
   ``status.lastRetune`` / ``lastShift``) and carries it out.

Moves (:mod:`cadenza.control.roles`), in the order that drops and slows nothing:

- *dedicate* (colocated -> interactive): stop routing batch to the replica, wait until it has no
  batch or background request running or waiting (at most ``drainTimeoutSeconds``; past it, the
  replica is routed batch again and stays colocated until the next try), apply the interactive
  settings, then label it interactive;
- *disaggregate* (colocated -> prefill): stop routing interactive and batch to it, wait until it
  has no request of any class running or waiting (the same timeout; past it, it is routed back
  and stays colocated), apply the prefill settings (:func:`prefill_settings`), then label it
  prefill and route it as a prefill replica: the gateways send it the long prompts their
  selective rule moves, and the replicas that decode pull the KV from its KV endpoint;
- *merge* / *aggregate* (interactive / prefill -> colocated): apply the colocated settings, label it
  colocated, route interactive and batch. A former prefill replica keeps its KV endpoint, so the
  KV it published under lease is still served to the replicas pulling it;
- *retune*: the new knobs to every colocated replica.

A replica lost in the interactive or prefill role is replaced in it by the next new one (the shape
the controller chose is kept: its decisions count on it); while the pool does not let the
controller disaggregate (``spec.controller.disaggregate: false``), a prefill replica goes back to
colocated at the next tick. Interactive always keeps a replica that decodes: when the others are
lost (a scale-down, an eviction), a drain into prefill is called off, or a prefill replica goes
back to colocated.

No replica is started or stopped and no model reloaded. The state that must outlive the process
(:class:`~cadenza.control.replicas.State`: the knobs, the roles, a move in progress; the loop keeps
the controller's history beside it) is plain data the caller stores — in the pool's status in a cluster.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from http.client import HTTPException
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Tracer

from cadenza.control.decide import Decision, Shape
from cadenza.control.history import DISAGGREGATE, SPLITS, History, rfc3339
from cadenza.control.loop import ControlLoop, Evaluation
from cadenza.control.roles import (COLOCATED, INTERACTIVE, MOVE, PREFILL, ROUTES, Drain, busy, describe, shape_after,
                                   shape_doc, shape_of)
from cadenza.control.prometheus import signal_source
from cadenza.control.replicas import LIVE_KNOBS, AdminClient, Backend, Replica, State
from cadenza.control.scrape import KEEP_MARGIN_S
from cadenza.control.signals import Signals
from cadenza.control.spec import ControllerSpec, spec_knobs
from cadenza.pool.engine_args import live_document
from cadenza.pool.live_knobs import knob_bounds
from cadenza.pool.spec import Pool

logger = logging.getLogger("cadenza.controller")
DRAIN_TIMEOUT_S = 120.0
# A replica's queue counts come from its engine's published stats (at most ~0.2 s plus a step old)
# and requests routed just before the routing change may still be on their way: "no batch work"
# counts only once the drain is this old.
DRAIN_SETTLE_S = 2.0
# What each role serves, for the log.
_SERVING = {COLOCATED: "serving every class", INTERACTIVE: "serving interactive only",
            PREFILL: "prefilling the long prompts the gateways move"}


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
        shape = evaluation.shape
        after = shape_after(shape, decision.move) if decision.action == "reshape" else shape
        with self.tracer.start_as_current_span("cadenza.controller.act", attributes={
                "cadenza.pool.name": self.pool.name, "cadenza.controller.action": decision.action,
                "cadenza.controller.move": decision.move or "", "cadenza.controller.reason": decision.reason,
                "cadenza.controller.shape.before": describe(shape), "cadenza.controller.shape.after": describe(after),
                **{f"cadenza.signal.{k}": v for k, v in signals.items() if v is not None}}):
            self._record(decision, shape, signals, now)
            self._carry_out(decision, self._replicas, now)

    def _record(self, decision: Decision, shape: Shape, signals: dict, now: float) -> None:
        entry = {"time": rfc3339(now), "reason": decision.reason,
                 "signals": {k: v for k, v in signals.items() if v is not None}}
        if decision.action == "retune":
            self.state.last_retune = {**entry, "from": {k: self.state.knobs.get(k) for k in decision.knobs},
                                      "to": dict(decision.knobs)}
        else:
            self.state.last_shift = {**entry, "move": decision.move, "from": shape_doc(shape),
                                     "to": shape_doc(shape_after(shape, decision.move))}

    def shape(self, replicas: list[Replica]) -> Shape:
        """Replicas per role among ``replicas`` (a replica draining counts in the role it leaves)."""
        return shape_of([self.state.roles.get(r.name, COLOCATED) for r in replicas])

    def status(self) -> dict[str, Any]:
        """The stored state and, after a decision, each class's SLO met or not."""
        doc = self.state.to_status()
        if self._last is not None:
            doc["sloMet"] = dict(self._last.slo_met)
        return doc

    # -- roles, settings, routing -------------------------------------------------------------

    def _assign_roles(self, replicas: list[Replica]) -> None:
        """Forget replicas that are gone; a new one takes the place of a lost interactive or
        prefill replica (the shape is kept), else starts colocated. Without
        ``spec.controller.disaggregate`` a prefill replica is colocated again and a drain into
        prefill is called off. When no other replica would decode (the others lost), a drain into
        prefill is called off, else a prefill replica is colocated again."""
        names = {r.name for r in replicas}
        before = dict(self.state.roles)
        if not self.pool.prefill_in_place and PREFILL in before.values():
            logger.info("controller %s: spec.controller.disaggregate is off: prefill replicas back to colocated",
                        self.pool.name)
            before = {n: COLOCATED if role == PREFILL else role for n, role in before.items()}
        roles = {n: role for n, role in before.items() if n in names}
        lost = [role for role in (INTERACTIVE, PREFILL)
                for _ in range(list(before.values()).count(role) - list(roles.values()).count(role))]
        for replica in replicas:
            if replica.name not in roles:
                roles[replica.name] = lost.pop(0) if lost else COLOCATED
        self.state.roles = roles
        drain = self.state.draining
        if drain and (drain.replica not in names or drain.move == DISAGGREGATE and not self.pool.prefill_in_place):
            drain = self.state.draining = None
        # Interactive keeps a replica that decodes, also when the others are lost (a scale-down,
        # an eviction): a drain into prefill is called off, else a prefill replica decodes again.
        leaving = drain.replica if drain and drain.move == DISAGGREGATE else None
        if roles and not any(role in (COLOCATED, INTERACTIVE) and name != leaving for name, role in roles.items()):
            if leaving is not None:
                self.state.draining = None
                logger.warning("controller %s: %s stays colocated: no other replica decodes", self.pool.name,
                               drain.replica)
            elif PREFILL in roles.values():
                name = next(n for n, role in roles.items() if role == PREFILL)
                roles[name] = COLOCATED
                logger.warning("controller %s: %s back to colocated: no other replica decodes", self.pool.name, name)

    def settings(self, role: str) -> dict[str, Any]:
        """The live settings of a role: interactive's from the spec (``dedicated.engine`` on top of
        ``spec.engine``), prefill's from :func:`prefill_settings`, colocated's with the knobs."""
        if role == INTERACTIVE:
            return live_document(self.pool.role_settings(INTERACTIVE).engine)
        if role == PREFILL:
            return prefill_settings(self.pool)
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
        """Every ready replica runs its role's settings, then is in its role's routes (a replica
        draining: in the routes its move keeps it in)."""
        drain = self.state.draining
        for replica in replicas:
            if not replica.ready:
                continue
            role = self.state.roles[replica.name]
            if not self._apply(replica, role):
                continue
            routes = MOVE[drain.move].draining_routes if drain and replica.name == drain.replica else ROUTES[role]
            if replica.routes != routes:
                self.backend.route(replica, role, routes)

    # -- moves --------------------------------------------------------------------------------

    def _carry_out(self, decision: Decision, replicas: list[Replica], now: float) -> None:
        if decision.action == "retune":
            self.state.knobs.update(decision.knobs)
            for replica in replicas:
                if replica.ready and self.state.roles[replica.name] == COLOCATED:
                    self._apply(replica, COLOCATED)
            return
        move = MOVE[decision.move]
        candidates = [r for r in replicas if r.ready and self.state.roles[r.name] == move.source]
        if not candidates:
            logger.warning("controller %s: no ready %s replica to %s", self.pool.name, move.source, move.name)
            return
        replica = candidates[-1]
        if decision.move in SPLITS and (waiting := self._unready_stay(replica, move.name, replicas)):
            logger.warning("controller %s: not moving %s to %s while %s, which decide() counted on to serve, "
                           "is not ready", self.pool.name, replica.name, move.target, waiting)
            return
        if decision.move in SPLITS:  # out of the routes it leaves first; it changes once drained
            self.state.draining = Drain(replica.name, now, move.name)
            self.backend.route(replica, COLOCATED, move.draining_routes)
            logger.info("controller %s: %s out of the %s routing; draining its %s requests", self.pool.name,
                        replica.name, "/".join(sorted(ROUTES[COLOCATED] - move.draining_routes)),
                        "/".join(move.drains))
            self._advance_drain(replicas, now)
        elif self._apply(replica, COLOCATED):  # a merge or an aggregate: it only takes more traffic
            self.state.roles[replica.name] = COLOCATED
            self.backend.route(replica, COLOCATED, ROUTES[COLOCATED])
            logger.info("controller %s: %s back to colocated (%s)", self.pool.name, replica.name, move.name)

    def _unready_stay(self, replica: Replica, move: str, replicas: list[Replica]) -> str | None:
        """A replica the split of ``replica`` counts on to keep serving that is not ready, or None.

        :func:`~cadenza.control.decide.decide` counts every replica in its shape, ready or not:
        the other replicas of the source role it counted on (for batch and background), and for a
        move into prefill a replica that decodes, must be serving, or the split takes the pool's
        last serving replica out of its routes."""
        roles = self.state.roles
        others = [r for r in replicas if r is not replica and roles[r.name] == MOVE[move].source]
        if others and not any(r.ready for r in others):
            return others[0].name
        if move == DISAGGREGATE:
            decoding = [r for r in replicas if r is not replica and roles[r.name] in (COLOCATED, INTERACTIVE)]
            if not any(r.ready for r in decoding):
                return decoding[0].name if decoding else "a replica that decodes"
        return None

    def _advance_drain(self, replicas: list[Replica], now: float) -> None:
        name, since, move_name = self.state.draining
        move = MOVE[move_name]
        replica = next((r for r in replicas if r.name == name), None)
        left = None
        if replica is not None:
            try:
                left = busy(self.admin.ready(replica.url)["classes"], move_name)
            except (OSError, HTTPException, ValueError, KeyError, TypeError):
                left = None
        if left == 0 and now - since >= DRAIN_SETTLE_S and self._apply(replica, move.target):
            self.state.roles[name] = move.target
            self.state.draining = None
            self.backend.route(replica, move.target, ROUTES[move.target])
            logger.info("controller %s: %s drained; %s", self.pool.name, name, _SERVING[move.target])
        elif now - since > self.drain_timeout_s:
            self.state.draining = None
            if replica is not None:
                self.backend.route(replica, COLOCATED, ROUTES[COLOCATED])
            logger.warning("controller %s: %s still had %s requests after %.0f s: it stays colocated",
                           self.pool.name, name, "/".join(move.drains), now - since)


def prefill_settings(pool: Pool) -> dict[str, Any]:
    """The live settings of a replica moved into the prefill role (a ``PUT /admin/config`` body).

    What a static disaggregated pool's prefill replica runs — ``spec.engine`` with
    ``disaggregated.prefillEngine`` on top — except where ``prefillEngine`` is silent: the chunk
    size and token budget are then the top of the controller's bounds (``spec.controller.bounds``,
    the largest the pool lets the controller use; the chunk size's defaults to ``spec.engine``'s,
    and the chunk never exceeds the budget: a budget under the chunk ``prefillEngine`` names is
    raised to it), and no step-time target — a prefill replica streams
    no token, so nothing caps its chunks for ITL, and the larger its chunks the sooner each long
    prompt's KV is ready.

    Raises:
        ValueError: bounds that are empty or inverted (:func:`~cadenza.pool.live_knobs.knob_bounds`).
    """
    own = (pool.spec.get("disaggregated") or {}).get("prefillEngine") or {}
    doc = live_document(pool.role_settings(PREFILL).engine)
    bounds = knob_bounds(pool.spec)
    if "tokenBudget" not in own and "token_budget" in bounds:
        # the top of the bounds, but never under a chunk prefillEngine names (the engine refuses it)
        doc["token_budget"] = max(int(bounds["token_budget"][1]), int(own.get("chunkSize") or 0))
    if "chunkSize" not in own:
        doc["chunk_size"] = min(int(bounds["chunk_size"][1]), doc["token_budget"])
    if "stepTimeTargetMs" not in own:
        doc["step_time_target_ms"] = None
    return doc


def figures(signals: Signals, spec: ControllerSpec) -> dict[str, Any]:
    """The slow-window figures a decision read, for its record: per class with an SLO and a known
    window, ``CLS.ttft_p99_ms`` / ``itl_p99_ms`` (ms) / ``queue_depth`` / ``preemptions``, and the
    pool's ``kv_usage`` (0-1) and ``predicted_step_p99_ms``, and what rung 3 attributes
    interference by: ``prefill_share`` and ``long_prompt_share`` (0-1) and ``min_prompt_tokens``."""
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
                for key in ("prefill_share", "long_prompt_share", "min_prompt_tokens"):
                    value = getattr(window, key)
                    out[key] = None if value is None else round(value, 3 if key.endswith("share") else 0)
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
