"""A pool's status: mode, replicas, conditions and the disaggregation threshold, as reconcile reports them."""

from __future__ import annotations

import datetime

import pytest
from fake_cluster import BODY

from cadenza.operator import kube, observe
from cadenza.operator.observe import Observed
from cadenza.operator.status import build_status
from cadenza.pool.spec import Pool


def test_status_reports_mode_replicas_and_conditions(cluster):
    status = cluster.run(BODY)["status"]
    assert status["mode"] == "colocated" and status["ready"] == "0/2" and status["observedGeneration"] == 7
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "False" and conditions["Progressing"]["status"] == "True"
    assert conditions["Degraded"]["status"] == "False"
    cluster["ready"] = 2
    status = cluster.run(BODY)["status"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert status["ready"] == "2/2" and conditions["Ready"]["status"] == "True"
    assert conditions["Progressing"]["reason"] == "RolloutComplete"


def test_a_disaggregated_pool_reports_its_threshold_pinned_or_as_its_gateways_compute_it(cluster, monkeypatch):
    tokens = []
    monkeypatch.setattr(kube, "ensure_secret_token", lambda meta, token: tokens.append(meta["name"]) or token)
    scraped = {"chat-gateway-1": "# TYPE g gauge\ncadenza_gateway_disagg_min_prompt_tokens{a=\"b\"} 700.0\n",
               "chat-gateway-2": "cadenza_gateway_disagg_min_prompt_tokens 650.0\n", "chat-decode-1": "x 1\n"}
    monkeypatch.setattr(observe, "scrape_pool", lambda pool: scraped)
    body = {**BODY, "spec": {**BODY["spec"], "mode": "disaggregated", "disaggregated": {"prefillReplicas": 1}}}
    status = cluster.run(body)["status"]
    assert tokens == ["chat-admin"]  # before the pods that mount it
    assert status["roles"] == {"prefill": {"replicas": 1, "readyReplicas": 0},
                               "decode": {"replicas": 1, "readyReplicas": 0}}
    # the most any gateway reports: a gateway that has not heard from every decode replica lags
    assert status["disaggregated"]["minPromptTokens"] == 700 and status["disaggregated"]["source"] == "computed"
    scraped.clear()
    assert cluster.run(body)["status"]["disaggregated"]["source"] == "unknown"
    body["spec"]["disaggregated"]["minPromptTokens"] = 900
    assert cluster.run(body)["status"]["disaggregated"] == {"minPromptTokens": 900, "source": "pinned",
                                                    "message": "spec.disaggregated.minPromptTokens"}
    assert "disaggregated" not in cluster.run(BODY)["status"]


def conditions_of(patch) -> dict[str, dict]:
    return {c["type"]: c for c in patch["status"]["conditions"]}


def test_a_pod_the_scheduler_cannot_place_says_so_in_ready_and_is_not_degraded(cluster):
    cluster.run(BODY)
    cluster["pods"] = [{"name": "chat-colocated-abc", "problem": {
        "reason": "Unschedulable", "message": "0/8 nodes are available: 8 Insufficient nvidia.com/gpu."}}]
    conds = conditions_of(cluster.run(BODY))
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "Unschedulable"
    assert "colocated: pod chat-colocated-abc: 0/8 nodes are available" in conds["Ready"]["message"]
    assert conds["Degraded"]["status"] == "False"  # an autoscaler may yet add a node


@pytest.mark.parametrize("reason", ["ImagePullBackOff", "CrashLoopBackOff", "OOMKilled"])
def test_a_pod_that_cannot_run_makes_the_pool_degraded_with_its_reason(cluster, reason):
    cluster.run(BODY)
    cluster["pods"] = [{"name": "chat-colocated-abc", "problem": {"reason": reason, "message": "container engine: x"}}]
    conds = conditions_of(cluster.run(BODY))
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == reason
    assert conds["Degraded"]["message"] == "colocated: pod chat-colocated-abc: container engine: x"


def test_a_rollout_past_its_deadline_is_degraded_and_a_role_that_still_serves_is_ready(cluster):
    cluster.run(BODY)
    cluster["ready"] = 1  # one of two replicas: the role serves while the other is replaced
    cluster["conditions"] = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                              "message": 'ReplicaSet "chat-colocated-7d" has timed out progressing.'}]
    conds = conditions_of(cluster.run(BODY))
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["reason"] == "Serving"
    assert conds["Degraded"]["reason"] == "ProgressDeadlineExceeded" and "timed out" in conds["Degraded"]["message"]
    assert conds["Progressing"]["status"] == "True"


def at(hour: int) -> datetime.datetime:
    return datetime.datetime(2026, 1, 2, hour, tzinfo=datetime.timezone.utc)


def test_status_is_a_function_of_what_was_read_and_a_condition_keeps_its_time_until_it_flips():
    pool = Pool("chat", "prod", BODY["spec"])
    loading = {"replicas": 2, "readyReplicas": 0, "updatedReplicas": 2, "conditions": []}
    pods = [{"name": "chat-colocated-abc", "problem": {"reason": "ImagePullBackOff", "message": "no such image"}}]
    seen = Observed({"chat-colocated": loading}, {"colocated": pods})
    first = build_status(pool, pool.roles(), seen, {}, at(1), generation=7)
    assert first == build_status(pool, pool.roles(), seen, {}, at(1), generation=7)  # no I/O, no clock of its own
    ready = {c["type"]: c for c in first["conditions"]}
    assert ready["Degraded"]["reason"] == "ImagePullBackOff" and "no such image" in ready["Degraded"]["message"]
    assert ready["Ready"]["lastTransitionTime"] == "2026-01-02T01:00:00Z" and ready["Ready"]["observedGeneration"] == 7

    later = build_status(pool, pool.roles(), seen, first, at(2), generation=7)
    assert {c["type"]: c["lastTransitionTime"] for c in later["conditions"]} == {
        c["type"]: c["lastTransitionTime"] for c in first["conditions"]}  # nothing flipped
    serving = Observed({"chat-colocated": {**loading, "readyReplicas": 2}})
    flipped = {c["type"]: c for c in build_status(pool, pool.roles(), serving, first, at(3), generation=7)["conditions"]}
    assert flipped["Ready"]["status"] == "True" and flipped["Ready"]["lastTransitionTime"] == "2026-01-02T03:00:00Z"
    assert flipped["Degraded"]["status"] == "False" and flipped["Degraded"]["lastTransitionTime"] == "2026-01-02T03:00:00Z"


def test_a_role_that_is_not_short_is_not_asked_about_its_pods():
    pool = Pool("chat", "prod", BODY["spec"])
    ready = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "conditions": []}
    stuck = [{"name": "chat-colocated-old", "problem": {"reason": "CrashLoopBackOff", "message": "x"}}]
    status = build_status(pool, pool.roles(), Observed({"chat-colocated": ready}, {"colocated": stuck}), {}, at(1))
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["reason"] == "AllReplicasReady" and conditions["Degraded"]["status"] == "False"


def _merged(live: dict, patch: dict) -> dict:
    """``live`` after a JSON merge patch (RFC 7386): None removes a key, maps merge key by key."""
    out = dict(live)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def test_what_the_controller_no_longer_reports_leaves_the_status():
    # status is a merge patch, which keeps every key it does not name: a drain that ended must not
    # stay in status.controller (a restarted operator would resume it), nor a quiet class in latency
    pool = Pool("chat", "prod", {"model": {"name": "tiny", "source": {"path": "/m"}}, "replicas": 2, "mode": "auto",
                                 "engine": {"tokenBudget": 256, "chunkSize": 64}})
    previous = {"controller": {"knobs": {"chunk_size": 64}, "roles": {"p0": "colocated", "gone": "interactive"},
                               "draining": {"replica": "p0", "since": 1.0}},
                "latency": {"windowSeconds": 300, "classes": {"batch": {"known": True}}}}
    slo = {"latency": {"windowSeconds": 300}, "controller": {"knobs": {"chunk_size": 64}, "roles": {"p0": "colocated"}},
           "sloMet": ("Unknown", "SignalsUnknown", "no signal"), "flapping": False}
    now = datetime.datetime(2026, 12, 5, tzinfo=datetime.timezone.utc)
    status = build_status(pool, pool.roles(), Observed(slo=slo), previous, now)
    after = _merged(previous, status)
    assert after["controller"] == {"knobs": {"chunk_size": 64}, "roles": {"p0": "colocated"}}
    assert after["latency"] == {"windowSeconds": 300}
    # and once applied, the next pass changes nothing
    from cadenza.operator.report import patch_is_noop

    assert patch_is_noop(after, build_status(pool, pool.roles(), Observed(slo=slo), after, now))


def test_an_auto_pool_shows_its_shape_in_status_and_in_the_ready_message():
    pool = Pool("chat", "prod", {"model": {"name": "tiny", "source": {"path": "/m"}}, "replicas": 3, "mode": "auto",
                                 "engine": {"tokenBudget": 256, "chunkSize": 64}})
    ready = {"replicas": 3, "readyReplicas": 3, "updatedReplicas": 3, "conditions": []}
    slo = {"latency": {"windowSeconds": 300}, "controller": {}, "sloMet": ("True", "SLOMet", "ok"), "flapping": False,
           "shape": {"colocated": 1, "interactive": 1, "prefill": 1}}
    status = build_status(pool, pool.roles(), Observed({"chat-auto": ready}, slo=slo), {}, at(1))
    assert status["shape"] == {"colocated": 1, "interactive": 1, "prefill": 1}
    ready_condition = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready_condition["message"] == "3/3 engine replicas ready; shape colocated: 1, interactive: 1, prefill: 1"


def test_a_reshape_event_names_the_shape_before_and_after():
    from cadenza.control.decide import Decision, Shape
    from cadenza.control.history import History
    from cadenza.operator.slo import event_message

    decision = Decision("reshape", "long prompts interfere: disaggregating one replica", True, History(),
                        move="disaggregate")
    assert event_message(decision, Shape(2, 0, 0)) == (
        "long prompts interfere: disaggregating one replica "
        "(shape colocated: 2, interactive: 0, prefill: 0 -> colocated: 1, interactive: 0, prefill: 1)")
    long = Decision("reshape", "x" * 2000, True, History(), move="aggregate")
    assert len(event_message(long, Shape(1, 0, 1))) == 1000 and event_message(long, Shape(1, 0, 1)).endswith(
        "prefill: 0)")
    assert event_message(Decision("retune", "shrink", True, History()), Shape(2)) == "shrink"
