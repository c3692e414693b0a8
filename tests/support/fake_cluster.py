"""A fake cluster for the operator's handlers, without an API server: it records the objects the
handlers apply and delete, the Events they post and the status the resync loop patches, and
plays the Deployments' readiness and the pods a test sets.

``cluster = FakeCluster(monkeypatch)`` is also a dict of what it saw (``applied``, ``existing``,
``objects``, ``events``, ``status``) and of what a test sets (``ready``, ``pods``,
``conditions``); ``cluster.run(body)`` is one reconcile, ``cluster.resync(body)`` one pass of
the resync loop, both with the same operator state (``cluster.operator``: not watching, so
every child is read through the faked API).
"""

from __future__ import annotations

import logging

import kopf

from cadenza.operator import kube, report, ssa
from cadenza.operator.converge import reconcile
from cadenza.operator.memo import Operator
from cadenza.operator.resync import resync_pool

BODY = {
    "apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool",
    "metadata": {"name": "chat", "namespace": "prod", "uid": "uid-1", "generation": 7},
    "spec": {"model": {"name": "tiny", "source": {"path": "/m"}}, "replicas": 2,
             "engine": {"tokenBudget": 256, "chunkSize": 64}},
}


class FakeCluster(dict):
    """A fake cluster: records applies/deletes and the events the handlers post."""

    def __init__(self, monkeypatch) -> None:
        super().__init__(applied=[], existing=set(), events=[], ready=0, objects={}, pods=[], conditions=[],
                         status=[])
        self.operator = Operator()
        state = self

        def apply(obj, live=None):
            key = (obj["kind"], obj["metadata"]["name"])
            state["applied"].append(key)
            meta = obj["metadata"]  # stored as ssa.apply stores it: stamped with the rendering's digest
            state["objects"][key] = {**obj, "metadata": {**meta, "annotations": {
                **meta.get("annotations", {}), ssa.RENDERED: ssa.digest(obj)}}}
            if key in state["existing"]:
                return "unchanged"
            state["existing"].add(key)
            return "created"

        monkeypatch.setattr(ssa, "apply", apply)
        monkeypatch.setattr(kube, "read", lambda kind, name, ns: state["objects"].get((kind, name))
                            if (kind, name) in state["existing"] else None)
        monkeypatch.setattr(ssa, "delete", lambda kind, name, ns, owner_uid=None, live=None:
                            (kind, name) in state["existing"] and not state["existing"].discard((kind, name)))
        monkeypatch.setattr(kube, "deployment_status", lambda name, ns: {
            "replicas": 2, "readyReplicas": state["ready"], "updatedReplicas": 2, "conditions": state["conditions"]}
            if ("Deployment", name) in state["existing"] else None)
        monkeypatch.setattr(kube, "list_pods", lambda ns, labels: state["pods"])
        monkeypatch.setattr(report, "patch_status",
                            lambda group, version, plural, ns, name, status: state["status"].append(status))
        monkeypatch.setattr(kopf, "info", lambda body, reason, message: state["events"].append(("Normal", reason, message)))
        monkeypatch.setattr(kopf, "warn", lambda body, reason, message: state["events"].append(("Warning", reason, message)))

    @property
    def memo(self) -> kopf.Memo:
        """The memo kopf hands the resource handlers (a copy of the operator's)."""
        return kopf.Memo(operator=self.operator)

    def run(self, body: dict) -> kopf.Patch:
        """One reconcile of ``body``; the patch it made."""
        patch, b = kopf.Patch(), kopf.Body(body)
        reconcile(body=b, meta=b.metadata, patch=patch, logger=logging.getLogger("test"), memo=self.memo)
        return patch

    def resync(self, body: dict) -> dict | None:
        """One pass of the resync loop; the status it patched (None: nothing changed)."""
        self["status"].clear()
        resync_pool(self.operator, kopf.Body(body))
        return self["status"][-1] if self["status"] else None
