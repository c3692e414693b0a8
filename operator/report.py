"""What the operator tells about a pool: its ``status`` (a JSON merge patch of the ``/status``
subresource, sent only when it would change something) and Kubernetes Events.

Inside kopf's handlers an Event goes through kopf's poster (batched, in kopf's own task); the
resync loop runs outside them, so there it is posted through the API directly. Events can be
turned off with ``CADENZA_OPERATOR_EVENTS=false``.

Source: JSON merge patch, RFC 7386; core/v1 Event.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import kopf
import kubernetes

from cadenza.operator import kube
from cadenza.operator.ssa import FIELD_MANAGER


def events_enabled() -> bool:
    """Whether the operator posts Events (``CADENZA_OPERATOR_EVENTS``, default true)."""
    return os.environ.get("CADENZA_OPERATOR_EVENTS", "true").lower() != "false"


def event(body: kopf.Body, kind: str, reason: str, message: str) -> None:
    """A Kubernetes Event on the pool (``kind``: ``Normal`` | ``Warning``): kopf's poster inside
    kopf's handlers, the API directly from the resync loop (kopf's poster belongs to its
    per-object tasks)."""
    try:
        (kopf.warn if kind == "Warning" else kopf.info)(body, reason=reason, message=message)
    except LookupError:
        if events_enabled():
            post_event(body, kind, reason, message)


def post_event(obj: Any, kind: str, reason: str, message: str) -> None:
    """Post a core/v1 Event about ``obj`` (a pool's body) — best effort: a failure is logged,
    never raised (an Event is a courtesy to whoever reads ``kubectl describe``)."""
    meta = obj["metadata"]
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta.get("uid")},
        "type": kind, "reason": reason, "message": message[:1024], "count": 1,
        "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
        "firstTimestamp": now.isoformat(), "lastTimestamp": now.isoformat(),
    }
    try:
        kubernetes.client.CoreV1Api(kube.api_client()).create_namespaced_event(meta["namespace"], record)
    except Exception as exc:  # noqa: BLE001 - see above
        logging.getLogger(__name__).warning("could not post the Event %s %s: %s", reason, message[:200], exc)


def patch_is_noop(live: Any, patch: Any) -> bool:
    """Whether the JSON merge patch (RFC 7386) ``patch`` would leave ``live`` as it is (``None``
    deletes a key; maps merge; anything else replaces)."""
    if not isinstance(patch, dict):
        return live == patch
    if not isinstance(live, dict):
        return False
    return all((key not in live) if value is None else (key in live and patch_is_noop(live[key], value))
               for key, value in patch.items())


def patch_status(group: str, version: str, plural: str, namespace: str, name: str, status: dict) -> None:
    """A JSON merge patch of a custom object's ``status`` (its ``/status`` subresource).

    Raises:
        kube.Transient, kube.Refused: as :func:`kube.failure` sorts them (a pool that is gone is Refused).
    """
    try:
        kubernetes.client.CustomObjectsApi(kube.api_client()).patch_namespaced_custom_object_status(
            group, version, namespace, plural, name, {"status": status}, _content_type=kube.MERGE_PATCH)
    except Exception as exc:
        raise kube.failure(plural, name, exc) from exc
