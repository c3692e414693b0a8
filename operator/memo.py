"""What the operator keeps in memory while it runs, in kopf's operator-level ``memo``.

One :class:`Operator` per run of the operator (made by the start-up handler, ``memo.operator``;
kopf hands every resource handler a shallow copy of that memo, so they share it): kopf's indexes
of the pools and their children, the resync task, and a :class:`PoolState` per pool. An operator
started again (in the same process or not) starts from nothing: the pools' Secrets are read anew,
and each controller loop is rebuilt from ``status.controller``.

Source: kopf's in-memory containers, https://docs.kopf.dev/en/stable/memos/
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cadenza.control.loop import ControlLoop
from cadenza.operator import kube, render
from cadenza.operator.children import Children
from cadenza.pool.spec import Pool


def pool_uid(meta: Mapping[str, Any]) -> str:
    """The key of a pool's state: its uid, else ``namespace/name``."""
    return meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"


@dataclass(eq=False)
class PoolState:
    """One pool's memory: the lock its handlers take (a resync holding the old spec cannot undo
    what an update just applied), whether this operator reconciled it (the resync loop follows
    only those), its admin token (the Secret is read once), and its control loop: in place over
    the pods of a ``mode: auto`` pool, advice only for a pool of fixed shape with ``spec.slo``
    (its windows are what the loop read so far)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    reconciled: bool = False
    admin_token: str | None = None
    control: ControlLoop | None = None

    def forget(self) -> None:
        """Drop what is remembered of a pool that is gone; the lock stays (a handler may hold it yet)."""
        self.reconciled, self.admin_token, self.control = False, None, None


class Operator:
    """The operator's state for one run.

    Attributes:
        children: the pools' children (:class:`Children`; no indexes when not watching).
        pools: kopf's index of every pool, ``(namespace, name) -> [body]``; None when not watching.
        resync_task: the resync loop, once started.
    """

    def __init__(self, children: Children | None = None, pools: Any = None) -> None:
        self.children = children or Children()
        self.pools = pools
        self.resync_task: asyncio.Task | None = None
        self._states: dict[str, PoolState] = {}
        self._guard = threading.Lock()  # handlers run in threads

    def state(self, uid: str) -> PoolState:
        """The state of the pool ``uid`` (:func:`pool_uid`), made on first use."""
        with self._guard:
            if uid not in self._states:
                self._states[uid] = PoolState()
            return self._states[uid]

    def reconciled(self) -> set[str]:
        """The pools reconciled by this operator (the resync loop follows those)."""
        with self._guard:
            return {uid for uid, state in self._states.items() if state.reconciled}

    def forget(self, uid: str) -> None:
        """Drop what is kept of a pool that is gone (its children go with it: owner references
        let the garbage collector delete them)."""
        with self._guard:
            state = self._states.get(uid)
        if state is not None:
            state.forget()


def admin_token(pool_state: PoolState, meta: Mapping[str, Any], pool: Pool) -> str:
    """The pool's admin token: its Secret read (or created) once, then remembered (replicas read
    it at start-up, so it is never rewritten)."""
    if pool_state.admin_token is None:
        owner = {"name": meta["name"], "uid": meta["uid"]} if meta.get("uid") else None
        pool_state.admin_token = kube.ensure_secret_token(render.admin_secret_meta(pool, owner), secrets.token_hex(16))
    return pool_state.admin_token
