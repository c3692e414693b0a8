"""The SLO part of a pass over a pool: a ``mode: auto`` pool's controller tick (:func:`_control`,
:class:`~cadenza.control.actuator.Actuator` over its pods), or, for a pool of fixed shape with
``spec.slo``, its gateways' latency and the controller's advice (:func:`_observe`); and the
pool's admin token, which the controller and the pods that mount it need (:func:`_admin_token`).

Each returns the status fields :func:`~.status.build_status` reports (``latency``,
``controller``, ``sloMet`` ...). What they remember between passes (the token, the controller
loop, the SLO windows) is the pool's :class:`~.memo.PoolState`.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping

import kopf

from cadenza.control.actuator import Actuator, AdminClient, State, spec_knobs
from cadenza.operator import kube, render
from cadenza.operator.k8s_roles import PodBackend
from cadenza.operator.memo import PoolState
from cadenza.operator.memo import pool_uid as _uid
from cadenza.operator.observe import latency_status, slo_condition
from cadenza.operator.report import event as _event
from cadenza.pool.spec import Pool


def read_slo(pool_state: PoolState, body: kopf.Body, pool: Pool, logger: logging.Logger,
             scrape: Callable[[], Mapping[str, str] | None]) -> dict | None:
    """The SLO fields of one pass: the controller's tick of a ``mode: auto`` pool, the advice for
    a pool with ``spec.slo`` (from ``scrape``, the pass's one read of its ``/metrics``), else None."""
    if pool.mode == "auto":
        return _control(pool_state, body, body.metadata, pool, logger)
    return _observe(pool_state, body, body.metadata, pool, scrape) if pool.spec.get("slo") else None


def _observe(pool_state: PoolState, body: kopf.Body, meta: kopf.Meta, pool: Pool,
             scrape: Callable[[], Mapping[str, str] | None]) -> dict:
    """A pool that is not ``auto``: its gateways' latency and the controller's advice, recorded."""
    return pool_state.observer.observe(_uid(meta), pool.spec, scrape, body.get("status", {}))


def _admin_token(pool_state: PoolState, meta: kopf.Meta, pool: Pool) -> str:
    """The pool's admin token: its Secret read (or created) once, then remembered (replicas read
    it at start-up, so it is never rewritten)."""
    if pool_state.admin_token is None:
        owner = {"name": meta["name"], "uid": meta["uid"]} if meta.get("uid") else None
        pool_state.admin_token = kube.ensure_secret_token(render.admin_secret_meta(pool, owner), secrets.token_hex(16))
    return pool_state.admin_token


def _control(pool_state: PoolState, body: kopf.Body, meta: kopf.Meta, pool: Pool, logger: logging.Logger) -> dict:
    """One tick of a ``mode: auto`` pool's controller (:mod:`.actuator` over its pods); the status
    fields it reports. The loop's state is read back from ``status.controller`` when this operator
    has none (it restarted), so the shape, knobs, cooldown and a drain in progress carry over."""
    actuator = pool_state.actuator
    if actuator is None:
        state = State.from_status(body.get("status", {}).get("controller"), spec_knobs(pool.spec))
        actuator = pool_state.actuator = Actuator(pool, PodBackend(pool),
                                                  AdminClient(_admin_token(pool_state, meta, pool)), state)
    else:
        actuator.update(pool)
    try:
        decision = actuator.tick()
    except (kube.Transient, kube.Refused) as exc:
        logger.warning("controller: %s", exc)
        decision = None
    if decision is not None and decision.act:
        _event(body, "Normal", decision.action.capitalize(), decision.reason[:1000])
    signals = actuator.signals(actuator.clock())
    shape = actuator.last_shape if decision is not None else None
    out = {"latency": latency_status(signals, actuator.spec), "controller": actuator.status(),
           "sloMet": slo_condition(signals, actuator.spec),
           "flapping": bool(actuator.last and actuator.last.flapping)}
    for key, detail in (("lastRetune", actuator.state.last_retune), ("lastShift", actuator.state.last_shift)):
        if detail:
            out[key] = detail
    if shape is not None:
        out["shape"] = {"colocated": shape.colocated, "interactive": shape.interactive}
    return out
