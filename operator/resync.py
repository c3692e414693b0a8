"""The resync loop: every ``RESYNC_S``, one pass over each pool this operator reconciled.

A pass follows rollouts (replicas and conditions from the Deployments), finishes mode shifts
(make-before-break: the old role's Deployment is retired once the new roles are ready), repairs
drift (a child deleted or edited by hand is applied again) and, for a pool with SLOs, reads its
gateways' latency into ``status.latency``, the ``SLOMet`` condition and the controller's decision
— acted on for a ``mode: auto`` pool, advisory otherwise. It reads the children from kopf's
label-selected watches (indexes), not from the API, and patches status only where it changed: an
unchanged pool costs no API call.

One task for the whole operator, started by a start-up handler, not a per-pool timer: kopf gives
every object with a timer a finalizer, which would leave pools stuck terminating once the
operator is uninstalled.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
from typing import Any

import kopf

from cadenza.operator import kube, render, report
from cadenza.operator.children import CHILD_KINDS, PLURAL, Children
from cadenza.operator.converge import converge, utc_now
from cadenza.operator.memo import Operator, pool_uid
from cadenza.operator.observe import observe
from cadenza.operator.pool_spec import read_pool
from cadenza.operator.slo import read_slo
from cadenza.pool.spec import PoolSpecError
from cadenza.pool.validate import PoolValidationError

RESYNC_S = float(os.environ.get("CADENZA_OPERATOR_RESYNC_S", "15"))
RESYNC_CONCURRENCY = 8  # pools resynced at once (each blocks a thread on the API and on scrapes)
_log = logging.getLogger("cadenza.operator")


@kopf.on.startup()
async def start_resync(memo: kopf.Memo, **indices: Any) -> None:
    """Make the operator's state (:class:`~.memo.Operator`, ``memo.operator``, over kopf's
    indexes) and start its resync loop."""
    op = memo.operator = Operator(Children({kind: indices[f"children_{kind}"] for kind in CHILD_KINDS}),
                                  indices["pools"])
    op.resync_task = asyncio.get_running_loop().create_task(_resync_forever(op), name="cadenza resync")


@kopf.on.cleanup()
async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
    op: Operator | None = memo.get("operator")
    if op is not None and op.resync_task is not None:
        op.resync_task.cancel()


async def _resync_forever(op: Operator) -> None:
    """Every ``RESYNC_S``, :func:`resync_pool` each pool reconciled since start-up, a few at a time
    (in threads: the API client blocks); forget the pools that are gone."""
    loop, gate = asyncio.get_running_loop(), asyncio.Semaphore(RESYNC_CONCURRENCY)

    async def one(body: kopf.Body) -> None:
        async with gate:
            await loop.run_in_executor(None, contextvars.copy_context().run, resync_pool, op, body)

    while True:
        await asyncio.sleep(RESYNC_S)
        try:
            bodies = [body for store in list(op.pools.values()) for body in store]
            present = {pool_uid(body.metadata) for body in bodies}
            reconciled = op.reconciled()
            for uid in reconciled - present:
                op.forget(uid)
            await asyncio.gather(*(one(body) for body in bodies if pool_uid(body.metadata) in reconciled))
        except Exception:  # the loop outlives any one pass
            _log.exception("resync pass failed")


class _PoolLogger(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"{self.extra['pool']} {msg}", kwargs


def _latest(op: Operator, body: kopf.Body) -> kopf.Body | None:
    """The pool as the watch sees it now (a pass's copy can be older than an update a reconcile
    just applied); None when it is gone or being deleted (nothing to converge: its children go)."""
    meta = body.metadata
    if op.pools is not None:
        body = next((b for b in op.pools.get((meta.get("namespace"), meta.get("name"))) or ()
                     if pool_uid(b.metadata) == pool_uid(meta)), None)
    return None if body is None or body.metadata.get("deletionTimestamp") else body


def resync_pool(op: Operator, body: kopf.Body) -> None:
    """One resync of a pool: one read of it (:func:`~.observe.observe`, its SLO part included),
    then :func:`~.converge.converge` — follow rollouts, finish a mode shift whose new roles became
    ready, repair drift — and its status patched only where it changed, so an unchanged pool
    costs no API call. Never raises: a failure is logged and retried at the next resync."""
    meta, patch = body.metadata, kopf.Patch()
    logger = _PoolLogger(_log, {"pool": f"[{meta.get('namespace')}/{meta.get('name')}]"})
    pool_state = op.state(pool_uid(meta))
    try:
        with pool_state.lock:
            body = _latest(op, body)  # under the lock: no reconcile of a newer spec is half done
            if body is None:
                return
            pool = read_pool(body)
            roles = pool.roles()
            observed = observe(pool, roles, op.children, slo=functools.partial(read_slo, pool_state, body, pool, logger))
            converge(op, body, pool, roles, observed, patch, logger, utc_now())
            status = patch.get("status")
            if status and not report.patch_is_noop(body.get("status") or {}, status):
                report.patch_status(render.GROUP, render.VERSION, PLURAL, pool.namespace, pool.name, status)
    except (PoolValidationError, PoolSpecError, kube.Refused):
        return  # reported by reconcile (which retries a refusal); nothing to follow
    except kube.Transient as exc:
        logger.warning("resync: %s (retried at the next resync)", exc)
    except Exception:  # never the loop's end, whatever one pool does
        logger.exception("resync failed")
