"""The resync loop's pass over a pool: drift repaired, an invalid spec left quiet, the pool as it
is now, and each source read once a pass."""

from __future__ import annotations

import kopf
from fake_cluster import BODY
from metrics_server import FakeEngine, serve_metrics

from cadenza.gateway.metrics import GatewayMetrics
from cadenza.operator import kube, render
from cadenza.operator.children import CHILD_KINDS, Children


def test_the_resync_timer_recreates_a_child_deleted_by_hand_and_leaves_the_rest(cluster):
    cluster.run(BODY)
    cluster["existing"].discard(("Deployment", "chat-gateway"))  # kubectl delete deploy chat-gateway
    cluster["events"].clear()
    status = cluster.resync(BODY)
    assert cluster["events"] == [("Normal", "Created", "Deployment chat-gateway")]
    assert status["mode"] == "colocated"


def test_the_resync_timer_is_quiet_about_an_invalid_spec(cluster):
    bad = {**BODY, "spec": {**BODY["spec"], "engine": {"tokenBudget": 128, "chunkSize": 256}}}
    assert cluster.resync(bad) is None
    assert cluster["applied"] == [] and cluster["events"] == []


def test_a_resync_applies_the_pool_as_it_is_now_and_leaves_a_terminating_pool_alone(cluster, monkeypatch):
    """A pass copies every pool at its start; a reconcile of a newer spec may run before this
    pool's turn. The resync reads the pool again under its lock, so it never applies the old one."""
    cluster.run(BODY)
    newer = {**BODY, "spec": {**BODY["spec"], "replicas": 4}}
    cluster.operator.pools = {("prod", "chat"): [kopf.Body(newer)]}
    cluster.resync(BODY)  # the pass's older copy
    assert cluster["objects"][("Deployment", "chat-colocated")]["spec"]["replicas"] == 4
    cluster["applied"].clear()
    terminating = {**newer, "metadata": {**newer["metadata"], "deletionTimestamp": "2026-12-03T00:00:00Z"}}
    cluster.operator.pools = {("prod", "chat"): [kopf.Body(terminating)]}
    assert cluster.resync(BODY) is None and cluster["applied"] == []  # its children go with it: none made again


class CountedMetrics:
    """A ``/metrics`` source that counts how often it is read (one per GET)."""

    def __init__(self, metrics) -> None:
        self.metrics, self.gets = metrics, 0

    def prometheus_text(self) -> bytes:
        self.gets += 1
        return self.metrics.prometheus_text()


def test_one_resync_of_a_converged_pool_reads_each_source_once(cluster, monkeypatch):
    """A disaggregated pool with SLOs: its disaggregation threshold and its SLO signals come from
    one scrape of its pods' ``/metrics`` (real loopback servers, one GET each), its pods are
    listed once per component, and its children come from the watches (no read from the API)."""
    gateway = GatewayMetrics([0.05, 0.5], otlp=False)
    gateway.disagg_threshold = lambda: 700
    for _ in range(5):
        gateway.ttft.record(0.2, {"cadenza.traffic_class": "interactive"})
    sources = {("gateway", "chat-gateway-0"): CountedMetrics(gateway),
               ("engine", "chat-prefill-0"): CountedMetrics(FakeEngine().telemetry),
               ("engine", "chat-decode-0"): CountedMetrics(FakeEngine().telemetry)}
    servers = {key: serve_metrics(source) for key, source in sources.items()}
    listed, reads = [], []

    def list_pods(namespace, labels):
        listed.append(dict(labels))
        return [{"name": name, "labels": {render.COMPONENT_LABEL: component}, "ip": "127.0.0.1",
                 "port": servers[component, name].server_address[1], "ready": True, "problem": None}
                for component, name in sources if component == labels.get(render.COMPONENT_LABEL)]

    try:
        monkeypatch.setattr(kube, "ensure_secret_token", lambda meta, token: token)
        monkeypatch.setattr(kube, "list_pods", list_pods)
        body = {**BODY, "spec": {**BODY["spec"], "mode": "disaggregated", "disaggregated": {"prefillReplicas": 1},
                                 "slo": {"interactive": {"ttftP99Ms": 500, "itlP99Ms": 50}}}}
        body["status"] = cluster.run(body)["status"]
        ready = {"status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "observedGeneration": 1},
                 "metadata": {"generation": 1}}
        index = {kind: {} for kind in CHILD_KINDS}
        for kind, name in cluster["existing"]:
            index[kind][("prod", name)] = [{"kind": kind, "metadata": {"name": name},
                                            **(ready if kind == "Deployment" else {})}]
        cluster.operator.children = Children(index)  # converged, as the watches see it
        monkeypatch.setattr(kube, "read", lambda *a: reads.append(("read", a)))
        monkeypatch.setattr(kube, "deployment_status", lambda *a: reads.append(("deployment_status", a)))

        for _ in range(2):
            listed.clear()
            for source in sources.values():
                source.gets = 0
            status = cluster.resync(body) or body["status"]
            assert {name: source.gets for (_c, name), source in sources.items()} == {
                "chat-gateway-0": 1, "chat-prefill-0": 1, "chat-decode-0": 1}
            assert listed == [{render.POOL_LABEL: "chat", render.COMPONENT_LABEL: "gateway"},
                              {render.POOL_LABEL: "chat", render.COMPONENT_LABEL: "engine"}]
            assert reads == []
            # both readers had what they needed from that one scrape
            assert status["disaggregated"]["minPromptTokens"] == 700
            assert "latency" in status and any(c["type"] == "SLOMet" for c in status["conditions"])
            body["status"] = status
    finally:
        for server in servers.values():
            server.shutdown()
        gateway.shutdown()


def test_a_pool_that_leaves_auto_and_comes_back_starts_its_loop_again_from_its_status(cluster, monkeypatch):
    # auto -> a fixed mode without SLOs -> auto: the loop of the first auto spell (its roles are
    # of pods since replaced) is not resumed; the new one reads status.controller, as after a restart
    import copy

    from cadenza.control.in_place import InPlace
    from cadenza.operator import k8s_roles
    from cadenza.operator.memo import pool_uid

    monkeypatch.setattr(kube, "ensure_secret_token", lambda meta, token: token)
    monkeypatch.setattr(k8s_roles, "scrape_pool", lambda pool: None)

    def body(mode: str) -> dict:
        b = copy.deepcopy(BODY)
        b["spec"]["mode"] = mode
        return b

    cluster.run(body("auto"))
    cluster.resync(body("auto"))
    state = cluster.operator.state(pool_uid(BODY["metadata"]))
    first = state.control
    assert isinstance(first.actuation, InPlace)
    cluster.resync(body("colocated"))
    assert state.control is None
    cluster.resync(body("auto"))
    assert isinstance(state.control.actuation, InPlace) and state.control is not first
