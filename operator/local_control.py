"""Hybrid mode in ``cadenza up``: the SLO controller acting on local replicas.

Every ``interval_s`` the supervisor calls :meth:`LocalController.tick`, which

1. scrapes the gateway's ``/metrics`` into a :class:`~cadenza.operator.signals.SnapshotHistory`;
2. keeps each replica's live settings equal to its role's (``GET /admin/config``, then ``PUT`` what
   differs — so a replica that restarted with its start-up flags gets its role back);
3. advances a move in progress (a replica draining its batch work), or else calls the same
   :func:`~cadenza.operator.controller.decide` as the operator and carries out what it says,
   printing each decision.

Actuation is in place, in the order that drops and slows nothing:

- *dedicate* (colocated -> interactive): take the replica out of the batch routing (the gateway
  re-reads its config file on SIGHUP), wait until it has no batch or background request running
  or waiting (at most ``drain_timeout_s``; past it, the replica goes back into the batch routing
  and stays colocated until the next try), then apply the interactive settings;
- *merge* (interactive -> colocated): apply the colocated settings, then route batch to it again;
- *retune*: apply the new knobs to every colocated replica.

No process is started or stopped and no model reloaded. Replicas are reached with the pool's
admin token (``cadenza up`` generates one per run and gives it to every replica).
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from cadenza.operator.controller import DEDICATE, ControllerSpec, Decision, History, Shape, decide
from cadenza.operator.engine_args import live_document
from cadenza.operator.pool import Pool
from cadenza.operator.signals import CLASSES, Signals, SnapshotHistory, parse_gateway_metrics

logger = logging.getLogger("cadenza.up.controller")
LIVE_KNOBS = ("token_budget", "chunk_size", "step_time_target_ms")
DRAIN_TIMEOUT_S = 120.0


class AdminClient:
    """``GET/PUT /admin/config`` and plain GETs against local replicas (blocking, short timeouts)."""

    def __init__(self, token: str, timeout_s: float = 5.0) -> None:
        self.token, self.timeout_s = token, timeout_s

    def get_json(self, url: str, auth: bool = False) -> dict:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.token}"} if auth else {})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read())

    def get_text(self, url: str) -> str:
        with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
            return resp.read().decode()

    def put_config(self, url: str, doc: dict) -> dict:
        req = urllib.request.Request(f"{url}/admin/config", json.dumps(doc).encode(), method="PUT",
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read())


@dataclass
class Replica:
    """What the controller knows of one local replica."""

    name: str
    url: str
    role: str = "colocated"  # colocated | interactive


@dataclass
class _Drain:
    replica: Replica
    since: float


class LocalController:
    """Keeps a local ``mode: auto`` pool's SLOs (see the module docstring).

    Args:
        pool: the pool.
        replicas: its replicas (all start colocated).
        gateway_url: where ``/metrics`` is scraped.
        route: called with ``{"interactive": [urls], "batch": [urls]}`` to change the gateway's
            routing (it rewrites the config file and signals the gateway).
        admin: the client with the pool's admin token.
        clock: seconds (``time.time`` by default; tests inject their own).
    """

    def __init__(self, pool: Pool, replicas: list[Replica], gateway_url: str,
                 route: Callable[[dict[str, list[str]]], None], admin: AdminClient,
                 clock: Callable[[], float] = time.time, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        self.pool, self.replicas, self.gateway_url = pool, replicas, gateway_url
        self.route, self.admin, self.clock = route, admin, clock
        self.spec = ControllerSpec.from_pool_spec(pool.spec)
        self.snapshots = SnapshotHistory(keep_s=self.spec.slow_window_s + 60)
        self.history = History()
        engine = pool.spec.get("engine") or {}
        self.knobs: dict = {k: live_document(engine).get(k) for k in LIVE_KNOBS}
        self.knobs["step_time_target_ms"] = engine.get("stepTimeTargetMs")
        self.drain: _Drain | None = None
        self.drain_timeout_s = float((pool.spec.get("controller") or {}).get("drainTimeoutSeconds", drain_timeout_s))
        self.last: Decision | None = None
        self._last_reason = ""

    @property
    def interval_s(self) -> float:
        """Seconds between ticks: a few scrapes per fast window."""
        return max(1.0, min(15.0, self.spec.fast_window_s / 4))

    # -- one evaluation ------------------------------------------------------------------------

    def tick(self) -> Decision | None:
        """Scrape, reconcile settings, and decide (or advance a drain). Never raises for a replica
        or gateway that does not answer: that evaluation holds."""
        now = self.clock()
        try:
            text = self.admin.get_text(f"{self.gateway_url}/metrics")
            self.snapshots.add(parse_gateway_metrics([text], now))
        except (OSError, ValueError) as exc:
            logger.debug("gateway metrics not scraped: %s", exc)
        self._reconcile_settings()
        if self.drain is not None:
            self._advance_drain(now)
            return None
        decision = decide(self.signals(now), self.shape(), self.knobs, self.history, self.spec, now)
        self.history, self.last = decision.history, decision
        # Actions always; a hold when its kind changes (its figures aside), else at debug level.
        kind = re.sub(r"[\d.]+", "#", decision.reason)
        level = logging.INFO if decision.action != "hold" or kind != self._last_reason else logging.DEBUG
        logger.log(level, "controller: %s — %s%s", decision.action, decision.reason,
                   "" if decision.act or decision.action == "hold" else " (not acted on: advisory or frozen)")
        self._last_reason = kind
        if decision.act:
            self._carry_out(decision, now)
        return decision

    def signals(self, now: float) -> Signals:
        def windows(seconds: float) -> dict:
            return {cls: self.snapshots.window(cls, seconds, now, self.spec.slo.get(cls) or {},
                                               min_samples=self.spec.min_samples, stale_s=self.spec.stale_s)
                    for cls in CLASSES}

        return Signals(windows(self.spec.fast_window_s), windows(self.spec.slow_window_s))

    def shape(self) -> Shape:
        interactive = sum(r.role == "interactive" for r in self.replicas)
        return Shape(len(self.replicas) - interactive, interactive)

    def routes(self) -> dict[str, list[str]]:
        """Interactive goes to every replica; batch and background to colocated ones not draining."""
        draining = self.drain.replica if self.drain else None
        return {"interactive": [r.url for r in self.replicas],
                "batch": [r.url for r in self.replicas if r.role == "colocated" and r is not draining]}

    def status(self) -> dict:
        """What ``cadenza up`` writes to its state file: shape, knobs, latency, memory."""
        doc = {"shape": {r.name: r.role for r in self.replicas}, "knobs": dict(self.knobs),
               "controller": self.history.to_status()}
        if self.last is not None:
            doc["lastDecision"] = {"action": self.last.action, "reason": self.last.reason, "acted": self.last.act}
            doc["sloMet"] = dict(self.last.slo_met)
        if self.drain is not None:
            doc["draining"] = self.drain.replica.name
        return doc

    # -- actuation ---------------------------------------------------------------------------

    def _settings(self, replica: Replica) -> dict:
        if replica.role == "interactive":
            return live_document(self.pool.role_settings("interactive").engine)
        doc = live_document(self.pool.spec.get("engine") or {})
        doc.update({k: v for k, v in self.knobs.items() if v is not None or k != "step_time_target_ms"})
        return doc

    def _apply(self, replica: Replica) -> bool:
        try:
            self.admin.put_config(replica.url, self._settings(replica))
            return True
        except (OSError, ValueError) as exc:
            logger.warning("controller: %s did not take its %s settings: %s", replica.name, replica.role, exc)
            return False

    def _reconcile_settings(self) -> None:
        for replica in self.replicas:
            want = self._settings(replica)
            try:
                have = self.admin.get_json(f"{replica.url}/admin/config", auth=True)
            except (OSError, ValueError):
                continue  # not up (restarting): reconciled at a later tick
            if any(have.get(k) != want.get(k) for k in LIVE_KNOBS if k in want):
                logger.info("controller: %s runs other settings than its role %s: applying", replica.name, replica.role)
                self._apply(replica)

    def _carry_out(self, decision: Decision, now: float) -> None:
        if decision.action == "retune":
            self.knobs.update(decision.knobs)
            for replica in self.replicas:
                if replica.role == "colocated":
                    self._apply(replica)
        elif decision.move == DEDICATE:
            replica = next(r for r in reversed(self.replicas) if r.role == "colocated")
            self.drain = _Drain(replica, now)
            self.route(self.routes())
            logger.info("controller: %s out of the batch routing; draining its batch work", replica.name)
            self._advance_drain(now)
        else:
            replica = next(r for r in reversed(self.replicas) if r.role == "interactive")
            replica.role = "colocated"
            self._apply(replica)
            self.route(self.routes())
            logger.info("controller: %s back to colocated", replica.name)

    def _advance_drain(self, now: float) -> None:
        replica = self.drain.replica
        try:
            stats = self.admin.get_json(f"{replica.url}/ready")
            busy = sum(stats["classes"][c]["running"] + stats["classes"][c]["waiting"] for c in ("batch", "background"))
        except (OSError, ValueError, KeyError):
            busy = None
        if busy == 0:
            replica.role = "interactive"
            self.drain = None
            self._apply(replica)
            logger.info("controller: %s drained; serving interactive only", replica.name)
        elif (waited := now - self.drain.since) > self.drain_timeout_s:
            self.drain = None
            self.route(self.routes())
            logger.warning("controller: %s still had batch work after %.0f s: it stays colocated", replica.name, waited)
