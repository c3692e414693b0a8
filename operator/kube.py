"""The operator's one Kubernetes API client, the failures of a call sorted into worth retrying or
not, and what the operator reads: an object, a Deployment's rollout state, a pool's pods (with the
label patch that routes them) and the admin Secret's token.

Every call goes through one shared API client (:func:`connect`: one connection pool). Transient
API failures (429, 5xx, 409 conflicts, connection errors) become :class:`Transient` so the caller
retries with backoff; anything else the API refuses is :class:`Refused`. Writing a pool's children
is :mod:`.ssa` (server-side apply); its status and Events, :mod:`.report`.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.rest import ApiException

MERGE_PATCH = "application/merge-patch+json"


class Transient(Exception):
    """A failure worth retrying later (the API server was busy, unreachable, or raced us)."""


class Refused(Exception):
    """The API (or the client, checking the body) refused an object: retrying the same will not help
    until something changes (the spec, RBAC, an admission policy)."""


_shared: kubernetes.client.ApiClient | None = None  # the process's connection pool: set once, at start-up


def connect(client: kubernetes.client.ApiClient | None = None) -> kubernetes.client.ApiClient:
    """Use one API client (one connection pool) for every call from now on: ``client``, or a new
    one from the configuration loaded last (``load_incluster_config`` / ``load_kube_config``)."""
    global _shared
    _shared = client or kubernetes.client.ApiClient()
    return _shared


def api_client() -> kubernetes.client.ApiClient:
    """The shared client (:func:`connect`, made on first use)."""
    return _shared or connect()


def controller_uid(obj: dict | None) -> tuple[str, str] | None:
    """``(kind/name, uid)`` of the controller owner reference of an API object (a dict), if any."""
    for ref in ((obj or {}).get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return f"{ref.get('kind')}/{ref.get('name')}", ref.get("uid")
    return None


def apis(kind: str):
    """The client calls for a kind: (read, create, patch, delete), each taking (name, namespace, ...)."""
    client = api_client()
    core, apps = kubernetes.client.CoreV1Api(client), kubernetes.client.AppsV1Api(client)
    policy, rbac = kubernetes.client.PolicyV1Api(client), kubernetes.client.RbacAuthorizationV1Api(client)
    autoscaling = kubernetes.client.AutoscalingV2Api(client)
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
        "NetworkPolicy": (kubernetes.client.NetworkingV1Api(client), "namespaced_network_policy"),
    }
    api, suffix = table[kind]
    return (getattr(api, f"read_{suffix}"), getattr(api, f"create_{suffix}"),
            getattr(api, f"patch_{suffix}"), getattr(api, f"delete_{suffix}"))


def _transient(exc: Exception) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in (409, 429) or exc.status >= 500 or exc.status == 0
    # urllib3's errors (MaxRetryError, ProtocolError, ...) wrap a lost or refused connection.
    return isinstance(exc, (ConnectionError, TimeoutError, OSError, urllib3.exceptions.HTTPError))


def failure(kind: str, name: str, exc: Exception) -> Exception:
    """What a failed call about ``kind`` ``name`` is, to raise: :class:`Transient` for a busy,
    unreachable or racing API (429, 5xx, 409, a lost connection), else :class:`Refused`, carrying
    the API's own message."""
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


def read(kind: str, name: str, namespace: str) -> dict | None:
    """The object as the API holds it (an API dict, camelCase keys), None if there is none.

    Raises:
        Transient, Refused: as :func:`failure` sorts them.
    """
    try:
        return api_client().sanitize_for_serialization(apis(kind)[0](name, namespace))
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise failure(kind, name, exc) from exc
    except Exception as exc:
        raise failure(kind, name, exc) from exc


def deployment_status(name: str, namespace: str) -> dict[str, Any] | None:
    """:func:`deployment_state` of the Deployment read now, None if it is missing.

    Raises:
        Transient, Refused: as :func:`failure` sorts them.
    """
    return deployment_state(read("Deployment", name, namespace))


def deployment_state(dep: dict | None) -> dict[str, Any] | None:
    """``{"replicas", "readyReplicas", "updatedReplicas", "generation", "observedGeneration",
    "conditions"}`` of a Deployment (an API dict; conditions as ``{type, status, reason,
    message}``), None for None."""
    if dep is None:
        return None
    status = dep.get("status") or {}
    return {
        "replicas": status.get("replicas") or 0,
        "readyReplicas": status.get("readyReplicas") or 0,
        "updatedReplicas": status.get("updatedReplicas") or 0,
        "generation": (dep.get("metadata") or {}).get("generation"),
        "observedGeneration": status.get("observedGeneration"),
        "conditions": [{key: c.get(key) for key in ("type", "status", "reason", "message")}
                       for c in status.get("conditions") or []],
    }


def list_pods(namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
    """Pods of ``namespace`` carrying every label in ``labels``: name, labels, pod IP, the port
    named ``http`` of their first container (8000 when none is named), whether they are Ready,
    and ``problem`` (:func:`_pod_problem`), the reason one is stuck, or None.

    The selector is also applied here, on the answer: a server that ignores it returns no stranger.

    Raises:
        Transient, Refused: as :func:`failure` sorts them.
    """
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    try:
        pods = kubernetes.client.CoreV1Api(api_client()).list_namespaced_pod(namespace, label_selector=selector).items
    except Exception as exc:
        raise failure("Pod", selector, exc) from exc
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
        Transient, Refused: as :func:`failure` sorts them; Refused also for a Secret without a ``token`` key;
            Transient for one another controller owns — an earlier pool of this name, deleted,
            whose Secret the garbage collector has not collected yet: its token goes with it.
    """
    core = kubernetes.client.CoreV1Api(api_client())
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
        raise failure("Secret", name, exc) from exc
    owner, found = controller_uid({"metadata": meta}), controller_uid(api_client().sanitize_for_serialization(secret))
    if owner is not None and found is not None and found[1] != owner[1]:
        raise Transient(f"Secret {name} is still {found[0]}'s (uid {found[1]}): waiting for it to be collected")
    data = secret.data or {}
    if "token" not in data:
        raise Refused(f"Secret {name} has no 'token' key")
    return base64.b64decode(data["token"]).decode()


def patch_pod_labels(name: str, namespace: str, labels: dict[str, str | None]) -> None:
    """Set (or, with None, remove) labels of a pod — a merge patch of ``metadata.labels`` only.

    Raises:
        Transient, Refused: as :func:`failure` sorts them (a pod that is gone is Refused).
    """
    try:
        kubernetes.client.CoreV1Api(api_client()).patch_namespaced_pod(name, namespace, {"metadata": {"labels": labels}},
                                                           _content_type=MERGE_PATCH)
    except Exception as exc:
        raise failure("Pod", name, exc) from exc
