"""Reconciling a pool without a cluster: the objects applied and retired, an Event for each
change, and the error kinds (invalid spec, transient failure, refusal, conflict)."""

from __future__ import annotations

import logging

import kopf
import pytest
from fake_cluster import BODY

from cadenza.operator import kube, ssa
from cadenza.operator.children import CHILD_KINDS, Children
from cadenza.operator.converge import REFUSED_RETRY_DELAY_S, reconcile


def test_each_created_object_gets_an_event_and_a_second_reconcile_none(cluster):
    cluster.run(BODY)
    created = [e for e in cluster["events"] if e[1] == "Created"]
    assert ("Normal", "Created", "Deployment chat-colocated") in created and len(created) == 11  # a budget per role and the gateway's
    cluster["events"].clear()
    cluster.run(BODY)
    assert cluster["events"] == []  # nothing changed, nothing announced


def test_a_mode_shift_makes_the_new_roles_before_it_breaks_the_old_one(cluster):
    cluster.run(BODY)
    cluster["ready"] = 2
    dedicated = {**BODY, "spec": {**BODY["spec"], "replicas": 4, "mode": "dedicated",
                                  "dedicated": {"interactiveReplicas": 2}}}
    cluster["ready"] = 0  # the new roles' pods are loading
    status = cluster.run(dedicated)["status"]
    deleted = ("Normal", "Deleted", "Deployment chat-colocated: role not run in mode dedicated")
    assert deleted not in cluster["events"] and ("Deployment", "chat-colocated") in cluster["existing"]
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "ModeShift" and "chat-colocated serving until" in progressing["message"]
    selector = cluster["objects"][("Service", "chat-interactive")]["spec"]["selector"]
    assert "serving.cadenza.dev/role" not in selector  # still every engine pod, old and new
    policies = set(cluster["objects"][("ConfigMap", "chat-engine")]["data"])
    assert policies == {"colocated.policy.json", "interactive.policy.json", "batch.policy.json"}  # old pods' file too

    cluster["ready"] = 2  # the new roles are ready: the resync timer finishes the shift
    status = cluster.resync(dedicated)
    assert deleted in cluster["events"] and ("Deployment", "chat-colocated") not in cluster["existing"]
    selector = cluster["objects"][("Service", "chat-interactive")]["spec"]["selector"]
    assert selector["serving.cadenza.dev/role"] == "interactive"
    assert set(cluster["objects"][("ConfigMap", "chat-engine")]["data"]) == {
        "interactive.policy.json", "batch.policy.json"}
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "RolloutComplete"


def test_an_invalid_spec_is_a_degraded_condition_a_warning_and_a_permanent_error(cluster):
    bad = {**BODY, "spec": {**BODY["spec"], "mode": "dedicated",
                            "dedicated": {"interactiveReplicas": 1, "engine": {"chunkSize": 512}}}}
    patch = kopf.Patch()
    b = kopf.Body(bad)
    with pytest.raises(kopf.PermanentError, match="chunkSize"):
        reconcile(body=b, meta=b.metadata, patch=patch, logger=logging.getLogger("test"), memo=cluster.memo)
    degraded = next(c for c in patch["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert cluster["events"][-1][:2] == ("Warning", "InvalidSpec") and cluster["applied"] == []


def test_a_gpu_count_the_schema_let_through_is_reported_once_not_retried(cluster):
    bad = {**BODY, "spec": {**BODY["spec"], "resources": {"limits": {"nvidia.com/gpu": "1.5"}}}}
    patch = kopf.Patch()
    b = kopf.Body(bad)
    with pytest.raises(kopf.PermanentError, match="GPU"):
        reconcile(body=b, meta=b.metadata, patch=patch, logger=logging.getLogger("test"), memo=cluster.memo)
    degraded = next(c for c in patch["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "GPU" in degraded["message"] and cluster["applied"] == []


def test_more_ranks_than_gpus_per_replica_is_an_invalid_spec_saying_why(cluster):
    bad = {**BODY, "spec": {**BODY["spec"], "mode": "auto", "engine": {"tensorParallelSize": 8},
                            "resources": {"limits": {"nvidia.com/gpu": 4}}}}
    patch = kopf.Patch()
    b = kopf.Body(bad)
    with pytest.raises(kopf.PermanentError, match="tensorParallelSize"):
        reconcile(body=b, meta=b.metadata, patch=patch, logger=logging.getLogger("test"), memo=cluster.memo)
    degraded = next(c for c in patch["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec" and cluster["applied"] == []
    assert "8 ranks need 8 GPUs per replica, but spec.resources asks for 4" in degraded["message"]


def test_pod_settings_that_clash_with_the_operators_are_an_invalid_spec(cluster):
    bad = {**BODY, "spec": {**BODY["spec"], "pod": {"env": [{"name": "CADENZA_POOL", "value": "other"}]}}}
    patch = kopf.Patch()
    b = kopf.Body(bad)
    with pytest.raises(kopf.PermanentError, match="CADENZA_POOL"):
        reconcile(body=b, meta=b.metadata, patch=patch, logger=logging.getLogger("test"), memo=cluster.memo)
    assert cluster["applied"] == []


def test_a_schema_violation_the_api_server_would_refuse_is_caught_too(cluster):
    bad = {**BODY, "spec": {**BODY["spec"], "engine": {"tokenBudget": 128, "chunkSize": 256}}}
    b = kopf.Body(bad)
    with pytest.raises(kopf.PermanentError, match="chunkSize"):
        reconcile(body=b, meta=b.metadata, patch=kopf.Patch(), logger=logging.getLogger("test"), memo=cluster.memo)


def test_transient_api_failures_are_retried_later(cluster, monkeypatch):
    def busy(obj):
        raise kube.Transient("503 from the API server")

    monkeypatch.setattr(ssa, "apply", busy)
    b = kopf.Body(BODY)
    delays = []
    for retry in range(7):  # kopf passes how many retries came before
        with pytest.raises(kopf.TemporaryError) as err:
            reconcile(body=b, meta=b.metadata, patch=kopf.Patch(), logger=logging.getLogger("test"),
                      memo=cluster.memo, retry=retry)
        delays.append(err.value.delay)
    assert delays == [10, 20, 40, 80, 160, 300, 300]  # exponential backoff, capped


def test_an_object_the_api_refuses_is_a_degraded_condition_and_a_slow_retry(cluster, monkeypatch):
    def forbidden(obj):
        raise kube.Refused("Deployment chat-colocated: the API refused it (403 Forbidden): quota exceeded")

    monkeypatch.setattr(ssa, "apply", forbidden)
    patch, b = kopf.Patch(), kopf.Body(BODY)
    with pytest.raises(kopf.TemporaryError) as err:
        reconcile(body=b, meta=b.metadata, patch=patch, logger=logging.getLogger("test"), memo=cluster.memo)
    assert err.value.delay == REFUSED_RETRY_DELAY_S
    degraded = next(c for c in patch["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ApplyRefused"
    assert "quota exceeded" in degraded["message"]
    assert cluster["events"][-1][:2] == ("Warning", "ApplyRefused")


def test_a_shift_holds_the_old_role_to_what_was_applied_and_never_rolls_it(cluster):
    dedicated = {**BODY, "spec": {**BODY["spec"], "mode": "dedicated", "dedicated": {"interactiveReplicas": 1}}}
    cluster.run(dedicated)
    colocated = {**BODY, "spec": {**dedicated["spec"], "mode": "colocated"}}
    cluster.run(colocated)  # the colocated role is not ready: interactive and batch still serve
    assert {("Deployment", "chat-interactive"), ("Deployment", "chat-batch")} <= cluster["existing"]
    cluster["applied"].clear()
    cluster.resync(colocated)
    # only the mode changed: the old roles render as they were applied, so drift in them is repaired
    assert {("Deployment", "chat-interactive"), ("Deployment", "chat-batch")} <= set(cluster["applied"])

    cluster["applied"].clear()
    cluster.resync({**colocated, "spec": {**colocated["spec"], "image": "engine:2"}})
    # the spec now runs another image: the old roles keep theirs until retired (not rolled mid-shift)
    assert ("Deployment", "chat-colocated") in cluster["applied"]
    assert not {("Deployment", "chat-interactive"), ("Deployment", "chat-batch")} & set(cluster["applied"])


def test_the_one_budget_for_every_engine_pod_an_older_operator_made_goes_on_reconcile(cluster, monkeypatch):
    cluster["existing"].add(("PodDisruptionBudget", "chat-engine"))
    cluster.run(BODY)
    assert ("PodDisruptionBudget", "chat-engine") not in cluster["existing"]
    assert ("PodDisruptionBudget", "chat-colocated") in cluster["existing"]

    # Under kopf the children come from its watches: a resync neither deletes what is not there
    # nor reads a child it has, and a pool whose status is as reported is not patched at all.
    calls = []
    monkeypatch.setattr(ssa, "delete", lambda *a, **k: calls.append(("delete", a)))
    monkeypatch.setattr(kube, "read", lambda *a: calls.append(("read", a)))
    applied = []
    monkeypatch.setattr(ssa, "apply", lambda obj, live=None: applied.append(live) or "unchanged")
    ready = {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 1},
             "metadata": {"generation": 1}}
    index = {kind: {} for kind in CHILD_KINDS}
    for kind, name in cluster["existing"]:
        index[kind][("prod", name)] = [{"kind": kind, "metadata": {"name": name}, **(ready if kind == "Deployment" else {})}]
    cluster.operator.children = Children(index)
    status = cluster.resync(BODY)
    assert calls == [] and all(live is not None for live in applied)
    assert cluster.resync({**BODY, "status": status}) is None


def test_removing_autoscaling_deletes_the_scaler_on_reconcile(cluster):
    cluster.run({**BODY, "spec": {**BODY["spec"], "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}})
    assert ("HorizontalPodAutoscaler", "chat") in cluster["existing"]
    cluster.run(BODY)
    assert ("HorizontalPodAutoscaler", "chat") not in cluster["existing"]


def test_an_object_of_someone_elses_under_a_childs_name_is_left_alone_and_reported_once(cluster, monkeypatch):
    applied = ssa.apply

    def apply(obj):
        if (obj["kind"], obj["metadata"]["name"]) == ("Deployment", "chat-colocated"):
            raise ssa.Conflict("Deployment chat-colocated exists with no controller, not by this pool: left alone")
        return applied(obj)

    monkeypatch.setattr(ssa, "apply", apply)
    patch = cluster.run(BODY)
    degraded = next(c for c in patch["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "Conflict" and "chat-colocated" in degraded["message"]
    assert ("Deployment", "chat-gateway") in cluster["existing"]  # the rest is applied
    assert [e for e in cluster["events"] if e[1] == "Conflict"] == [("Warning", "Conflict", degraded["message"])]
    cluster["events"].clear()
    cluster.run({**BODY, "status": {"conditions": [degraded]}})  # the resync after: already reported
    assert not [e for e in cluster["events"] if e[1] == "Conflict"]
