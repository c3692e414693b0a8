"""Idempotent apply and delete of the objects a pool renders, with the ``kubernetes`` client.

``apply`` stores a hash of the rendered object in an annotation; an object whose stored hash
matches is left alone, so a second reconcile changes nothing (no patch, no event, no rollout).
A different hash is patched in; a missing object is created. Transient API failures (429, 5xx,
409 conflicts, connection errors) become :class:`Transient` so the caller retries with backoff.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

APPLIED_HASH = "serving.cadenza.dev/applied-hash"


class Transient(Exception):
    """A failure worth retrying later (the API server was busy, unreachable, or raced us)."""


def _apis(kind: str):
    """The client calls for a kind: (read, create, patch, delete), each taking (name, namespace, ...)."""
    core, apps = kubernetes.client.CoreV1Api(), kubernetes.client.AppsV1Api()
    policy, rbac = kubernetes.client.PolicyV1Api(), kubernetes.client.RbacAuthorizationV1Api()
    table = {
        "Deployment": (apps, "namespaced_deployment"),
        "Service": (core, "namespaced_service"),
        "ConfigMap": (core, "namespaced_config_map"),
        "ServiceAccount": (core, "namespaced_service_account"),
        "PodDisruptionBudget": (policy, "namespaced_pod_disruption_budget"),
        "Role": (rbac, "namespaced_role"),
        "RoleBinding": (rbac, "namespaced_role_binding"),
    }
    api, suffix = table[kind]
    return (getattr(api, f"read_{suffix}"), getattr(api, f"create_{suffix}"),
            getattr(api, f"patch_{suffix}"), getattr(api, f"delete_{suffix}"))


def object_hash(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


def _transient(exc: Exception) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in (409, 429) or exc.status >= 500 or exc.status == 0
    return isinstance(exc, (ConnectionError, TimeoutError, OSError))


def apply(obj: dict) -> str:
    """Create or patch ``obj`` so the cluster holds it; ``created`` | ``updated`` | ``unchanged``.

    Raises:
        Transient: the API failed in a way worth retrying.
        ApiException: a permanent refusal (e.g. 403, 422).
    """
    kind, meta = obj["kind"], obj["metadata"]
    read, create, patch, _delete = _apis(kind)
    digest = object_hash(obj)
    desired = {**obj, "metadata": {**meta, "annotations": {**meta.get("annotations", {}), APPLIED_HASH: digest}}}
    try:
        try:
            current = read(meta["name"], meta["namespace"])
        except ApiException as exc:
            if exc.status != 404:
                raise
            create(meta["namespace"], desired)
            return "created"
        annotations = (current.metadata.annotations or {}) if hasattr(current, "metadata") else {}
        if annotations.get(APPLIED_HASH) == digest:
            return "unchanged"
        patch(meta["name"], meta["namespace"], desired)
        return "updated"
    except Exception as exc:
        if _transient(exc):
            raise Transient(f"{kind} {meta['name']}: {exc}") from exc
        raise


def delete(kind: str, name: str, namespace: str) -> bool:
    """Delete an object if it exists; True if something was deleted.

    Raises:
        Transient: as :func:`apply`.
    """
    _read, _create, _patch, remove = _apis(kind)
    try:
        remove(name, namespace)
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        if _transient(exc):
            raise Transient(f"{kind} {name}: {exc}") from exc
        raise
    except (ConnectionError, TimeoutError, OSError) as exc:
        raise Transient(f"{kind} {name}: {exc}") from exc


def deployment_status(name: str, namespace: str) -> dict[str, Any] | None:
    """``{"replicas", "readyReplicas", "updatedReplicas"}`` of a Deployment, None if it is missing."""
    read = _apis("Deployment")[0]
    try:
        dep = read(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        if _transient(exc):
            raise Transient(f"Deployment {name}: {exc}") from exc
        raise
    status = dep.status
    return {
        "replicas": (status.replicas if status else None) or 0,
        "readyReplicas": (status.ready_replicas if status else None) or 0,
        "updatedReplicas": (status.updated_replicas if status else None) or 0,
    }
