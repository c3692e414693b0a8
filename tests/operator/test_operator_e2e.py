"""The operator end to end: kopf (in a thread) against kmock's Kubernetes emulator over real HTTP."""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path

import kubernetes
import pytest
import yaml
from kopf.testing import KopfRunner

from cadenza.operator.render import CONFIG_HASH
from metrics_server import FakeEngine, serve_metrics
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "serving.cadenza.dev", "v1alpha1", "servingpools"
POOLS = f"{GROUP}/{VERSION}/{PLURAL}"
OPERATOR = ["run", "--standalone", "--all-namespaces", "-m", "cadenza.operator.handlers"]


def wait_for(predicate, timeout=30.0, what=""):
    return wait_until(predicate, timeout, what, interval=0.05)


def operator_watching(api) -> None:
    """Return once the operator's watch of ServingPools is open: a pool created later is seen as created."""
    wait_for(lambda: api.watchers(POOLS), what="the operator to watch ServingPools")


def pool_body(name="chat", **spec):
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "ServingPool",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": {"model": {"name": "tiny", "source": {"path": "/models/tiny"}}, "replicas": 2,
                 "engine": {"tokenBudget": 256, "chunkSize": 64}, **spec},
    }


def custom():
    return kubernetes.client.CustomObjectsApi()


def patch_pool(spec: dict, name="chat"):
    custom().patch_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name, {"spec": spec})


def get_pool(name="chat"):
    return custom().get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, name)


def names(api, resource):
    return {name for (_ns, name) in api.objects(resource)}


def deployment(api, name):
    return api.objects("apps/v1/deployments").get(("default", name))


def mark_ready(*names: str) -> bool:
    """Play the Deployment controller kmock lacks: report every replica of ``names`` ready."""
    apps = kubernetes.client.AppsV1Api()
    for name in names:
        try:
            replicas = apps.read_namespaced_deployment(name, "default").spec.replicas
        except kubernetes.client.ApiException:
            continue  # not created yet
        apps.patch_namespaced_deployment_status(name, "default", {"status": {
            "replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas}})
    return True


def engine_resources(api, name):
    dep = deployment(api, name)
    return dep and dep["spec"]["template"]["spec"]["containers"][0].get("resources")


def args_of(dep):
    return dep["spec"]["template"]["spec"]["containers"][0]["args"]


def condition(pool, kind):
    return next((c for c in pool.get("status", {}).get("conditions", []) if c["type"] == kind), None)


EXPECTED_COLOCATED = {"chat-colocated", "chat-gateway"}
WRITES = ("POST", "PATCH", "PUT", "DELETE")


def events(api, pool: str = "chat") -> list[tuple[str, str]]:
    """``(reason, message)`` of the Events posted about ``pool`` so far, in no particular order."""
    return [(e["reason"], e.get("message", "")) for e in api.objects("v1/events").values()
            if e.get("involvedObject", {}).get("name") == pool]


def writes_during(api, resyncs: int) -> list[tuple[str, str]]:
    """The writes the emulator served while ``resyncs`` resync periods passed."""
    from cadenza.operator.resync import RESYNC_S

    before = len(api.requests())
    time.sleep(resyncs * RESYNC_S)
    return [r for r in api.requests()[before:] if r[0] in WRITES]


def image_of(api, name: str) -> str:
    return deployment(api, name)["spec"]["template"]["spec"]["containers"][0]["image"]


def hand_edit_image(name: str) -> None:
    """``kubectl set image deployment/NAME engine=evil:latest``."""
    kubernetes.client.AppsV1Api().patch_namespaced_deployment(name, "default", {"spec": {"template": {"spec": {
        "containers": [{"name": "engine", "image": "evil:latest"}]}}}})


@pytest.mark.slow  # mode shifts wait for the operator's resync timer
def test_a_pool_becomes_its_objects_and_follows_every_change(api):
    with KopfRunner(OPERATOR, timeout=60) as runner:
        operator_watching(api)
        custom().create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, pool_body())

        # Created: Deployments, Services, ConfigMap, PDB and the gateway's RBAC, all owned by the pool.
        wait_for(lambda: names(api, "apps/v1/deployments") == EXPECTED_COLOCATED, what="deployments")
        assert names(api, "v1/services") == {"chat-interactive", "chat-batch", "chat-gateway"}
        assert names(api, "v1/configmaps") == {"chat-engine"}
        assert names(api, "policy/v1/poddisruptionbudgets") == {"chat-colocated", "chat-gateway"}
        assert names(api, "rbac.authorization.k8s.io/v1/roles") == {"chat-gateway"}
        for resource in ("apps/v1/deployments", "v1/services", "v1/configmaps"):
            for obj in api.objects(resource).values():
                assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-chat"
        engine = deployment(api, "chat-colocated")
        assert engine["spec"]["replicas"] == 2
        assert args_of(engine)[args_of(engine).index("--chunk-size") + 1] == "64"
        status = wait_for(lambda: get_pool().get("status", {}).get("mode") and get_pool()["status"], what="status")
        assert status["mode"] == "colocated" and status["replicas"] == 2 and status["ready"] == "0/2"
        assert condition(get_pool(), "Progressing")["status"] == "True"
        assert condition(get_pool(), "Degraded")["status"] == "False"

        # Replicas change: the Deployment is patched, its pods' template is not.
        template = engine["spec"]["template"]
        gateway = deployment(api, "chat-gateway")
        patch_pool({"replicas": 4})
        wait_for(lambda: deployment(api, "chat-colocated")["spec"]["replicas"] == 4, what="replicas patched")
        assert deployment(api, "chat-colocated")["spec"]["template"] == template

        # A knob: only the engine role rolls; the gateway is untouched.
        patch_pool({"engine": {"tokenBudget": 256, "chunkSize": 32}})
        wait_for(lambda: args_of(deployment(api, "chat-colocated"))[
            args_of(deployment(api, "chat-colocated")).index("--chunk-size") + 1] == "32", what="knob patched")
        assert deployment(api, "chat-colocated")["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH] != \
            template["metadata"]["annotations"][CONFIG_HASH]
        assert deployment(api, "chat-gateway") == gateway

        # Dedicated mode: the roles split, the class services select them, the colocated role goes.
        patch_pool({"mode": "dedicated", "dedicated": {"interactiveReplicas": 1}})
        # Make before break: the colocated role serves, and the class services keep selecting every
        # engine pod, until the new roles are ready.
        wait_for(lambda: names(api, "apps/v1/deployments") == {"chat-colocated", "chat-interactive", "chat-batch",
                                                               "chat-gateway"}, what="new roles beside the old")
        assert "serving.cadenza.dev/role" not in \
            api.objects("v1/services")[("default", "chat-interactive")]["spec"]["selector"]
        wait_for(lambda: condition(get_pool(), "Progressing")["reason"] == "ModeShift", what="ModeShift status")
        wait_for(lambda: mark_ready("chat-interactive", "chat-batch")
                 and names(api, "apps/v1/deployments") == {"chat-interactive", "chat-batch", "chat-gateway"},
                 what="the old role retired once the new ones are ready")
        assert deployment(api, "chat-interactive")["spec"]["replicas"] == 1
        assert deployment(api, "chat-batch")["spec"]["replicas"] == 3
        services = api.objects("v1/services")
        assert services[("default", "chat-interactive")]["spec"]["selector"]["serving.cadenza.dev/role"] == "interactive"
        wait_for(lambda: get_pool()["status"]["mode"] == "dedicated", what="status mode")

        assert not get_pool()["metadata"].get("finalizers")  # nothing holds a delete
    assert runner.exit_code == 0, runner.output

    # Delete, with no operator running (`kubectl delete -k manifests` takes it first): the pool
    # goes at once, and the garbage collector takes everything it owned.
    custom().delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "chat")
    assert not api.objects(POOLS)
    assert api.collect_garbage() >= 10
    assert not api.objects("apps/v1/deployments") and not api.objects("v1/services") and not api.objects("v1/configmaps")
    assert "Traceback" not in runner.output, runner.output[max(0, runner.output.find("Traceback") - 3000):][:8000]


@pytest.mark.slow  # waits for a resync
def test_a_hand_edit_is_reverted_within_a_resync_and_an_unchanged_pool_writes_nothing(api):
    from cadenza.operator import render, ssa
    from cadenza.pool.spec import Pool
    from cadenza.pool.validate import validate_pool

    with KopfRunner(OPERATOR, timeout=60) as runner:
        operator_watching(api)
        custom().create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, pool_body())
        wait_for(lambda: names(api, "apps/v1/deployments") == EXPECTED_COLOCATED, what="deployments")
        body = get_pool()
        pool = Pool("chat", "default", validate_pool({k: body[k] for k in ("apiVersion", "kind", "metadata", "spec")})["spec"])
        owner = {"name": "chat", "uid": body["metadata"]["uid"]}
        # converged: every child as the API holds it contains its rendering, so applying sends nothing
        assert {ssa.apply(obj) for obj in render.render_all(pool, owner)} == {"unchanged"}
        kubernetes.client.AppsV1Api().patch_namespaced_deployment(  # kubectl scale --replicas=9
            "chat-colocated", "default", {"spec": {"replicas": 9}})
        kubernetes.client.CoreV1Api().patch_namespaced_service(  # a selector pointed elsewhere by hand
            "chat-batch", "default", {"spec": {"selector": {"app.kubernetes.io/component": "gateway"}}})
        assert deployment(api, "chat-colocated")["spec"]["replicas"] == 9
        def selector():
            return api.objects("v1/services")[("default", "chat-batch")]["spec"]["selector"]

        wait_for(lambda: deployment(api, "chat-colocated")["spec"]["replicas"] == 2
                 and selector() == {"serving.cadenza.dev/pool": "chat", "app.kubernetes.io/component": "engine"},
                 timeout=40, what="replicas and the selector set back by the resync")
    assert runner.exit_code == 0, runner.output


@pytest.mark.slow
def test_a_teams_own_deployment_named_like_a_role_survives_the_pool(api):
    theirs = {"apiVersion": "apps/v1", "kind": "Deployment",
              "metadata": {"name": "chat-colocated", "namespace": "default", "labels": {"team": "search"}},
              "spec": {"replicas": 7, "selector": {"matchLabels": {"app": "theirs"}},
                       "template": {"metadata": {"labels": {"app": "theirs"}},
                                    "spec": {"containers": [{"name": "app", "image": "theirs:1"}]}}}}
    kubernetes.client.AppsV1Api().create_namespaced_deployment("default", theirs)
    with KopfRunner(OPERATOR, timeout=60) as runner:
        operator_watching(api)
        custom().create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, pool_body())
        wait_for(lambda: (condition(get_pool(), "Degraded") or {}).get("reason") == "Conflict", what="Conflict")
        assert "Deployment chat-colocated exists with no controller" in condition(get_pool(), "Degraded")["message"]
        assert deployment(api, "chat-gateway") is not None  # the rest of the pool is applied
        assert deployment(api, "chat-colocated")["spec"]["replicas"] == 7
        assert "ownerReferences" not in deployment(api, "chat-colocated")["metadata"]
        custom().delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "chat")
        wait_for(lambda: not api.objects(POOLS), what="pool gone")
        assert deployment(api, "chat-colocated")["spec"]["template"]["spec"]["containers"][0]["image"] == "theirs:1"
    assert runner.exit_code == 0, runner.output


@pytest.mark.slow
def test_back_from_dedicated_to_colocated_without_a_cpu_limit(api):
    """The shift back finishes, and the thread count the CPU limit set goes with it (a list: the
    applied rendering replaces it whole). That server-side apply also removes the map keys a
    rendering drops — the role in the class Services' selectors, the limit itself — kmock cannot
    show (it merges every PATCH): test_cluster_e2e.py checks it on a real API server."""
    body = pool_body(mode="dedicated", dedicated={"interactiveReplicas": 1},
                     resources={"limits": {"cpu": "2", "memory": "4Gi"}})
    with KopfRunner(OPERATOR, timeout=60) as runner:
        operator_watching(api)
        custom().create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)
        wait_for(lambda: engine_resources(api, "chat-batch") == {"limits": {"cpu": "2", "memory": "4Gi"}},
                 what="dedicated with limits")
        patch_pool({"mode": "colocated", "resources": {"limits": {"cpu": None, "memory": "4Gi"}}})
        wait_for(lambda: mark_ready("chat-colocated") and names(api, "apps/v1/deployments") == EXPECTED_COLOCATED,
                 what="roles merged")
        env = deployment(api, "chat-colocated")["spec"]["template"]["spec"]["containers"][0]["env"]
        assert "OMP_NUM_THREADS" not in {e["name"] for e in env}
    assert runner.exit_code == 0, runner.output


@pytest.mark.slow  # waits for several resyncs
def test_a_pool_that_changed_mode_converges_and_still_repairs_drift(api):
    """The quickstart pool created ``dedicated``, switched to ``colocated``: while the shift waits,
    a hand edit of the Deployment still serving is set back; once it is done, a resync writes
    nothing and posts no Event (the class Services' selectors lost the role key), and a hand edit
    of the engine Deployment is set back within a resync, with one Event saying so."""
    body = yaml.safe_load((ROOT / "manifests/examples/quickstart-cpu.yaml").read_text())
    body["metadata"].update(resourceVersion="1")
    body["spec"]["mode"] = "dedicated"
    name = body["metadata"]["name"]
    image = body["spec"].get("image") or "ghcr.io/cadenza-serving/cadenza:0.1.0"
    with KopfRunner(OPERATOR, timeout=120) as runner:
        operator_watching(api)
        custom().create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)
        wait_for(lambda: mark_ready(f"{name}-interactive", f"{name}-batch")
                 and (get_pool(name).get("status") or {}).get("ready") == "2/2", what="dedicated and ready")
        image = image_of(api, f"{name}-batch")
        patch_pool({"mode": "colocated"}, name=name)
        wait_for(lambda: condition(get_pool(name), "Progressing")["reason"] == "ModeShift", what="the shift")

        # The shift waits for the colocated role: the old roles serve meanwhile, held to what was applied.
        hand_edit_image(f"{name}-batch")
        wait_for(lambda: image_of(api, f"{name}-batch") == image, 10, "the serving old role's image set back")
        assert deployment(api, f"{name}-batch")["spec"]["replicas"] == 1  # not rescaled mid-shift

        wait_for(lambda: mark_ready(f"{name}-colocated")
                 and names(api, "apps/v1/deployments") == {f"{name}-colocated", f"{name}-gateway"}
                 and condition(get_pool(name), "Progressing")["reason"] != "ModeShift", what="the shift done")
        for cls in ("interactive", "batch"):
            assert api.objects("v1/services")[("default", f"{name}-{cls}")]["spec"]["selector"] == {
                "serving.cadenza.dev/pool": name, "app.kubernetes.io/component": "engine"}

        # Converged: no write and no Event per resync.
        writes_during(api, 2)  # the last status of the shift lands
        posted = collections.Counter(events(api, name))
        assert writes_during(api, 3) == []
        assert collections.Counter(events(api, name)) == posted

        hand_edit_image(f"{name}-colocated")
        wait_for(lambda: image_of(api, f"{name}-colocated") == image, 10, "the engine's image set back")
        wait_for(lambda: collections.Counter(events(api, name)) != posted, 5, "the repair's Event")
        assert writes_during(api, 3) == []
        assert collections.Counter(events(api, name)) - posted == {("Updated", f"Deployment {name}-colocated"): 1}
    assert runner.exit_code == 0, runner.output


def kv_policy(api, name="chat-kv"):
    return api.objects("networking.k8s.io/v1/networkpolicies").get(("default", name))


@pytest.mark.slow  # waits for resyncs
def test_a_disaggregated_pool_admits_its_kv_port_only_from_its_own_pods_until_it_leaves_the_mode(api):
    engine_pods = {"serving.cadenza.dev/pool": "chat", "app.kubernetes.io/component": "engine"}
    with KopfRunner(OPERATOR, timeout=120) as runner:
        operator_watching(api)
        custom().create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, pool_body(mode="disaggregated"))
        policy = wait_for(lambda: kv_policy(api), what="the KV NetworkPolicy")
        assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-chat"
        assert policy["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "cadenza-operator"
        assert policy["spec"]["podSelector"] == {"matchLabels": engine_pods, "matchExpressions": [
            {"key": "serving.cadenza.dev/role", "operator": "In", "values": ["decode", "prefill"]}]}
        rules = policy["spec"]["ingress"]
        assert rules == [{"ports": [{"protocol": "TCP", "port": 8000}]},
                         {"from": [{"podSelector": {"matchLabels": engine_pods}}],
                          "ports": [{"protocol": "TCP", "port": 9000}]}]

        # A hand edit that opens the KV port to every namespace is set back.
        opened = [rules[0], {**rules[1], "from": [{"podSelector": {"matchLabels": engine_pods},
                                                   "namespaceSelector": {}}]}]
        kubernetes.client.NetworkingV1Api().patch_namespaced_network_policy(
            "chat-kv", "default", {"spec": {"ingress": opened}})
        assert kv_policy(api)["spec"]["ingress"] == opened
        wait_for(lambda: kv_policy(api)["spec"]["ingress"] == rules, 10, "the KV rule set back")

        # Leaving the mode: the policy stays while the prefill and decode pods serve, then goes.
        mark_ready("chat-prefill", "chat-decode")
        patch_pool({"mode": "colocated"})
        wait_for(lambda: condition(get_pool(), "Progressing")["reason"] == "ModeShift", what="the shift")
        assert kv_policy(api) is not None
        wait_for(lambda: mark_ready("chat-colocated") and names(api, "apps/v1/deployments") == EXPECTED_COLOCATED,
                 what="the shift done")
        wait_for(lambda: kv_policy(api) is None, 10, "the KV NetworkPolicy deleted")
        writes_during(api, 2)  # the shift's last status lands
        assert writes_during(api, 3) == []
    assert runner.exit_code == 0, runner.output


def test_a_second_reconcile_changes_nothing_and_a_restart_converges_without_duplicates(api):
    with KopfRunner(OPERATOR, timeout=60) as runner:
        operator_watching(api)
        custom().create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, pool_body())
        wait_for(lambda: names(api, "apps/v1/deployments") == EXPECTED_COLOCATED, what="deployments")
        wait_for(lambda: get_pool().get("status", {}).get("mode"), what="status")
    assert runner.exit_code == 0, runner.output
    first = {r: api.objects(r) for r in ("apps/v1/deployments", "v1/services", "v1/configmaps")}

    # While the operator is down, the pool changes; a new operator resumes and converges.
    patch_pool({"replicas": 3, "mode": "dedicated", "dedicated": {"interactiveReplicas": 1}})
    with KopfRunner(OPERATOR, timeout=60) as runner:
        wait_for(lambda: mark_ready("chat-interactive", "chat-batch")
                 and names(api, "apps/v1/deployments") == {"chat-interactive", "chat-batch", "chat-gateway"},
                 what="converged after restart")
        assert deployment(api, "chat-batch")["spec"]["replicas"] == 2
        # The pass that retired the old role has ended: its status says the shift is over.
        wait_for(lambda: (pool := get_pool()).get("status", {}).get("ready") == "3/3"
                 and condition(pool, "Progressing")["reason"] != "ModeShift", what="the shift's last status")
    assert runner.exit_code == 0, runner.output
    # Idempotent: the objects the change did not touch are exactly as before (no re-create, no patch).
    after = api.objects("v1/configmaps"), api.objects("v1/services")
    assert api.objects("apps/v1/deployments")[("default", "chat-gateway")] == \
        first["apps/v1/deployments"][("default", "chat-gateway")]
    assert after[1][("default", "chat-gateway")] == first["v1/services"][("default", "chat-gateway")]
    assert len(api.objects("apps/v1/deployments")) == 3


def test_a_spec_only_the_engine_can_refuse_is_reported_not_retried(api):
    bad = pool_body("bad", mode="dedicated", replicas=2,
                    dedicated={"interactiveReplicas": 1, "engine": {"chunkSize": 512}})  # > tokenBudget 256
    with KopfRunner(OPERATOR, timeout=60) as runner:
        operator_watching(api)
        custom().create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, bad)
        pool = wait_for(lambda: condition(get_pool("bad"), "Degraded"), what="degraded condition")
        assert pool["status"] == "True" and pool["reason"] == "InvalidSpec" and "chunkSize" in pool["message"]
        # The condition is written when the handler that refused the spec has returned: had it
        # applied anything, it would be there now. (A retry would show at the end, as a second report.)
        assert not api.objects("apps/v1/deployments")  # nothing rolled out
        # Fixing the spec heals it.
        patch_pool({"dedicated": {"interactiveReplicas": 1, "engine": {"chunkSize": 128}}}, name="bad")
        wait_for(lambda: names(api, "apps/v1/deployments") == {"bad-interactive", "bad-batch", "bad-gateway"},
                 what="healed")  # nothing to retire: no wait for readiness
        wait_for(lambda: condition(get_pool("bad"), "Degraded")["status"] == "False", what="not degraded")
    assert runner.exit_code == 0, runner.output
    assert runner.output.count("invalid ServingPool") == 1  # a permanent error: reported once, not retried


class ScriptedGateway:
    """A gateway's /metrics on a loopback port, fed by the real histograms with chosen latencies."""

    def __init__(self) -> None:
        from cadenza.gateway.metrics import GatewayMetrics

        self.metrics = GatewayMetrics([0.05, 0.5])
        self.server = serve_metrics(self.metrics)
        self.port = self.server.server_address[1]

    def record(self, cls: str, ttft_s: float, itl_s: float, n: int) -> None:
        for _ in range(n):
            self.metrics.ttft.record(ttft_s, {"cadenza.traffic_class": cls})
            self.metrics.itl.record(itl_s, {"cadenza.traffic_class": cls})

    def close(self) -> None:
        self.server.shutdown()


def gateway_pod(port: int, component: str = "gateway") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"chat-{component}-0", "namespace": "default",
                         "labels": {"serving.cadenza.dev/pool": "chat", "app.kubernetes.io/component": component}},
            "spec": {"containers": [{"name": component, "image": "x", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


def test_a_pool_with_slos_reports_its_latency_and_slo_from_its_gateways_and_engines(api):
    gateway = ScriptedGateway()
    engine = FakeEngine()
    engine.load(used=80, waiting={"interactive": 3}, preempted={"interactive": 1})
    engine_server = serve_metrics(engine.telemetry)
    slo = {"interactive": {"ttftP99Ms": 500, "itlP99Ms": 50}}
    controller = {"fastWindowSeconds": 5, "windowSeconds": 10, "minSamples": 5, "staleSeconds": 30}
    try:
        with KopfRunner(OPERATOR, timeout=90) as runner:
            operator_watching(api)
            core = kubernetes.client.CoreV1Api()
            for component, port in (("gateway", gateway.port), ("engine", engine_server.server_address[1])):
                core.create_namespaced_pod("default", gateway_pod(port, component))
                core.patch_namespaced_pod_status(f"chat-{component}-0", "default",
                                                 {"status": gateway_pod(0)["status"]})
            custom().create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL,
                                                     pool_body(slo=slo, controller=controller))
            stop = threading.Event()

            def feed(itl_s: float):
                while not stop.wait(0.5):
                    gateway.record("interactive", 0.2, itl_s, 20)

            def slo_met():
                return (condition(get_pool(), "SLOMet") or {}).get("status")

            feeder = threading.Thread(target=feed, args=(0.2,), daemon=True)  # ITL 200 ms > 50 ms: a breach
            feeder.start()
            wait_for(lambda: slo_met() == "False", 60, "SLOMet False from the gateway's histograms")
            pool = get_pool()
            cond = condition(pool, "SLOMet")
            assert "interactive" in cond["message"] and "ITL p99" in cond["message"]
            latency = pool["status"]["latency"]
            assert latency["itlP99Ms"] > 50 and latency["requests"] >= 5 and latency["windowSeconds"] == 10
            # The engine pod's load, scraped beside the gateway's latency.
            assert latency["queueDepth"] == 3 and latency["kvUsage"] == pytest.approx(0.8)
            assert "queue 3, KV 80%" in pool["status"]["controller"]["lastDecision"]["reason"]
            memory = pool["status"]["controller"]
            assert memory["lastDecision"]["acted"] is False and "advisory" in memory["actuation"]
            assert memory["lastDecision"]["action"] in ("retune", "hold", "reshape")
            stop.set()
            feeder.join()
            stop.clear()
            feeder = threading.Thread(target=feed, args=(0.01,), daemon=True)  # now well within
            feeder.start()
            wait_for(lambda: slo_met() == "True", 60, "SLOMet True once it recovers")
            stop.set()
        assert runner.exception is None
    finally:
        gateway.close()
        engine_server.shutdown()


class ScriptedEngine:
    """An engine pod's admin API and /ready on a loopback port: records every PUT /admin/config."""

    def __init__(self, config: dict) -> None:
        import http.server
        import json

        self.config, self.puts, self.batch_running, self.interactive_running = dict(config), [], 0, 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, doc):
                body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                if self.path == "/ready":
                    zero = {"running": 0, "waiting": 0}
                    self._send({"status": "ready", "classes": {
                        "interactive": {"running": outer.interactive_running, "waiting": 0},
                        "batch": {"running": outer.batch_running, "waiting": 0}, "background": zero}})
                else:
                    assert self.headers["Authorization"].startswith("Bearer ")
                    self._send(outer.config)

            def do_PUT(self):  # noqa: N802
                doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.puts.append(doc)
                outer.config.update(doc)
                self._send(outer.config)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def engine_pod(name: str, port: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default",
                         "labels": {"serving.cadenza.dev/pool": "chat", "app.kubernetes.io/component": "engine",
                                    "serving.cadenza.dev/workload": "auto", "serving.cadenza.dev/role": "colocated"}},
            "spec": {"containers": [{"name": "engine", "image": "x", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


def pod_labels(name: str) -> dict:
    return kubernetes.client.CoreV1Api().read_namespaced_pod(name, "default").metadata.labels or {}


def test_an_auto_pool_moves_a_replica_in_place_and_back_across_an_operator_restart(api):
    gateway = ScriptedGateway()
    engines = {n: ScriptedEngine({"token_budget": 256, "chunk_size": 64, "step_time_target_ms": None})
               for n in ("chat-auto-a", "chat-auto-b")}
    spec = dict(mode="auto", slo={"interactive": {"ttftP99Ms": 500, "itlP99Ms": 50}},
                dedicated={"engine": {"chunkSize": 32, "maxNumSeqs": 16}},
                controller={"fastWindowSeconds": 5, "windowSeconds": 10, "minSamples": 5, "staleSeconds": 30,
                            "cooldownSeconds": 0, "dwellSeconds": 10, "bounds": {"chunkSize": {"min": 16, "max": 64}}})
    stop, itl = threading.Event(), {"s": 0.2}  # ITL 200 ms against a 50 ms target: a breach

    def feed():
        while not stop.wait(0.5):
            gateway.record("interactive", 0.2, itl["s"], 20)

    feeder = threading.Thread(target=feed, daemon=True)
    core = kubernetes.client.CoreV1Api()
    try:
        feeder.start()
        with KopfRunner(OPERATOR, timeout=120) as runner:
            operator_watching(api)
            for pod in (gateway_pod(gateway.port), *(engine_pod(n, e.port) for n, e in engines.items())):
                core.create_namespaced_pod("default", pod)
                core.patch_namespaced_pod_status(pod["metadata"]["name"], "default", {"status": pod["status"]})
            custom().create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, pool_body(**spec))
            wait_for(lambda: names(api, "v1/secrets") == {"chat-admin"}, what="the admin token Secret")
            # Settings first, then routing: each pod gets both class labels once it runs the colocated settings.
            wait_for(lambda: all(pod_labels(n).get("serving.cadenza.dev/serves-batch") == "true" for n in engines),
                     what="both pods routed")
            # Rung 1 first: chunk size shrinks on every colocated pod, through its admin API.
            wait_for(lambda: all(e.config["chunk_size"] == 16 for e in engines.values()), 60, "retuned to the bound")
            moved = wait_for(lambda: next((n for n in engines if pod_labels(n).get("serving.cadenza.dev/role")
                                           == "interactive"), None), 60, "a pod dedicated to interactive")
            labels = pod_labels(moved)
            assert "serving.cadenza.dev/serves-batch" not in labels
            assert labels["serving.cadenza.dev/serves-interactive"] == "true"
            assert engines[moved].puts[-1]["chunk_size"] == 32 and engines[moved].puts[-1]["max_num_seqs"] == 16
            pool = wait_for(lambda: (p := get_pool())["status"].get("shape") == {"colocated": 1, "interactive": 1,
                                                                                 "prefill": 0} and p,
                            what="status.shape")
            assert pool["status"]["controller"]["roles"][moved] == "interactive"
            assert condition(pool, "SLOMet")["status"] == "False"
        assert runner.exception is None

        # The operator restarts (its memory is gone: a new run makes a new memo); the recorded
        # shape holds, then recovery merges back.
        itl["s"] = 0.01
        with KopfRunner(OPERATOR, timeout=120) as runner:
            operator_watching(api)
            wait_for(lambda: pod_labels(moved).get("serving.cadenza.dev/role") == "colocated", 90,
                     "the pod given back once every class is clear")
            assert pod_labels(moved)["serving.cadenza.dev/serves-batch"] == "true"
            assert engines[moved].config["chunk_size"] == 16  # the colocated knobs, carried across the restart
            wait_for(lambda: get_pool()["status"].get("shape") == {"colocated": 2, "interactive": 0, "prefill": 0},
                     what="merged")
        assert runner.exception is None
        assert names(api, "v1/pods") == {"chat-gateway-0", *engines}  # no pod created or deleted
    finally:
        stop.set()
        gateway.close()
        for e in engines.values():
            e.close()



def scripted_decide(script: list[str]):
    """A stand-in for decide() that makes the moves in ``script`` one per tick, then holds: the
    actuation is what this test checks (driving the real signals to a long-prompt breach is the
    benchmark's job)."""
    from dataclasses import replace

    from cadenza.control.decide import Decision

    def decide(signals, shape, knobs, history, spec, now):
        if script:
            move = script.pop(0)
            return Decision("reshape", f"scripted: {move}", True, replace(history, last_action=now, last_reshape=now),
                            move=move)
        return Decision("hold", "scripted: holding", False, history)

    return decide


def selects(service: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


@pytest.mark.slow  # a kopf run
def test_an_auto_pool_moves_a_replica_into_the_prefill_role_and_back_in_place(api, monkeypatch):
    """Issue 31: disaggregate drains every class from the pod, gives it the prefill settings, then
    the labels the gateway's <pool>-prefill Service selects; aggregate brings it back; status,
    Events and the Ready message show the shape; no pod is created or deleted."""
    script: list[str] = []
    monkeypatch.setattr("cadenza.control.loop.decide", scripted_decide(script))
    gateway = ScriptedGateway()
    engines = {n: ScriptedEngine({"token_budget": 256, "chunk_size": 64, "step_time_target_ms": None})
               for n in ("chat-auto-a", "chat-auto-b")}
    spec = dict(mode="auto", slo={"interactive": {"itlP99Ms": 50}},
                disaggregated={"prefillEngine": {"chunkSize": 256}},
                controller={"fastWindowSeconds": 5, "windowSeconds": 10, "minSamples": 5, "cooldownSeconds": 0})
    core = kubernetes.client.CoreV1Api()
    try:
        with KopfRunner(OPERATOR, timeout=90) as runner:
            operator_watching(api)
            for pod in (gateway_pod(gateway.port), *(engine_pod(n, e.port) for n, e in engines.items())):
                core.create_namespaced_pod("default", pod)
                core.patch_namespaced_pod_status(pod["metadata"]["name"], "default", {"status": pod["status"]})
            custom().create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, pool_body(**spec))
            wait_for(lambda: all(pod_labels(n).get("serving.cadenza.dev/serves-batch") == "true" for n in engines),
                     what="both pods routed")
            prefill_service = wait_for(lambda: api.objects("v1/services").get(("default", "chat-prefill")),
                                       what="the prefill Service")
            moved, other = "chat-auto-b", "chat-auto-a"  # the last colocated pod is the one moved
            engines[moved].interactive_running = 1  # a stream still decoding there
            script.append("disaggregate")
            wait_for(lambda: "serving.cadenza.dev/serves-interactive" not in pod_labels(moved),
                     what="the pod out of every class route")
            time.sleep(3)  # a few ticks: it waits for the stream
            labels = pod_labels(moved)
            assert labels["serving.cadenza.dev/role"] == "colocated" and "serving.cadenza.dev/serves-batch" not in labels
            assert "serving.cadenza.dev/serves-prefill" not in labels and engines[moved].config["chunk_size"] == 64
            engines[moved].interactive_running = 0
            wait_for(lambda: pod_labels(moved).get("serving.cadenza.dev/role") == "prefill", what="a prefill pod")
            labels = pod_labels(moved)
            assert labels["serving.cadenza.dev/serves-prefill"] == "true"
            assert selects(prefill_service, labels) and not selects(prefill_service, pod_labels(other))
            assert engines[moved].config["chunk_size"] == 256  # disaggregated.prefillEngine, applied before the label
            assert engines[moved].config["step_time_target_ms"] is None
            pool = wait_for(lambda: (p := get_pool())["status"].get("shape") == {"colocated": 1, "interactive": 0,
                                                                                 "prefill": 1} and p,
                            what="status.shape with a prefill replica")
            assert pool["status"]["lastShift"]["move"] == "disaggregate"
            assert pool["status"]["lastShift"]["to"] == {"colocated": 1, "interactive": 0, "prefill": 1}
            ready = condition(pool, "Ready")["message"]
            assert ready.endswith("shape colocated: 1, interactive: 0, prefill: 1"), ready
            wait_for(lambda: any(reason == "Reshape" and message.endswith(
                "(shape colocated: 2, interactive: 0, prefill: 0 -> colocated: 1, interactive: 0, prefill: 1)")
                for reason, message in events(api)), what="the Event of the move")

            script.append("aggregate")
            wait_for(lambda: pod_labels(moved).get("serving.cadenza.dev/role") == "colocated", what="back to colocated")
            labels = pod_labels(moved)
            assert labels["serving.cadenza.dev/serves-batch"] == labels["serving.cadenza.dev/serves-interactive"] == "true"
            assert "serving.cadenza.dev/serves-prefill" not in labels and not selects(prefill_service, labels)
            assert engines[moved].config["chunk_size"] == 64
            wait_for(lambda: get_pool()["status"].get("shape") == {"colocated": 2, "interactive": 0, "prefill": 0},
                     what="status.shape back")
        assert runner.exception is None
        assert names(api, "v1/pods") == {"chat-gateway-0", *engines}  # no pod created or deleted
    finally:
        gateway.close()
        for e in engines.values():
            e.close()
