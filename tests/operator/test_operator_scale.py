"""The scale check: 100 pools on the emulator, and the API calls the operator makes per resync
once they have converged — bounded, and the same however long nothing changes."""

from __future__ import annotations

import collections
import time

import kubernetes
import pytest
from kopf.testing import KopfRunner
from waiting import wait_until

from cadenza.operator.resync import RESYNC_S

GROUP, VERSION, PLURAL = "serving.cadenza.dev", "v1alpha1", "servingpools"
POOLS = f"{GROUP}/{VERSION}/{PLURAL}"
OPERATOR = ["run", "--standalone", "--all-namespaces", "-m", "cadenza.operator.handlers"]
N = 100


def pool_body(i: int) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ServingPool",
            "metadata": {"name": f"pool-{i:03d}", "namespace": "default", "uid": f"uid-{i}", "resourceVersion": "1"},
            "spec": {"model": {"name": "tiny", "source": {"path": "/models/tiny"}}, "replicas": 1,
                     "engine": {"tokenBudget": 256, "chunkSize": 64}}}


def calls_during(api, seconds: float) -> collections.Counter:
    before = len(api.requests())
    time.sleep(seconds)
    return collections.Counter(f"{method} {path}" for method, path in api.requests()[before:])


@pytest.mark.slow  # 100 pools: about a minute on 2 cores
def test_a_hundred_converged_pools_cost_no_api_call_per_resync(api):
    custom, apps = kubernetes.client.CustomObjectsApi(), kubernetes.client.AppsV1Api()
    with KopfRunner(OPERATOR, timeout=300) as runner:
        wait_until(lambda: api.watchers(POOLS), 30, "the operator to watch ServingPools")
        for i in range(N):
            custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, pool_body(i))
        wait_until(lambda: len(api.objects("apps/v1/deployments")) == 2 * N, 240, "every pool's Deployments",
                   interval=0.5)
        for _ns, name in api.objects("apps/v1/deployments"):  # play the Deployment controller: all ready
            apps.patch_namespaced_deployment_status(name, "default", {"status": {
                "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}})

        def converged():
            items = custom.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL)["items"]
            return len(items) == N and all(p.get("status", {}).get("ready") == "1/1" for p in items)

        wait_until(converged, 120, "every pool ready in its status", interval=0.5)
        time.sleep(3 * RESYNC_S)  # the handlers' last passes settle
        to_converge = len(api.requests())
        resyncs = 5
        first = calls_during(api, resyncs * RESYNC_S)
        second = calls_during(api, resyncs * RESYNC_S)
        # The loop is alive: a hand edit is set back within a resync or two, at the cost of one write.
        before = len(api.requests())
        apps.patch_namespaced_deployment("pool-042-colocated", "default", {"spec": {"replicas": 5}})
        wait_until(lambda: api.objects("apps/v1/deployments")[("default", "pool-042-colocated")]["spec"]["replicas"]
                   == 1, 10 * RESYNC_S, "the hand edit set back")
        time.sleep(2 * RESYNC_S)
        repair = collections.Counter(f"{m} {p}" for m, p in api.requests()[before + 1:])
    assert runner.exit_code == 0, runner.output
    print(f"\n{N} pools converged in {to_converge} API calls ({to_converge / N:.1f} a pool, watches included); "
          f"then over {resyncs} resyncs: {sum(first.values())} calls, and {sum(second.values())} over the next "
          f"{resyncs}: {dict(first)} / {dict(second)}; a hand edit set back in: {dict(repair)}")
    # Children come from the watches, status is patched only when it changed, the admin token is
    # read once: a converged pool costs no call per resync, however many resyncs pass.
    assert sum(first.values()) == 0 and sum(second.values()) == 0
    # (and the Event saying so: the emulator names Events from generateName, as the API server does)
    assert repair == {"PATCH /apis/apps/v1/namespaces/default/deployments/pool-042-colocated": 1,
                      "POST /api/v1/namespaces/default/events": 1}, repair
    # and the API server is asked only for the pools' children, not every Deployment of the cluster
    watches = {query for method, path, query in api.requests(query=True)
               if method == "GET" and path == "/apis/apps/v1/deployments" and "watch=" in query}
    assert watches and all("labelSelector=app.kubernetes.io/managed-by%3Dcadenza-operator" in q for q in watches), watches
