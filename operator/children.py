"""A pool's children as the operator's watches see them: kopf indexes of every kind the pool
renders, label-selected (the API server sends only the pools' children, not the cluster's), and
an index of the pools themselves for the resync loop.

:class:`Children` reads, applies and deletes a child through those indexes, so a resync reads no
child from the API and a name the watch has not seen costs no call; without indexes (a reconcile
run outside ``kopf run``) it reads each child from the API instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from cadenza.operator import kube, render, ssa

PLURAL = "servingpools"
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
MANAGED = {"app.kubernetes.io/managed-by": "cadenza-operator"}  # the label every child carries


def _index_child(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): dict(body)}


for _kind, _resource in CHILD_KINDS.items():
    kopf.index(*_resource, id=f"children_{_kind}", labels=MANAGED)(_index_child)


@kopf.index(render.GROUP, render.VERSION, PLURAL)
def pools(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    """Every ServingPool, for the resync loop."""
    return {(namespace, name): body}


class Children:
    """The pools' children by kind: kopf's indexes (``kind -> (namespace, name) -> [object]``), or
    none (``indexes`` empty: not watching, every child is read from the API)."""

    def __init__(self, indexes: Mapping[str, Any] | None = None) -> None:
        self.indexes = dict(indexes or {})

    def live(self, kind: str, namespace: str, name: str) -> dict | None:
        """A child as the watch last saw it (None: no such child of a pool), or read from the API
        when the operator is not watching.

        Raises:
            kube.Transient, kube.Refused: reading from the API.
        """
        index = self.indexes.get(kind)
        if index is None:
            return kube.read(kind, name, namespace)
        return next(iter(index.get((namespace, name)) or ()), None)

    def apply(self, obj: dict) -> str:
        """:func:`ssa.apply` with the child as the watch saw it (no read first)."""
        if not self.indexes:
            return ssa.apply(obj)
        meta = obj["metadata"]
        return ssa.apply(obj, live=self.live(obj["kind"], meta["namespace"], meta["name"]))

    def delete(self, kind: str, namespace: str, name: str, owner_uid: str | None) -> bool:
        """:func:`ssa.delete`: free for a name the watch has not seen."""
        if not self.indexes:
            return ssa.delete(kind, name, namespace, owner_uid)
        live = self.live(kind, namespace, name)
        return live is not None and ssa.delete(kind, name, namespace, owner_uid, live=live)

    def deployment(self, namespace: str, name: str) -> dict | None:
        """:func:`kube.deployment_state` of a Deployment, None when there is none."""
        if not self.indexes:
            return kube.deployment_status(name, namespace)
        return kube.deployment_state(self.live("Deployment", namespace, name))
