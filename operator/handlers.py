"""kopf handlers for ServingPool: thin, each one calling the pure renderers and :mod:`.kube`.

- create / update / resume: validate (as the API server would, plus what only the engine knows),
  render, apply every object idempotently, retire the Deployments of roles the mode no longer runs
  (once the new roles are ready), and report status (``observedGeneration``, ``mode``, replicas per role, ``Ready`` /
  ``Progressing`` / ``Degraded`` conditions) with an Event for each change;
- a resync loop (every ``RESYNC_S``, one task for the whole operator) refreshes status as
  rollouts progress, finishes mode shifts (make-before-break: the old role's Deployment is
  retired once the new roles are ready), repairs drift (a child deleted or edited by hand is
  applied again) and, for a pool with SLOs, scrapes its gateways' latency histograms into
  ``status.latency``, the ``SLOMet`` condition and the controller's advisory decision
  (:mod:`.observe`). It reads the children from kopf's label-selected watches (indexes), not
  from the API, and patches status only where it changed: an unchanged pool costs no API call;
- the handlers of one pool never run at the same time (a lock per pool): a resync holding the
  old spec cannot undo what an update handler just applied;
- no finalizer: the children carry owner references, so the garbage collector deletes them with
  the pool, and a pool (or the CRD) can be deleted while no operator runs.

An invalid spec is a ``Degraded`` condition and a Warning event, then ``kopf.PermanentError``: no
crash loop, no retries until the spec changes. A transient API failure is a
``kopf.TemporaryError`` retried with exponential backoff (10 s doubling to 5 min). An object the
API refuses (RBAC, an admission policy, a quota) is a ``Degraded`` condition and a Warning event
too, retried slowly: the fix usually lies outside the pool.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import datetime
import functools
import json
import logging
import os
import secrets
import threading
from collections import defaultdict
from typing import Any

import kopf
import kubernetes
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from cadenza.node.otel import make_resource, otlp_enabled

from cadenza.operator import kube, render
from cadenza.control.advisory import advisory_loop
from cadenza.control.in_place import AdminClient, follow, in_place_loop
from cadenza.control.loop import ControlLoop
from cadenza.control.status import slo_status
from cadenza.operator.k8s_roles import PodBackend, scrape_pool
from cadenza.operator import workload_status
from cadenza.operator.observe import disaggregation_status
from cadenza.pool.spec import Pool, PoolSpecError
from cadenza.pool.validate import PoolValidationError, validate_pool

GROUP, VERSION, PLURAL = render.GROUP, render.VERSION, "servingpools"
RETRY_DELAY_S = 10  # the first retry after a transient API failure; doubles each time
MAX_RETRY_DELAY_S = 300
REFUSED_RETRY_DELAY_S = 60
RESYNC_S = float(os.environ.get("CADENZA_OPERATOR_RESYNC_S", "15"))
RESYNC_CONCURRENCY = 8  # pools resynced at once (each blocks a thread on the API and on scrapes)
_tokens: dict[str, str] = {}  # pool uid -> its admin token (the Secret is read once)
_actuators: dict[str, ControlLoop] = {}  # pool uid -> the controller loop of a mode auto pool (in place)
_locks: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)  # pool uid -> its handlers' lock
_observer: dict[str, ControlLoop] = {}  # pool uid -> the advisory loop of a fixed-mode pool with SLOs


def retry_delay(retry: int) -> float:
    """Seconds before retry number ``retry`` + 1 (kopf counts from 0): 10, 20, 40 ... up to 300."""
    return float(min(MAX_RETRY_DELAY_S, RETRY_DELAY_S * 2 ** min(retry, 10)))
_SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


@kopf.on.login()
def login(**kwargs: Any):
    """In a pod: the service account; elsewhere: ``$KUBECONFIG`` read now (the ``kubernetes``
    package reads it at import time, which may be before it was set)."""
    if os.path.exists(_SA_TOKEN):
        return kopf.login_with_service_account(**kwargs)
    return kopf.login_with_kubeconfig(**kwargs)


def credentials_problem() -> str | None:
    """Why the operator could not reach a cluster (no service account, no usable kubeconfig), or None.

    Checked before kopf starts, which would otherwise retry its login forever.
    """
    if os.path.exists(_SA_TOKEN):
        return None
    try:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    except (kubernetes.config.ConfigException, OSError, TypeError, ValueError) as exc:
        where = os.environ.get("KUBECONFIG") or "~/.kube/config"
        return (f"no cluster credentials: not in a pod with a service account, and the kubeconfig "
                f"({where}) cannot be used: {exc}")
    return None


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    if os.path.exists(_SA_TOKEN):
        kubernetes.config.load_incluster_config()
    else:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    kube.connect()  # one client, one connection pool, for every call from here on
    # No handler needs a finalizer (owner references garbage-collect the children); naming the
    # one earlier operators added lets kopf remove it from the pools that still carry it.
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.watching.reconnect_backoff = 1.0
    for resource in CHILD_KINDS.values():  # the API server sends only the pools' children, not the cluster's
        settings.watching.label_selectors[resource] = ",".join(f"{k}={v}" for k, v in _MANAGED.items())
    settings.posting.level = logging.INFO
    settings.posting.enabled = _events_enabled()
    _tracing()


def _tracing() -> None:
    """A span per controller evaluation that acted, exported over OTLP when the standard ``OTEL_*``
    variables ask for it (service ``cadenza-operator`` unless ``OTEL_SERVICE_NAME`` says otherwise)."""
    if not otlp_enabled("traces") or isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    resource = make_resource().merge(Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                                                     "cadenza-operator")}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def _pool(body: kopf.Body) -> Pool:
    """Validate the pool as the API server would (defaults included) and read it.

    Raises:
        PoolValidationError, PoolSpecError: the spec cannot run.
    """
    spec = _validated(body.get("apiVersion"), body.get("kind"), body.metadata.name, body.metadata.namespace,
                      json.dumps(dict(body.spec), sort_keys=True))
    return Pool(body.metadata.name, body.metadata.namespace, copy.deepcopy(spec))


@functools.lru_cache(maxsize=1024)
def _validated(api_version: str, kind: str, name: str, namespace: str, spec: str) -> dict:
    """The defaulted spec of a valid pool, once per distinct spec (validation costs tens of
    milliseconds, and the resync reads every pool every ``RESYNC_S``)."""
    obj = validate_pool({"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": namespace},
                         "spec": json.loads(spec)})
    render.render_all(Pool(name, namespace, obj["spec"]))  # engine-level checks; pod settings clashing with ours
    return obj["spec"]


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(body: kopf.Body, meta: kopf.Meta, patch: kopf.Patch, logger: logging.Logger, retry: int = 0,
              **_: Any) -> None:
    """Converge the cluster on the pool's spec (idempotent: a second run changes nothing)."""
    _reconciled.add(_uid(meta))
    try:
        pool = _pool(body)
        roles = pool.roles()
    except (PoolValidationError, PoolSpecError) as exc:
        message = str(exc)
        patch.status.update(_status_invalid(body, message))
        kopf.warn(body, reason="InvalidSpec", message=message[:1000])
        raise kopf.PermanentError(f"invalid ServingPool: {message}") from None
    try:
        with _locks[_uid(meta)]:
            _converge(body, meta, pool, roles, patch, logger)
    except kube.Transient as exc:
        raise kopf.TemporaryError(str(exc), delay=retry_delay(retry)) from exc
    except kube.Refused as exc:
        message = str(exc)
        patch.status.update(_status_invalid(body, message, reason="ApplyRefused"))
        kopf.warn(body, reason="ApplyRefused", message=message[:1000])
        raise kopf.TemporaryError(message, delay=REFUSED_RETRY_DELAY_S) from None


def _uid(meta: kopf.Meta) -> str:
    return meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"


def _observe(body: kopf.Body, meta: kopf.Meta, pool: Pool) -> dict:
    """A pool that is not ``auto``: its gateways' latency and the controller's advice, recorded."""
    uid = _uid(meta)
    loop = _observer[uid] = advisory_loop(_observer.get(uid), pool.spec, lambda: scrape_pool(pool),
                                          body.get("status", {}).get("controller"))
    loop.tick()
    return slo_status(loop)


def _admin_token(meta: kopf.Meta, pool: Pool) -> str:
    """The pool's admin token: its Secret read (or created) once, then remembered (replicas read
    it at start-up, so it is never rewritten)."""
    uid = _uid(meta)
    if uid not in _tokens:
        owner = {"name": meta["name"], "uid": meta["uid"]} if meta.get("uid") else None
        _tokens[uid] = kube.ensure_secret_token(render.admin_secret_meta(pool, owner), secrets.token_hex(16))
    return _tokens[uid]


def _control(body: kopf.Body, meta: kopf.Meta, pool: Pool, logger: logging.Logger) -> dict:
    """One tick of a ``mode: auto`` pool's controller (:mod:`cadenza.control.in_place` over its pods);
    the status fields it reports, from the signals that tick read. The loop's state is read back from
    ``status.controller`` when this operator has none (it restarted), so the shape, knobs, cooldown
    and a drain in progress carry over."""
    uid = _uid(meta)
    loop = _actuators.get(uid)
    if loop is None:
        loop = _actuators[uid] = in_place_loop(pool, PodBackend(pool), AdminClient(_admin_token(meta, pool)),
                                               body.get("status", {}).get("controller"))
    else:
        follow(loop, pool)
    try:
        decision = loop.tick()
    except (kube.Transient, kube.Refused) as exc:
        logger.warning("controller: %s", exc)
        decision = None
    if decision is not None and decision.act:
        _event(body, "Normal", decision.action.capitalize(), decision.reason[:1000])
    actuation = loop.actuation
    shape = actuation.last_shape if decision is not None else None
    out = {**slo_status(loop), "flapping": bool(loop.last and loop.last.flapping)}
    for key, detail in (("lastRetune", actuation.state.last_retune), ("lastShift", actuation.state.last_shift)):
        if detail:
            out[key] = detail
    if shape is not None:
        out["shape"] = {"colocated": shape.colocated, "interactive": shape.interactive}
    return out


def _converge(body: kopf.Body, meta: kopf.Meta, pool: Pool, roles, patch: kopf.Patch,
              logger: logging.Logger, slo: dict | None = None) -> None:
    """Apply every object, retire the Deployments of roles the mode no longer runs, report status.

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
        kube.Transient, kube.Refused: as :func:`kube.apply`.
    """
    if render.needs_admin_token(pool):
        _admin_token(meta, pool)  # before the pods that mount it
    retiring = [name for name in render.stale_deployments(pool, roles) if _deployment(pool, name) is not None]
    waiting = [role.name for role in roles if not _role_ready(pool, role)] if retiring else []
    kept = tuple(name.removeprefix(f"{pool.name}-") for name in retiring) if waiting else ()
    owner = {"name": meta["name"], "uid": meta["uid"]}
    objects = render.render_all(pool, owner=owner, narrow=not waiting, retiring=kept)
    # The old roles serve until the new are ready: held to what was applied, never rolled mid-shift.
    objects += [obj for obj in render.render_retiring(pool, kept, owner)
                if kube.rendered_as(_live(obj["kind"], pool.namespace, obj["metadata"]["name"]), obj)]
    conflicts = []
    for obj in objects:
        try:
            outcome = _apply(obj)
        except kube.Conflict as exc:  # someone else's object under a child's name: left alone, reported
            conflicts.append(str(exc))
            continue
        if outcome != "unchanged":
            logger.info("%s %s %s", outcome, obj["kind"], obj["metadata"]["name"])
            _event(body, "Normal", outcome.capitalize(), f"{obj['kind']} {obj['metadata']['name']}")
    if not waiting:
        for name in retiring:
            if _delete("Deployment", pool, name, meta.get("uid")):
                logger.info("deleted Deployment %s (mode %s)", name, pool.mode)
                _event(body, "Normal", "Deleted", f"Deployment {name}: role not run in mode {pool.mode}")
        stale = [("PodDisruptionBudget", n) for n in retiring] + [("Service", n) for n in render.stale_services(pool)]
        for kind, name in stale:
            if _delete(kind, pool, name, meta.get("uid")):
                logger.info("deleted %s %s (mode %s)", kind, name, pool.mode)
        retiring = []
    kept_pdbs = {f"{pool.name}-{role}" for role in kept}
    stale = [("PodDisruptionBudget", name) for name in render.stale_pdbs(pool, roles) if name not in kept_pdbs]
    stale += [("NetworkPolicy", name) for name in render.stale_network_policies(pool, [*(r.name for r in roles), *kept])]
    if not pool.spec.get("autoscaling"):  # autoscaling removed: the scaler goes, replicas are the spec's again
        stale.append(("HorizontalPodAutoscaler", pool.name))
    for kind, name in stale:
        if _delete(kind, pool, name, meta.get("uid")):
            logger.info("deleted %s %s", kind, name)
    patch.status.update(_status(body, pool, roles, shift=(waiting, retiring), slo=slo, conflicts=conflicts))
    message = "; ".join(conflicts)[:1000]
    if conflicts and message != _previous_message(body, "Degraded"):  # once per change, not every resync
        _event(body, "Warning", "Conflict", message)


def _role_ready(pool: Pool, role) -> bool:
    state = _deployment(pool, f"{pool.name}-{role.name}")
    return state is not None and min(state["readyReplicas"], state["updatedReplicas"]) >= role.replicas


# -- the children, as the operator's watches see them -------------------------------------------

# kind -> (kopf's resource selector) of every child kind the pool renders; kopf watches each,
# label-selected, into an in-memory index, so a resync reads no child from the API.
CHILD_KINDS = {
    "Deployment": ("apps", "v1", "deployments"), "Service": ("v1", "services"),
    "ConfigMap": ("v1", "configmaps"), "ServiceAccount": ("v1", "serviceaccounts"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
    "Role": ("rbac.authorization.k8s.io", "v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    "HorizontalPodAutoscaler": ("autoscaling", "v2", "horizontalpodautoscalers"),
    "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
}
_MANAGED = {"app.kubernetes.io/managed-by": "cadenza-operator"}
_children: dict[str, Any] = {}  # kind -> kopf.Index of (namespace, name) -> the object; empty: not watching


def _index_child(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): dict(body)}


for _kind, _resource in CHILD_KINDS.items():
    kopf.index(*_resource, id=f"children_{_kind}", labels=_MANAGED)(_index_child)


@kopf.index(GROUP, VERSION, PLURAL)
def pools(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    """Every ServingPool, for the resync loop."""
    return {(namespace, name): body}


def _live(kind: str, namespace: str, name: str) -> dict | None:
    """A child as the watch last saw it (None: no such child of a pool), or read from the API
    when the operator is not watching (a reconcile run outside ``kopf run``)."""
    index = _children.get(kind)
    if index is None:
        return kube.read(kind, name, namespace)
    return next(iter(index.get((namespace, name)) or ()), None)


def _apply(obj: dict) -> str:
    if not _children:
        return kube.apply(obj)
    meta = obj["metadata"]
    return kube.apply(obj, live=_live(obj["kind"], meta["namespace"], meta["name"]))


def _delete(kind: str, pool: Pool, name: str, owner_uid: str | None) -> bool:
    if not _children:
        return kube.delete(kind, name, pool.namespace, owner_uid)
    live = _live(kind, pool.namespace, name)
    return live is not None and kube.delete(kind, name, pool.namespace, owner_uid, live=live)


def _deployment(pool: Pool, name: str) -> dict | None:
    if not _children:
        return kube.deployment_status(name, pool.namespace)
    return kube.deployment_state(_live("Deployment", pool.namespace, name))


def _event(body: kopf.Body, kind: str, reason: str, message: str) -> None:
    """A Kubernetes Event on the pool: kopf's poster inside kopf's handlers, the API directly from
    the resync loop (kopf's poster belongs to its per-object tasks)."""
    try:
        (kopf.warn if kind == "Warning" else kopf.info)(body, reason=reason, message=message)
    except LookupError:
        if _events_enabled():
            kube.post_event(body, kind, reason, message)


def _events_enabled() -> bool:
    return os.environ.get("CADENZA_OPERATOR_EVENTS", "true").lower() != "false"


# -- the resync loop ------------------------------------------------------------------------------

_reconciled: set[str] = set()  # pools reconciled since this operator started (the indexes are full)
_resync_task: asyncio.Task | None = None
_pools: Any = None  # kopf's index of every pool, (namespace, name) -> body
_log = logging.getLogger("cadenza.operator")


@kopf.on.startup()
async def start_resync(**indices: Any) -> None:
    """Start the resync loop over kopf's indexes (an operator-level task, not a per-pool timer:
    kopf gives every object with a timer a finalizer, which would leave pools stuck terminating
    once the operator is uninstalled)."""
    global _resync_task, _pools
    _reconciled.clear()  # resynced again once reconciled by this operator: its indexes are full then
    _children.update({kind: indices[f"children_{kind}"] for kind in CHILD_KINDS})
    _pools = indices["pools"]
    _resync_task = asyncio.get_running_loop().create_task(_resync_forever(indices["pools"]), name="cadenza resync")


@kopf.on.cleanup()
async def stop_resync(**_: Any) -> None:
    global _pools
    if _resync_task is not None:
        _resync_task.cancel()
    _children.clear()
    _pools = None  # an operator started later in this process watches anew
    _tokens.clear()  # and reads each pool's admin Secret anew (it may be another cluster's pool)


async def _resync_forever(index: Any) -> None:
    """Every ``RESYNC_S``, :func:`resync` each pool reconciled since start-up, a few at a time (in
    threads: the API client blocks); forget the pools that are gone."""
    loop, gate = asyncio.get_running_loop(), asyncio.Semaphore(RESYNC_CONCURRENCY)

    async def one(body: kopf.Body) -> None:
        async with gate:
            await loop.run_in_executor(None, contextvars.copy_context().run, resync, body)

    while True:
        await asyncio.sleep(RESYNC_S)
        try:
            bodies = [body for store in list(index.values()) for body in store]
            present = {_uid(body.metadata) for body in bodies}
            for uid in set(_reconciled) - present:
                _forget(uid)
            await asyncio.gather(*(one(body) for body in bodies if _uid(body.metadata) in _reconciled))
        except Exception:  # the loop outlives any one pass
            _log.exception("resync pass failed")


def _forget(uid: str) -> None:
    """Drop what the operator keeps in memory for a pool that is gone (its children go with it:
    owner references let the garbage collector delete them)."""
    _reconciled.discard(uid)
    _observer.pop(uid, None)
    _actuators.pop(uid, None)
    _tokens.pop(uid, None)  # (its lock stays: a handler may hold it yet)


class _PoolLogger(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"{self.extra['pool']} {msg}", kwargs


def _latest(body: kopf.Body) -> kopf.Body | None:
    """The pool as the watch sees it now (a pass's copy can be older than an update a reconcile
    just applied); None when it is gone or being deleted (nothing to converge: its children go)."""
    meta = body.metadata
    if _pools is not None:
        body = next((b for b in _pools.get((meta.get("namespace"), meta.get("name"))) or ()
                     if _uid(b.metadata) == _uid(meta)), None)
    return None if body is None or body.metadata.get("deletionTimestamp") else body


def resync(body: kopf.Body) -> None:
    """One resync of a pool: follow rollouts (replicas and conditions from the Deployments),
    finish a mode shift whose new roles became ready, repair drift — a child deleted or edited
    by hand is applied again — and, for a pool with SLOs, read its latency and advance its
    controller. Status is patched only where it changed, so an unchanged pool costs no API call.
    Never raises: a failure is logged and retried at the next resync."""
    meta, patch = body.metadata, kopf.Patch()
    logger = _PoolLogger(_log, {"pool": f"[{meta.get('namespace')}/{meta.get('name')}]"})
    try:
        with _locks[_uid(meta)]:
            body = _latest(body)  # under the lock: no reconcile of a newer spec is half done
            if body is None:
                return
            meta, pool = body.metadata, _pool(body)
            if pool.mode == "auto":
                slo = _control(body, meta, pool, logger)
            else:
                slo = _observe(body, meta, pool) if pool.spec.get("slo") else None
            _converge(body, meta, pool, pool.roles(), patch, logger, slo)
            status = patch.get("status")
            if status and not kube.patch_is_noop(body.get("status") or {}, status):
                kube.patch_status(GROUP, VERSION, PLURAL, pool.namespace, pool.name, status)
    except (PoolValidationError, PoolSpecError, kube.Refused):
        return  # reported by reconcile (which retries a refusal); nothing to follow
    except kube.Transient as exc:
        logger.warning("resync: %s (retried at the next resync)", exc)
    except Exception:  # never the loop's end, whatever one pool does
        logger.exception("resync failed")


# -- status -------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _readiness(is_ready: bool, ready: int, desired: int, problems: list[tuple[str, str]]) -> tuple[str, str]:
    counts = f"{ready}/{desired} engine replicas ready"
    if ready == desired:
        return "AllReplicasReady", counts
    why = "; ".join(message for _reason, message in problems)
    if is_ready:
        return "Serving", f"{counts}; every role serves" + (f" ({why})" if why else "")
    return (problems[0][0] if problems else "ReplicasNotReady"), counts + (f": {why}" if why else "")


def _degraded(body: kopf.Body, problems: list[tuple[str, str]], conflicts) -> dict:
    stuck = [("Conflict", message) for message in conflicts]
    stuck += [(reason, message) for reason, message in problems if reason in workload_status.DEGRADING]
    if not stuck:
        return _condition(body, "Degraded", False, "AsExpected", "the spec is valid and applied")
    return _condition(body, "Degraded", True, stuck[0][0], "; ".join(m for _r, m in stuck)[:1000])


def _previous_message(body: kopf.Body, kind: str) -> str | None:
    return next((c.get("message") for c in body.get("status", {}).get("conditions", []) if c.get("type") == kind), None)


def _condition(body: kopf.Body, kind: str, status: bool | str, reason: str, message: str) -> dict:
    """A condition, keeping ``lastTransitionTime`` unless its status flips (``status``: a bool, or
    ``"True"`` / ``"False"`` / ``"Unknown"``)."""
    value = status if isinstance(status, str) else ("True" if status else "False")
    previous = next((c for c in body.get("status", {}).get("conditions", []) if c.get("type") == kind), {})
    changed = previous.get("status") != value
    cond = {"type": kind, "status": value, "reason": reason, "message": message,
            "lastTransitionTime": _now() if changed else previous.get("lastTransitionTime", _now())}
    if body.metadata.get("generation") is not None:
        cond["observedGeneration"] = body.metadata["generation"]
    return cond


def _status(body: kopf.Body, pool: Pool, roles, shift: tuple[list[str], list[str]] = ([], []),
            slo: dict | None = None, conflicts: list[str] = ()) -> dict:
    """Status from the Deployments; ``shift``: (new roles not ready yet, old Deployments kept);
    ``slo``: what :mod:`.observe` read this time (else the last ``SLOMet`` condition is kept);
    ``conflicts``: objects left alone (:class:`kube.Conflict`), which make the pool degraded."""
    per_role, desired, ready, updated = {}, 0, 0, 0
    serving, unobserved, problems = True, False, []
    for role in roles:
        state = _deployment(pool, f"{pool.name}-{role.name}") or {}
        per_role[role.name] = {"replicas": role.replicas, "readyReplicas": state.get("readyReplicas", 0)}
        role_ready = min(state.get("readyReplicas", 0), role.replicas)
        desired += role.replicas
        ready += role_ready
        updated += min(state.get("updatedReplicas", 0), role.replicas)
        serving = serving and (role_ready > 0 or role.replicas == 0)
        unobserved = unobserved or not workload_status.observed(state)
        if state and role_ready < role.replicas:  # why: its pods first (one list, only while short)
            pods = kube.list_pods(pool.namespace, render.role_selector(pool, role.name))
            if found := workload_status.pod_problem(pods) or workload_status.deployment_problem(state):
                problems.append((found[0], f"{role.name}: {found[1]}"))
    waiting, retiring = shift
    is_ready = serving or bool(retiring)  # every role serves (in a shift, the old one until the new are ready)
    rolling = updated < desired or ready < desired or unobserved
    progress = ("RolloutInProgress" if rolling else "RolloutComplete",
                f"{updated}/{desired} replicas updated, {ready}/{desired} ready")
    if retiring:
        rolling = True
        progress = ("ModeShift", f"mode {pool.mode}: {', '.join(retiring)} serving until role(s) "
                                 f"{', '.join(waiting)} are ready; {ready}/{desired} ready")
    status = {
        "mode": pool.mode,
        "replicas": desired,
        "readyReplicas": ready,
        "ready": f"{ready}/{desired}",
        "selector": render.selector_string(pool),
        "roles": per_role,
        "conditions": [
            _condition(body, "Ready", is_ready, *_readiness(is_ready, ready, desired, problems)),
            _condition(body, "Progressing", rolling, *progress),
            _degraded(body, problems, conflicts),
        ],
    }
    if pool.mode == "disaggregated":
        pinned = pool.min_prompt_tokens
        status["disaggregated"] = disaggregation_status(pinned, None if pinned else scrape_pool(pool))
    elif body.get("status", {}).get("disaggregated"):
        status["disaggregated"] = None  # a merge patch removes a map by name
    previous = body.get("status", {})
    # A merge patch merges maps: a role the mode no longer runs must be removed by name.
    for stale in set(previous.get("roles") or {}) - set(per_role):
        per_role[stale] = None
    if slo is not None:
        status["latency"] = slo["latency"]
        status["controller"] = slo["controller"]
        for key in ("shape", "lastRetune", "lastShift"):
            if key in slo:
                status[key] = slo[key]
        if "flapping" in slo:
            status["conditions"].append(_condition(
                body, "Flapping", slo["flapping"], "ReshapingFrozen" if slo["flapping"] else "Stable",
                "two reversals inside the flap window: reshaping frozen, decisions advisory until it passes"
                if slo["flapping"] else "no reversal of direction inside the flap window"))
        status["conditions"].append(_condition(body, "SLOMet", *slo["sloMet"]))
    elif kept := next((c for c in previous.get("conditions", []) if c.get("type") == "SLOMet"), None):
        status["conditions"].append(dict(kept))
    if body.metadata.get("generation") is not None:
        status["observedGeneration"] = body.metadata["generation"]
    return status


def _status_invalid(body: kopf.Body, message: str, reason: str = "InvalidSpec") -> dict:
    """Conditions for a pool that cannot be rolled out (``InvalidSpec`` or ``ApplyRefused``)."""
    cause = "the spec cannot run" if reason == "InvalidSpec" else "the API refused an object"
    status = {"conditions": [
        _condition(body, "Ready", False, reason, cause),
        _condition(body, "Progressing", False, reason, f"nothing more is rolled out until it is fixed: {cause}"),
        _condition(body, "Degraded", True, reason, message[:1000]),
    ]}
    if body.metadata.get("generation") is not None:
        status["observedGeneration"] = body.metadata["generation"]
    return status
