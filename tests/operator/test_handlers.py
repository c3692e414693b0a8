"""The kopf handlers without a cluster: events for each change, status conditions, error kinds."""

from __future__ import annotations

import logging

import kopf
import pytest

from cadenza.operator import handlers, kube, report, ssa

BODY = {
    "apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool",
    "metadata": {"name": "chat", "namespace": "prod", "uid": "uid-1", "generation": 7},
    "spec": {"model": {"name": "tiny", "source": {"path": "/m"}}, "replicas": 2,
             "engine": {"tokenBudget": 256, "chunkSize": 64}},
}


@pytest.fixture
def cluster(monkeypatch):
    """A fake cluster: records applies/deletes and the events the handlers post."""
    state = {"applied": [], "existing": set(), "events": [], "ready": 0, "objects": {}, "pods": [], "conditions": [],
             "status": []}

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
    monkeypatch.setattr(ssa, "delete", lambda kind, name, ns, owner_uid=None, live=None: (kind, name) in state["existing"]
                        and not state["existing"].discard((kind, name)))
    monkeypatch.setattr(kube, "deployment_status", lambda name, ns: {
        "replicas": 2, "readyReplicas": state["ready"], "updatedReplicas": 2, "conditions": state["conditions"]}
        if ("Deployment", name) in state["existing"] else None)
    monkeypatch.setattr(kube, "list_pods", lambda ns, labels: state["pods"])
    monkeypatch.setattr(report, "patch_status", lambda group, version, plural, ns, name, status: state["status"].append(status))
    monkeypatch.setattr(handlers.kopf, "info", lambda body, reason, message: state["events"].append(("Normal", reason, message)))
    monkeypatch.setattr(handlers.kopf, "warn", lambda body, reason, message: state["events"].append(("Warning", reason, message)))
    return state


def resync(body: dict, cluster: dict) -> dict | None:
    """One pass of the resync loop; the status it patched (None: nothing changed)."""
    cluster["status"].clear()
    handlers.resync(kopf.Body(body))
    return cluster["status"][-1] if cluster["status"] else None


def run(body: dict) -> kopf.Patch:
    patch = kopf.Patch()
    b = kopf.Body(body)
    handlers.reconcile(body=b, meta=b.metadata, patch=patch, logger=logging.getLogger("test"))
    return patch


def test_each_created_object_gets_an_event_and_a_second_reconcile_none(cluster):
    run(BODY)
    created = [e for e in cluster["events"] if e[1] == "Created"]
    assert ("Normal", "Created", "Deployment chat-colocated") in created and len(created) == 11  # a budget per role and the gateway's
    cluster["events"].clear()
    run(BODY)
    assert cluster["events"] == []  # nothing changed, nothing announced


def test_status_reports_mode_replicas_and_conditions(cluster):
    status = run(BODY)["status"]
    assert status["mode"] == "colocated" and status["ready"] == "0/2" and status["observedGeneration"] == 7
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "False" and conditions["Progressing"]["status"] == "True"
    assert conditions["Degraded"]["status"] == "False"
    cluster["ready"] = 2
    status = run(BODY)["status"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert status["ready"] == "2/2" and conditions["Ready"]["status"] == "True"
    assert conditions["Progressing"]["reason"] == "RolloutComplete"


def test_a_mode_shift_makes_the_new_roles_before_it_breaks_the_old_one(cluster):
    run(BODY)
    cluster["ready"] = 2
    dedicated = {**BODY, "spec": {**BODY["spec"], "replicas": 4, "mode": "dedicated",
                                  "dedicated": {"interactiveReplicas": 2}}}
    cluster["ready"] = 0  # the new roles' pods are loading
    status = run(dedicated)["status"]
    deleted = ("Normal", "Deleted", "Deployment chat-colocated: role not run in mode dedicated")
    assert deleted not in cluster["events"] and ("Deployment", "chat-colocated") in cluster["existing"]
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "ModeShift" and "chat-colocated serving until" in progressing["message"]
    selector = cluster["objects"][("Service", "chat-interactive")]["spec"]["selector"]
    assert "serving.cadenza.dev/role" not in selector  # still every engine pod, old and new
    policies = set(cluster["objects"][("ConfigMap", "chat-engine")]["data"])
    assert policies == {"colocated.policy.json", "interactive.policy.json", "batch.policy.json"}  # old pods' file too

    cluster["ready"] = 2  # the new roles are ready: the resync timer finishes the shift
    status = resync(dedicated, cluster)
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
        handlers.reconcile(body=b, meta=b.metadata, patch=patch, logger=logging.getLogger("test"))
    degraded = next(c for c in patch["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert cluster["events"][-1][:2] == ("Warning", "InvalidSpec") and cluster["applied"] == []


def test_a_gpu_count_the_schema_let_through_is_reported_once_not_retried(cluster):
    bad = {**BODY, "spec": {**BODY["spec"], "resources": {"limits": {"nvidia.com/gpu": "1.5"}}}}
    patch = kopf.Patch()
    b = kopf.Body(bad)
    with pytest.raises(kopf.PermanentError, match="GPU"):
        handlers.reconcile(body=b, meta=b.metadata, patch=patch, logger=logging.getLogger("test"))
    degraded = next(c for c in patch["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "GPU" in degraded["message"] and cluster["applied"] == []


def test_pod_settings_that_clash_with_the_operators_are_an_invalid_spec(cluster):
    bad = {**BODY, "spec": {**BODY["spec"], "pod": {"env": [{"name": "CADENZA_POOL", "value": "other"}]}}}
    patch = kopf.Patch()
    b = kopf.Body(bad)
    with pytest.raises(kopf.PermanentError, match="CADENZA_POOL"):
        handlers.reconcile(body=b, meta=b.metadata, patch=patch, logger=logging.getLogger("test"))
    assert cluster["applied"] == []


def test_a_schema_violation_the_api_server_would_refuse_is_caught_too(cluster):
    bad = {**BODY, "spec": {**BODY["spec"], "engine": {"tokenBudget": 128, "chunkSize": 256}}}
    b = kopf.Body(bad)
    with pytest.raises(kopf.PermanentError, match="chunkSize"):
        handlers.reconcile(body=b, meta=b.metadata, patch=kopf.Patch(), logger=logging.getLogger("test"))


def test_transient_api_failures_are_retried_later(cluster, monkeypatch):
    def busy(obj):
        raise kube.Transient("503 from the API server")

    monkeypatch.setattr(ssa, "apply", busy)
    b = kopf.Body(BODY)
    delays = []
    for retry in range(7):  # kopf passes how many retries came before
        with pytest.raises(kopf.TemporaryError) as err:
            handlers.reconcile(body=b, meta=b.metadata, patch=kopf.Patch(), logger=logging.getLogger("test"),
                               retry=retry)
        delays.append(err.value.delay)
    assert delays == [10, 20, 40, 80, 160, 300, 300]  # exponential backoff, capped


def test_an_object_the_api_refuses_is_a_degraded_condition_and_a_slow_retry(cluster, monkeypatch):
    def forbidden(obj):
        raise kube.Refused("Deployment chat-colocated: the API refused it (403 Forbidden): quota exceeded")

    monkeypatch.setattr(ssa, "apply", forbidden)
    patch, b = kopf.Patch(), kopf.Body(BODY)
    with pytest.raises(kopf.TemporaryError) as err:
        handlers.reconcile(body=b, meta=b.metadata, patch=patch, logger=logging.getLogger("test"))
    assert err.value.delay == handlers.REFUSED_RETRY_DELAY_S
    degraded = next(c for c in patch["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ApplyRefused"
    assert "quota exceeded" in degraded["message"]
    assert cluster["events"][-1][:2] == ("Warning", "ApplyRefused")


def test_the_resync_timer_recreates_a_child_deleted_by_hand_and_leaves_the_rest(cluster):
    run(BODY)
    cluster["existing"].discard(("Deployment", "chat-gateway"))  # kubectl delete deploy chat-gateway
    cluster["events"].clear()
    status = resync(BODY, cluster)
    assert cluster["events"] == [("Normal", "Created", "Deployment chat-gateway")]
    assert status["mode"] == "colocated"


def test_the_resync_timer_is_quiet_about_an_invalid_spec(cluster):
    bad = {**BODY, "spec": {**BODY["spec"], "engine": {"tokenBudget": 128, "chunkSize": 256}}}
    assert resync(bad, cluster) is None
    assert cluster["applied"] == [] and cluster["events"] == []


def test_a_disaggregated_pool_reports_its_threshold_pinned_or_as_its_gateways_compute_it(cluster, monkeypatch):
    tokens = []
    monkeypatch.setattr(kube, "ensure_secret_token", lambda meta, token: tokens.append(meta["name"]) or token)
    scraped = {"chat-gateway-1": "# TYPE g gauge\ncadenza_gateway_disagg_min_prompt_tokens{a=\"b\"} 700.0\n",
               "chat-gateway-2": "cadenza_gateway_disagg_min_prompt_tokens 650.0\n", "chat-decode-1": "x 1\n"}
    monkeypatch.setattr(handlers, "scrape_pool", lambda pool: scraped)
    body = {**BODY, "spec": {**BODY["spec"], "mode": "disaggregated", "disaggregated": {"prefillReplicas": 1}}}
    status = run(body)["status"]
    assert tokens == ["chat-admin"]  # before the pods that mount it
    assert status["roles"] == {"prefill": {"replicas": 1, "readyReplicas": 0},
                               "decode": {"replicas": 1, "readyReplicas": 0}}
    # the most any gateway reports: a gateway that has not heard from every decode replica lags
    assert status["disaggregated"]["minPromptTokens"] == 700 and status["disaggregated"]["source"] == "computed"
    scraped.clear()
    assert run(body)["status"]["disaggregated"]["source"] == "unknown"
    body["spec"]["disaggregated"]["minPromptTokens"] = 900
    assert run(body)["status"]["disaggregated"] == {"minPromptTokens": 900, "source": "pinned",
                                                    "message": "spec.disaggregated.minPromptTokens"}
    assert "disaggregated" not in run(BODY)["status"]


def test_a_shift_holds_the_old_role_to_what_was_applied_and_never_rolls_it(cluster):
    dedicated = {**BODY, "spec": {**BODY["spec"], "mode": "dedicated", "dedicated": {"interactiveReplicas": 1}}}
    run(dedicated)
    colocated = {**BODY, "spec": {**dedicated["spec"], "mode": "colocated"}}
    run(colocated)  # the colocated role is not ready: interactive and batch still serve
    assert {("Deployment", "chat-interactive"), ("Deployment", "chat-batch")} <= cluster["existing"]
    cluster["applied"].clear()
    resync(colocated, cluster)
    # only the mode changed: the old roles render as they were applied, so drift in them is repaired
    assert {("Deployment", "chat-interactive"), ("Deployment", "chat-batch")} <= set(cluster["applied"])

    cluster["applied"].clear()
    resync({**colocated, "spec": {**colocated["spec"], "image": "engine:2"}}, cluster)
    # the spec now runs another image: the old roles keep theirs until retired (not rolled mid-shift)
    assert ("Deployment", "chat-colocated") in cluster["applied"]
    assert not {("Deployment", "chat-interactive"), ("Deployment", "chat-batch")} & set(cluster["applied"])


def test_the_one_budget_for_every_engine_pod_an_older_operator_made_goes_on_reconcile(cluster, monkeypatch):
    cluster["existing"].add(("PodDisruptionBudget", "chat-engine"))
    run(BODY)
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
    index = {kind: {} for kind in handlers.CHILD_KINDS}
    for kind, name in cluster["existing"]:
        index[kind][("prod", name)] = [{"kind": kind, "metadata": {"name": name}, **(ready if kind == "Deployment" else {})}]
    monkeypatch.setattr(handlers, "_children", index)
    status = resync(BODY, cluster)
    assert calls == [] and all(live is not None for live in applied)
    assert resync({**BODY, "status": status}, cluster) is None


def test_removing_autoscaling_deletes_the_scaler_on_reconcile(cluster):
    run({**BODY, "spec": {**BODY["spec"], "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}})
    assert ("HorizontalPodAutoscaler", "chat") in cluster["existing"]
    run(BODY)
    assert ("HorizontalPodAutoscaler", "chat") not in cluster["existing"]


def test_an_object_of_someone_elses_under_a_childs_name_is_left_alone_and_reported_once(cluster, monkeypatch):
    applied = ssa.apply

    def apply(obj):
        if (obj["kind"], obj["metadata"]["name"]) == ("Deployment", "chat-colocated"):
            raise ssa.Conflict("Deployment chat-colocated exists with no controller, not by this pool: left alone")
        return applied(obj)

    monkeypatch.setattr(ssa, "apply", apply)
    patch = run(BODY)
    degraded = next(c for c in patch["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "Conflict" and "chat-colocated" in degraded["message"]
    assert ("Deployment", "chat-gateway") in cluster["existing"]  # the rest is applied
    assert [e for e in cluster["events"] if e[1] == "Conflict"] == [("Warning", "Conflict", degraded["message"])]
    cluster["events"].clear()
    run({**BODY, "status": {"conditions": [degraded]}})  # the resync after: already reported
    assert not [e for e in cluster["events"] if e[1] == "Conflict"]


def conditions_of(patch) -> dict[str, dict]:
    return {c["type"]: c for c in patch["status"]["conditions"]}


def test_a_pod_the_scheduler_cannot_place_says_so_in_ready_and_is_not_degraded(cluster):
    run(BODY)
    cluster["pods"] = [{"name": "chat-colocated-abc", "problem": {
        "reason": "Unschedulable", "message": "0/8 nodes are available: 8 Insufficient nvidia.com/gpu."}}]
    conds = conditions_of(run(BODY))
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "Unschedulable"
    assert "colocated: pod chat-colocated-abc: 0/8 nodes are available" in conds["Ready"]["message"]
    assert conds["Degraded"]["status"] == "False"  # an autoscaler may yet add a node


@pytest.mark.parametrize("reason", ["ImagePullBackOff", "CrashLoopBackOff", "OOMKilled"])
def test_a_pod_that_cannot_run_makes_the_pool_degraded_with_its_reason(cluster, reason):
    run(BODY)
    cluster["pods"] = [{"name": "chat-colocated-abc", "problem": {"reason": reason, "message": "container engine: x"}}]
    conds = conditions_of(run(BODY))
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == reason
    assert conds["Degraded"]["message"] == "colocated: pod chat-colocated-abc: container engine: x"


def test_a_rollout_past_its_deadline_is_degraded_and_a_role_that_still_serves_is_ready(cluster):
    run(BODY)
    cluster["ready"] = 1  # one of two replicas: the role serves while the other is replaced
    cluster["conditions"] = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                              "message": 'ReplicaSet "chat-colocated-7d" has timed out progressing.'}]
    conds = conditions_of(run(BODY))
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["reason"] == "Serving"
    assert conds["Degraded"]["reason"] == "ProgressDeadlineExceeded" and "timed out" in conds["Degraded"]["message"]
    assert conds["Progressing"]["status"] == "True"


def test_a_resync_applies_the_pool_as_it_is_now_and_leaves_a_terminating_pool_alone(cluster, monkeypatch):
    """A pass copies every pool at its start; a reconcile of a newer spec may run before this
    pool's turn. The resync reads the pool again under its lock, so it never applies the old one."""
    run(BODY)
    newer = {**BODY, "spec": {**BODY["spec"], "replicas": 4}}
    monkeypatch.setattr(handlers, "_pools", {("prod", "chat"): [kopf.Body(newer)]})
    resync(BODY, cluster)  # the pass's older copy
    assert cluster["objects"][("Deployment", "chat-colocated")]["spec"]["replicas"] == 4
    cluster["applied"].clear()
    terminating = {**newer, "metadata": {**newer["metadata"], "deletionTimestamp": "2026-12-03T00:00:00Z"}}
    monkeypatch.setattr(handlers, "_pools", {("prod", "chat"): [kopf.Body(terminating)]})
    assert resync(BODY, cluster) is None and cluster["applied"] == []  # its children go with it: none made again
