"""Idempotent apply and delete of the objects a pool renders, with the ``kubernetes`` client.

``apply`` is a three-way merge like ``kubectl apply``'s: the rendered object is stored, as JSON,
in an annotation on the object it creates. When the rendering is the stored one and the live
object still holds every field it sets (:func:`contains`), nothing is sent (no patch, no event,
no rollout). Otherwise — a new rendering, or drift: a hand edit to replicas, an image, a selector
or the ConfigMap — a JSON merge patch (RFC 7386) carries the whole new
rendering, with ``null`` for every field the last rendering set and this one drops — a selector
key, a resource limit, an annotation — so removed fields are removed, while fields other
controllers and the API server own (status, defaults, ``clusterIP``) are left alone. Lists are
replaced whole, as JSON merge patch does. A missing object is created; one the pool does not control is never touched (:class:`Conflict`).

Transient API failures (429, 5xx, 409 conflicts, connection errors) become :class:`Transient` so
the caller retries with backoff; anything else the API refuses is :class:`Refused`.
"""

from __future__ import annotations

import base64
import functools
import json
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.rest import ApiException

LAST_APPLIED = "serving.cadenza.dev/last-applied"
MERGE_PATCH = "application/merge-patch+json"


class Transient(Exception):
    """A failure worth retrying later (the API server was busy, unreachable, or raced us)."""


class Refused(Exception):
    """The API (or the client, checking the body) refused an object: retrying the same will not help
    until something changes (the spec, RBAC, an admission policy)."""


class Conflict(Refused):
    """An object with a child's name exists and the pool does not control it: it is left alone."""


def _controller(meta) -> tuple[str, str] | None:
    """``(kind/name, uid)`` of the controller owner reference of a client model's metadata, if any."""
    for ref in (getattr(meta, "owner_references", None) or []) if meta else []:
        if ref.controller:
            return f"{ref.kind}/{ref.name}", ref.uid
    return None


def _wanted_controller(obj: dict) -> str | None:
    return next((ref["uid"] for ref in obj["metadata"].get("ownerReferences", []) if ref.get("controller")), None)


@functools.cache
def _client() -> kubernetes.client.ApiClient:
    """For turning the client's models back into API dicts (no request is made)."""
    return kubernetes.client.ApiClient()


def _apis(kind: str):
    """The client calls for a kind: (read, create, patch, delete), each taking (name, namespace, ...)."""
    core, apps = kubernetes.client.CoreV1Api(), kubernetes.client.AppsV1Api()
    policy, rbac = kubernetes.client.PolicyV1Api(), kubernetes.client.RbacAuthorizationV1Api()
    autoscaling = kubernetes.client.AutoscalingV2Api()
    table = {
        "Deployment": (apps, "namespaced_deployment"),
        "Service": (core, "namespaced_service"),
        "ConfigMap": (core, "namespaced_config_map"),
        "Secret": (core, "namespaced_secret"),
        "ServiceAccount": (core, "namespaced_service_account"),
        "PodDisruptionBudget": (policy, "namespaced_pod_disruption_budget"),
        "Role": (rbac, "namespaced_role"),
        "RoleBinding": (rbac, "namespaced_role_binding"),
        "HorizontalPodAutoscaler": (autoscaling, "namespaced_horizontal_pod_autoscaler"),
    }
    api, suffix = table[kind]
    return (getattr(api, f"read_{suffix}"), getattr(api, f"create_{suffix}"),
            getattr(api, f"patch_{suffix}"), getattr(api, f"delete_{suffix}"))


def canonical(obj: dict) -> str:
    """The form stored in :data:`LAST_APPLIED` (key order does not matter)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def merge_patch(last: Any, desired: Any) -> Any:
    """The JSON merge patch (RFC 7386) that applies ``desired`` over an object ``last`` was applied to.

    It is ``desired`` whole (so fields someone edited by hand are set back), plus ``None`` — delete —
    for every map key ``last`` set that ``desired`` no longer has, at any depth. Lists are not
    merged: ``desired``'s replace them.
    """
    if not isinstance(last, dict) or not isinstance(desired, dict):
        return desired
    patch = {key: None for key in last if key not in desired}
    for key, value in desired.items():
        patch[key] = merge_patch(last[key], value) if key in last else value
    return patch


def contains(live: Any, desired: Any) -> bool:
    """Whether ``live`` (an object as the API server returns it) still holds everything
    ``desired`` sets: maps key by key (the server adds defaults; those are not ours), lists item
    by item at the same length, scalars equal (a quantity may come back as a number or a string).
    False after a hand edit to a field the operator renders: the next apply sets it back."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v) for k, v in desired.items())
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(map(contains, live, desired))
    return live == desired or (isinstance(live, (int, float, str)) and str(live) == str(desired))


def _transient(exc: Exception) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in (409, 429) or exc.status >= 500 or exc.status == 0
    # urllib3's errors (MaxRetryError, ProtocolError, ...) wrap a lost or refused connection.
    return isinstance(exc, (ConnectionError, TimeoutError, OSError, urllib3.exceptions.HTTPError))


def _failure(kind: str, name: str, exc: Exception) -> Exception:
    if _transient(exc):
        return Transient(f"{kind} {name}: {exc}")
    if isinstance(exc, ApiException):
        return Refused(f"{kind} {name}: the API refused it ({exc.status} {exc.reason}): {_api_message(exc)}")
    return Refused(f"{kind} {name}: {exc}")


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body).get("message", "")
    except (TypeError, ValueError, AttributeError):
        return str(exc.body or "")[:500]


def _with_last_applied(obj: dict) -> dict:
    meta = obj["metadata"]
    return {**obj, "metadata": {**meta, "annotations": {**meta.get("annotations", {}), LAST_APPLIED: canonical(obj)}}}


def apply(obj: dict) -> str:
    """Create or patch ``obj`` so the cluster holds it; ``created`` | ``updated`` | ``unchanged``.

    An ``obj`` with a controller owner reference is only ever patched where the object in the
    cluster has that same controller: a same-named object someone else made is never touched.

    Raises:
        Transient: the API failed in a way worth retrying.
        Conflict: an object with this name exists and is not controlled by ``obj``'s owner.
        Refused: a permanent refusal (e.g. 403, 422, or a body the client's model rejects).
    """
    kind, meta = obj["kind"], obj["metadata"]
    read, create, patch, _delete = _apis(kind)
    desired = _with_last_applied(obj)
    try:
        try:
            current = read(meta["name"], meta["namespace"])
        except ApiException as exc:
            if exc.status != 404:
                raise
            create(meta["namespace"], desired)
            return "created"
        owner, found = _wanted_controller(obj), _controller(current.metadata)
        if owner is not None and (found is None or found[1] != owner):
            held = f"controlled by {found[0]}" if found else "with no controller"
            raise Conflict(f"{kind} {meta['name']} exists {held}, not by this pool: left alone "
                           f"(rename or delete it, and the pool creates its own)")
        stored = ((current.metadata.annotations or {}) if current.metadata else {}).get(LAST_APPLIED)
        if stored == canonical(obj) and contains(_client().sanitize_for_serialization(current), desired):
            return "unchanged"  # rendered the same, and nobody changed what we set: no write
        try:
            last = json.loads(stored) if stored else {}
        except ValueError:
            last = {}  # edited by hand: patch everything we render, delete nothing
        body = merge_patch(_with_last_applied(last) if last else {}, desired)
        patch(meta["name"], meta["namespace"], body, _content_type=MERGE_PATCH)
        return "updated"
    except Conflict:
        raise
    except Exception as exc:
        raise _failure(kind, meta["name"], exc) from exc


def delete(kind: str, name: str, namespace: str, owner_uid: str | None = None) -> bool:
    """Delete an object if it exists — with ``owner_uid``, only if that owner controls it (read
    first, then deleted on the condition that it is still the object read); True if something was
    deleted.

    Raises:
        Transient, Refused: as :func:`apply`.
    """
    read, _create, _patch, remove = _apis(kind)
    try:
        if owner_uid is None:
            remove(name, namespace)
            return True
        current = read(name, namespace)
        found = _controller(current.metadata)
        if found is None or found[1] != owner_uid:
            return False  # someone else's: left alone
        uid = current.metadata.uid
        remove(name, namespace, body=kubernetes.client.V1DeleteOptions(
            preconditions=kubernetes.client.V1Preconditions(uid=uid) if uid else None))
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise _failure(kind, name, exc) from exc
    except Exception as exc:
        raise _failure(kind, name, exc) from exc


def deployment_status(name: str, namespace: str) -> dict[str, Any] | None:
    """``{"replicas", "readyReplicas", "updatedReplicas", "generation", "observedGeneration",
    "conditions"}`` of a Deployment (conditions as ``{type, status, reason, message}``), None if
    it is missing."""
    read = _apis("Deployment")[0]
    try:
        dep = read(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise _failure("Deployment", name, exc) from exc
    except Exception as exc:
        raise _failure("Deployment", name, exc) from exc
    status = dep.status
    return {
        "replicas": (status.replicas if status else None) or 0,
        "readyReplicas": (status.ready_replicas if status else None) or 0,
        "updatedReplicas": (status.updated_replicas if status else None) or 0,
        "generation": dep.metadata.generation if dep.metadata else None,
        "observedGeneration": status.observed_generation if status else None,
        "conditions": [{"type": c.type, "status": c.status, "reason": c.reason, "message": c.message}
                       for c in (status.conditions or [])] if status else [],
    }


def list_pods(namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
    """Pods of ``namespace`` carrying every label in ``labels``: name, labels, pod IP, the port
    named ``http`` of their first container (8000 when none is named), whether they are Ready,
    and ``problem`` (:func:`_pod_problem`), the reason one is stuck, or None.

    The selector is also applied here, on the answer: a server that ignores it returns no stranger.

    Raises:
        Transient, Refused: as :func:`apply`.
    """
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    try:
        pods = kubernetes.client.CoreV1Api().list_namespaced_pod(namespace, label_selector=selector).items
    except Exception as exc:
        raise _failure("Pod", selector, exc) from exc
    out = []
    for pod in pods:
        have = (pod.metadata.labels or {}) if pod.metadata else {}
        if any(have.get(k) != v for k, v in labels.items()):
            continue
        port = 8000
        for container in (pod.spec.containers if pod.spec and pod.spec.containers else [])[:1]:
            port = next((p.container_port for p in container.ports or [] if p.name == "http"), port)
        status = pod.status
        ready = any(c.type == "Ready" and c.status == "True" for c in (status.conditions or [])) if status else False
        out.append({"name": pod.metadata.name, "labels": have, "ip": status.pod_ip if status else None,
                    "port": port, "ready": ready, "problem": _pod_problem(status)})
    return out


def _pod_problem(status) -> dict[str, str] | None:
    """``{reason, message}`` of a pod that cannot run: unschedulable, a container waiting in a
    back-off or a config error, or last killed for memory; None otherwise."""
    if status is None:
        return None
    for cond in status.conditions or []:
        if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
            return {"reason": "Unschedulable", "message": cond.message or ""}
    for c in [*(status.init_container_statuses or []), *(status.container_statuses or [])]:
        waiting = c.state.waiting if c.state else None
        if waiting and waiting.reason in ("ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff",
                                          "CreateContainerConfigError", "InvalidImageName"):
            last = c.last_state.terminated if c.last_state else None
            if waiting.reason == "CrashLoopBackOff" and last is not None and last.reason == "OOMKilled":
                return {"reason": "OOMKilled", "message": f"container {c.name} was killed for memory (OOMKilled)"}
            return {"reason": waiting.reason, "message": f"container {c.name}: {waiting.message or waiting.reason}"}
    return None


def ensure_secret_token(meta: dict[str, Any], new_token: str) -> str:
    """The ``token`` of the Secret ``meta`` names, creating it (with ``meta``: labels, owner) and
    ``new_token`` if it is missing. Its content is never rewritten: replicas read it at start-up.

    Raises:
        Transient, Refused: as :func:`apply`; Refused also for a Secret without a ``token`` key.
    """
    core = kubernetes.client.CoreV1Api()
    name, namespace = meta["name"], meta["namespace"]
    try:
        try:
            secret = core.read_namespaced_secret(name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            core.create_namespaced_secret(namespace, {"apiVersion": "v1", "kind": "Secret", "metadata": meta,
                                                      "type": "Opaque",
                                                      "data": {"token": base64.b64encode(new_token.encode()).decode()}})
            return new_token
    except Exception as exc:
        raise _failure("Secret", name, exc) from exc
    data = secret.data or {}
    if "token" not in data:
        raise Refused(f"Secret {name} has no 'token' key")
    return base64.b64decode(data["token"]).decode()


def patch_pod_labels(name: str, namespace: str, labels: dict[str, str | None]) -> None:
    """Set (or, with None, remove) labels of a pod — a merge patch of ``metadata.labels`` only.

    Raises:
        Transient, Refused: as :func:`apply` (a pod that is gone is Refused).
    """
    try:
        kubernetes.client.CoreV1Api().patch_namespaced_pod(name, namespace, {"metadata": {"labels": labels}},
                                                           _content_type=MERGE_PATCH)
    except Exception as exc:
        raise _failure("Pod", name, exc) from exc
