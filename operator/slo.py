"""The SLO part of a pass over a pool: one tick of its control loop (:mod:`cadenza.control.loop`):
in place over its pods for a ``mode: auto`` pool (:func:`_control`), advice only for a pool of
fixed shape with ``spec.slo`` (:func:`_observe`).

Each returns the status fields :func:`~.status.build_status` reports (``latency``,
``controller``, ``sloMet`` ...), from the signals that tick read: the loop reads them once. What
they remember between passes (the token, the loop and its windows) is the pool's
:class:`~.memo.PoolState`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import kopf

from cadenza.control.advisory import Advisory, advisory_loop
from cadenza.control.decide import Decision, Shape
from cadenza.control.in_place import InPlace, follow, in_place_loop
from cadenza.control.roles import describe, shape_after, shape_doc
from cadenza.control.replicas import AdminClient
from cadenza.control.status import slo_status
from cadenza.operator import kube
from cadenza.operator.k8s_roles import PodBackend
from cadenza.operator.memo import PoolState, admin_token
from cadenza.operator.report import event as _event
from cadenza.pool.spec import Pool


def read_slo(pool_state: PoolState, body: kopf.Body, pool: Pool, logger: logging.Logger,
             scrape: Callable[[], Mapping[str, str] | None]) -> dict | None:
    """The SLO fields of one pass: the controller's tick of a ``mode: auto`` pool, the advice for
    a pool with ``spec.slo`` (from ``scrape``, the pass's one read of its ``/metrics``), else None."""
    if pool.mode == "auto":
        return _control(pool_state, body, body.metadata, pool, logger)
    if not pool.spec.get("slo"):
        pool_state.control = None  # no loop now: one started again starts from status.controller
        return None
    return _observe(pool_state, body, body.metadata, pool, scrape)


def _observe(pool_state: PoolState, body: kopf.Body, meta: kopf.Meta, pool: Pool,
             scrape: Callable[[], Mapping[str, str] | None]) -> dict:
    """A pool that is not ``auto``: its gateways' latency and the controller's advice, recorded."""
    previous = pool_state.control  # an auto pool's loop, when the mode just changed, is not advice's
    previous = previous if previous is not None and isinstance(previous.actuation, Advisory) else None
    loop = pool_state.control = advisory_loop(previous, pool.spec, scrape, body.get("status", {}).get("controller"))
    loop.tick()
    return slo_status(loop)


def _control(pool_state: PoolState, body: kopf.Body, meta: kopf.Meta, pool: Pool, logger: logging.Logger) -> dict:
    """One tick of a ``mode: auto`` pool's controller (:mod:`cadenza.control.in_place` over its pods);
    the status fields it reports, from the signals that tick read. The loop's state is read back from
    ``status.controller`` when this operator has none (it restarted), so the shape, knobs, cooldown
    and a drain in progress carry over."""
    loop = pool_state.control
    if loop is None or not isinstance(loop.actuation, InPlace):  # none yet, or the pool just became auto
        loop = pool_state.control = in_place_loop(pool, PodBackend(pool),
                                                  AdminClient(admin_token(pool_state, meta, pool)),
                                                  body.get("status", {}).get("controller"))
    else:
        follow(loop, pool)
    try:
        decision = loop.tick()
    except (kube.Transient, kube.Refused) as exc:
        logger.warning("controller: %s", exc)
        decision = None
    actuation = loop.actuation
    shape = actuation.last_shape if decision is not None else None
    if decision is not None and decision.act:
        _event(body, "Normal", decision.action.capitalize(), event_message(decision, shape))
    out = {**slo_status(loop), "flapping": bool(loop.last and loop.last.flapping)}
    for key, detail in (("lastRetune", actuation.state.last_retune), ("lastShift", actuation.state.last_shift)):
        if detail:
            out[key] = detail
    if shape is not None:
        out["shape"] = shape_doc(shape)
    return out


def event_message(decision: Decision, shape: Shape | None) -> str:
    """The Event of an action: its reason and, for a reshape, the shape before and after
    (``colocated: n, interactive: m, prefill: p -> ...``); at most 1,000 characters."""
    if decision.action == "reshape" and shape is not None:
        moved = f" (shape {describe(shape)} -> {describe(shape_after(shape, decision.move))})"
        return decision.reason[:1000 - len(moved)] + moved
    return decision.reason[:1000]
