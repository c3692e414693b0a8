"""Converge the cluster on a ServingPool's spec: the kopf handler for create / update / resume,
and :func:`converge`, which the resync loop runs too.

A pass validates the pool (as the API server would, plus what only the engine knows), renders
it, applies every object idempotently, retires the Deployments of roles the mode no longer runs
(once the new roles are ready) and reports status (:func:`~.status.build_status`) with an Event
for each change. The handlers of one pool never run at the same time (its
:class:`~.memo.PoolState` lock): a resync holding the old spec cannot undo what an update
handler just applied. No finalizer: the children carry owner references, so the garbage
collector deletes them with the pool, and a pool (or the CRD) can be deleted while no operator
runs.

An invalid spec is a ``Degraded`` condition and a Warning event, then ``kopf.PermanentError``: no
crash loop, no retries until the spec changes. A transient API failure is a
``kopf.TemporaryError`` retried with exponential backoff (10 s doubling to 5 min). An object the
API refuses (RBAC, an admission policy, a quota) is a ``Degraded`` condition and a Warning event
too, retried slowly: the fix usually lies outside the pool.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Any

import kopf

from cadenza.operator import kube, render, ssa
from cadenza.operator.children import PLURAL
from cadenza.operator.memo import Operator, admin_token, pool_uid
from cadenza.operator.observe import Observed, observe
from cadenza.operator.pool_spec import read_pool
from cadenza.operator.report import event
from cadenza.operator.status import build_status, invalid_status, previous_condition
from cadenza.pool.spec import Pool, PoolSpecError, Role
from cadenza.pool.validate import PoolValidationError

RETRY_DELAY_S = 10  # the first retry after a transient API failure; doubles each time
MAX_RETRY_DELAY_S = 300
REFUSED_RETRY_DELAY_S = 60


def retry_delay(retry: int) -> float:
    """Seconds before retry number ``retry`` + 1 (kopf counts from 0): 10, 20, 40 ... up to 300."""
    return float(min(MAX_RETRY_DELAY_S, RETRY_DELAY_S * 2 ** min(retry, 10)))


def utc_now() -> datetime.datetime:
    """The time a pass reports with (the handlers' clock; :mod:`.status` has none of its own)."""
    return datetime.datetime.now(datetime.timezone.utc)


@kopf.on.resume(render.GROUP, render.VERSION, PLURAL)
@kopf.on.create(render.GROUP, render.VERSION, PLURAL)
@kopf.on.update(render.GROUP, render.VERSION, PLURAL)
def reconcile(body: kopf.Body, meta: kopf.Meta, patch: kopf.Patch, logger: logging.Logger, memo: kopf.Memo,
              retry: int = 0, **_: Any) -> None:
    """Converge the cluster on the pool's spec (idempotent: a second run changes nothing).

    ``memo.operator`` is the running :class:`~.memo.Operator`.
    """
    op: Operator = memo.operator
    pool_state = op.state(pool_uid(meta))
    pool_state.reconciled = True
    now, previous = utc_now(), body.get("status") or {}
    try:
        pool = read_pool(body)
        roles = pool.roles()
    except (PoolValidationError, PoolSpecError) as exc:
        message = str(exc)
        patch.status.update(invalid_status(message, previous=previous, now=now, generation=meta.get("generation")))
        kopf.warn(body, reason="InvalidSpec", message=message[:1000])
        raise kopf.PermanentError(f"invalid ServingPool: {message}") from None
    try:
        with pool_state.lock:
            converge(op, body, pool, roles, observe(pool, roles, op.children), patch, logger, now)
    except kube.Transient as exc:
        raise kopf.TemporaryError(str(exc), delay=retry_delay(retry)) from exc
    except kube.Refused as exc:
        message = str(exc)
        patch.status.update(invalid_status(message, previous=previous, now=now, generation=meta.get("generation"),
                                           reason="ApplyRefused"))
        kopf.warn(body, reason="ApplyRefused", message=message[:1000])
        raise kopf.TemporaryError(message, delay=REFUSED_RETRY_DELAY_S) from None


def converge(op: Operator, body: kopf.Body, pool: Pool, roles: Sequence[Role], observed: Observed,
             patch: kopf.Patch, logger: logging.Logger | logging.LoggerAdapter, now: datetime.datetime) -> None:
    """Apply every object, retire the Deployments of roles the mode no longer runs, report status
    (into ``patch``, from ``observed``: this pass's one read of the pool, taken before).

    It also deletes every PodDisruptionBudget the pool no longer renders (a retiring role's
    aside), the KV NetworkPolicy once no running or retiring role listens for KV, and a removed
    autoscaler: free under kopf, where a name the watch has not seen costs no call; a read per
    name otherwise.

    A mode shift is make-before-break: while an old role's Deployment still exists and a new
    role is not ready, the class Services keep selecting every engine pod (old and new) and the
    old Deployment keeps serving — held to what was applied: a hand edit to it is set back when
    the spec still renders it as before (:func:`render.render_retiring`) —; once every new role
    is ready the selectors narrow and the old Deployment is deleted (by this call or a later
    resync).

    Raises:
        kube.Transient, kube.Refused: as :func:`ssa.apply`.
    """
    meta, children = body.metadata, op.children
    if render.needs_admin_token(pool):
        admin_token(op.state(pool_uid(meta)), meta, pool)  # before the pods that mount it
    retiring = [name for name in render.stale_deployments(pool, roles) if observed.deployment(name) is not None]
    waiting = [role.name for role in roles if not observed.role_ready(pool, role)] if retiring else []
    kept = tuple(name.removeprefix(f"{pool.name}-") for name in retiring) if waiting else ()
    owner = {"name": meta["name"], "uid": meta["uid"]}
    objects = render.render_all(pool, owner=owner, narrow=not waiting, retiring=kept)
    # The old roles serve until the new are ready: held to what was applied, never rolled mid-shift.
    objects += [obj for obj in render.render_retiring(pool, kept, owner)
                if ssa.rendered_as(children.live(obj["kind"], pool.namespace, obj["metadata"]["name"]), obj)]
    conflicts = []
    for obj in objects:
        try:
            outcome = children.apply(obj)
        except ssa.Conflict as exc:  # someone else's object under a child's name: left alone, reported
            conflicts.append(str(exc))
            continue
        if outcome != "unchanged":
            logger.info("%s %s %s", outcome, obj["kind"], obj["metadata"]["name"])
            event(body, "Normal", outcome.capitalize(), f"{obj['kind']} {obj['metadata']['name']}")
    if not waiting:
        for name in retiring:
            if children.delete("Deployment", pool.namespace, name, meta.get("uid")):
                logger.info("deleted Deployment %s (mode %s)", name, pool.mode)
                event(body, "Normal", "Deleted", f"Deployment {name}: role not run in mode {pool.mode}")
        stale = [("PodDisruptionBudget", n) for n in retiring] + [("Service", n) for n in render.stale_services(pool)]
        for kind, name in stale:
            if children.delete(kind, pool.namespace, name, meta.get("uid")):
                logger.info("deleted %s %s (mode %s)", kind, name, pool.mode)
        retiring = []
    kept_pdbs = {f"{pool.name}-{role}" for role in kept}
    stale = [("PodDisruptionBudget", name) for name in render.stale_pdbs(pool, roles) if name not in kept_pdbs]
    stale += [("NetworkPolicy", name) for name in render.stale_network_policies(pool, [*(r.name for r in roles), *kept])]
    if not pool.spec.get("autoscaling"):  # autoscaling removed: the scaler goes, replicas are the spec's again
        stale.append(("HorizontalPodAutoscaler", pool.name))
    for kind, name in stale:
        if children.delete(kind, pool.namespace, name, meta.get("uid")):
            logger.info("deleted %s %s", kind, name)
    previous = body.get("status") or {}
    patch.status.update(build_status(pool, roles, observed, previous, now, generation=meta.get("generation"),
                                     shift=(waiting, retiring), conflicts=conflicts))
    message = "; ".join(conflicts)[:1000]
    if conflicts and message != (previous_condition(previous, "Degraded") or {}).get("message"):
        event(body, "Warning", "Conflict", message)  # once per change, not every resync
