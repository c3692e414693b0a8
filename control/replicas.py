"""A pool's replicas as the in-place actuation sees them, how it reaches them, and what it stores.

- :class:`Replica`: one engine replica, whether it answers, and the gateway routes it is in;
- :class:`Backend`: the protocol of the pool's world — pods with labels in a cluster
  (:mod:`cadenza.operator.k8s_roles`), processes behind a gateway config file under ``cadenza up``
  (:mod:`cadenza.local.actuation`);
- :class:`AdminClient`: each replica's ``GET/PUT /admin/config`` and ``GET /ready``, with the pool's token;
- :class:`State`: what must outlive the process besides the controller's history (the colocated
  knobs, each replica's role, a move in progress, the last retune and shift), as stored in
  ``status.controller`` and read back by a restarted process.
"""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from cadenza.control.history import DEDICATE, SPLITS
from cadenza.control.roles import ROLES, Drain
from cadenza.pool.live_knobs import KNOBS

LIVE_KNOBS = tuple(KNOBS.values())  # the knobs rung 1 moves, by their admin API names


@dataclass
class Replica:
    """One engine replica as the in-place actuation sees it.

    Attributes:
        name: pod or process name. url: its HTTP root. ready: answering (pod Ready).
        routes: the gateway routes it is in now, of ``interactive``, ``batch`` (background goes
            with batch) and ``prefill`` (:data:`cadenza.control.roles.ROUTES`).
    """

    name: str
    url: str
    ready: bool = True
    routes: frozenset[str] = frozenset()


class Backend(Protocol):
    """How :class:`~cadenza.control.in_place.InPlace` reaches a pool's replicas and gateways."""

    def replicas(self) -> list[Replica]:
        """The pool's engine replicas now."""

    def scrape(self) -> dict[str, str] | None:
        """``/metrics`` of every reachable gateway and engine of the pool, by pod or process name;
        None when no gateway answered."""

    def route(self, replica: Replica, role: str, routes: frozenset[str]) -> None:
        """Make the gateways send ``replica`` the traffic of exactly ``routes`` (a subset of
        ``interactive``, ``batch``, ``prefill``), recording ``role``; ``replica.routes`` follows."""


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
    replica's role (of :data:`~cadenza.control.roles.ROLES`), a move in progress (:class:`Drain`)
    and the last retune and shift."""

    knobs: dict[str, Any] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    draining: Drain | None = None
    last_retune: dict[str, Any] | None = None  # time, from, to, reason, signals
    last_shift: dict[str, Any] | None = None  # time, move, from, to (replicas per role), reason, signals

    def to_status(self) -> dict[str, Any]:
        doc = {"knobs": dict(self.knobs), "roles": dict(self.roles)}
        if self.draining:
            doc["draining"] = self.draining.to_status()
        for key, value in (("lastRetuneDetail", self.last_retune), ("lastShiftDetail", self.last_shift)):
            if value:
                doc[key] = value
        return doc

    @classmethod
    def from_status(cls, doc: Mapping[str, Any] | None, knobs: Mapping[str, Any]) -> State:
        """What a previous process stored in ``status.controller`` (``knobs``: the spec's, when
        none were stored); garbage fields are dropped. A drain stored without its move (before
        the prefill role existed) is a dedicate."""
        doc = doc if isinstance(doc, Mapping) else {}
        stored = doc.get("knobs") if isinstance(doc.get("knobs"), Mapping) else {}
        # A stored knob must be a usable number (or an unset step-time target); else the spec's.
        valid = {k: v for k in LIVE_KNOBS if k in stored and (
            (v := stored[k]) is None and k == "step_time_target_ms"
            or isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0)}
        roles_doc = doc.get("roles") if isinstance(doc.get("roles"), Mapping) else {}
        roles = {k: v for k, v in roles_doc.items() if isinstance(k, str) and v in ROLES}
        drain = doc.get("draining") if isinstance(doc.get("draining"), Mapping) else None
        draining = None
        since, move = (drain.get("since"), drain.get("move", DEDICATE)) if drain else (None, None)
        if (drain and isinstance(drain.get("replica"), str) and isinstance(since, int | float)
                and not isinstance(since, bool) and math.isfinite(since) and move in SPLITS):
            draining = Drain(drain["replica"], float(since), move)
        details = [d if isinstance(d := doc.get(k), Mapping) else None for k in ("lastRetuneDetail", "lastShiftDetail")]
        return cls({**knobs, **valid}, roles, draining, *details)
