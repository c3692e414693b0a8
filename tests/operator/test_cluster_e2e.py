"""Against a real cluster (kind, k3d, or any): skipped unless ``$KUBECONFIG`` names one.

Installs the CRD, runs the operator in-process against the cluster, applies the quickstart pool
in a throw-away namespace, checks the objects and status, then deletes everything. With
``CADENZA_E2E_IMAGE`` set to a cadenza image the cluster can pull, it also waits for the replicas
and the gateway to become ready and sends a chat completion through the gateway Service (via the
API server's service proxy).
"""

from __future__ import annotations

import collections
import os
import time
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "serving.cadenza.dev", "v1alpha1", "servingpools"


def _real_cluster() -> str | None:
    path = os.environ.get("KUBECONFIG")
    if not path or not Path(path).is_file():
        return "KUBECONFIG does not name a kubeconfig file"
    try:
        import kubernetes

        kubernetes.config.load_kube_config(config_file=path)
        kubernetes.client.VersionApi().get_code(_request_timeout=5)
    except Exception as exc:  # unreachable, no credentials, not a cluster
        return f"no reachable cluster behind KUBECONFIG ({type(exc).__name__})"
    return None


reason = _real_cluster()
pytestmark = pytest.mark.skipif(reason is not None, reason=f"cluster e2e: {reason}")


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def namespace():
    import kubernetes

    core = kubernetes.client.CoreV1Api()
    ext = kubernetes.client.ApiextensionsV1Api()
    crd = yaml.safe_load((ROOT / "manifests/crd/servingpools.yaml").read_text())
    try:
        ext.create_custom_resource_definition(crd)
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise
    name = f"cadenza-e2e-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


def test_quickstart_pool_in_a_real_cluster(namespace):
    import kubernetes
    from kopf.testing import KopfRunner

    pool = yaml.safe_load((ROOT / "manifests/examples/quickstart-cpu.yaml").read_text())
    pool["metadata"]["namespace"] = namespace
    image = os.environ.get("CADENZA_E2E_IMAGE")
    if image:
        pool["spec"]["image"] = image
    custom = kubernetes.client.CustomObjectsApi()
    apps = kubernetes.client.AppsV1Api()
    name = pool["metadata"]["name"]
    with KopfRunner(["run", "--standalone", "--namespace", namespace, "-m", "cadenza.operator.handlers"],
                    timeout=900) as runner:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, pool)
        wait_for(lambda: {d.metadata.name for d in apps.list_namespaced_deployment(namespace).items}
                 == {f"{name}-colocated", f"{name}-gateway"}, 60, "deployments")
        status = wait_for(lambda: custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
                          .get("status", {}).get("mode"), 60, "status")
        assert status == "colocated"
        if image:
            wait_for(lambda: custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
                     ["status"].get("ready") == f"{pool['spec']['replicas']}/{pool['spec']['replicas']}",
                     600, "replicas ready")
            core = kubernetes.client.CoreV1Api()
            body = core.connect_post_namespaced_service_proxy_with_path(
                f"{name}-gateway:http", namespace, "v1/chat/completions",
                body={"model": pool["spec"]["model"]["name"], "max_tokens": 8,
                      "messages": [{"role": "user", "content": "Say hi"}]})
            assert "choices" in str(body)
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        wait_for(lambda: not apps.list_namespaced_deployment(namespace).items, 120, "cleanup")
    assert runner.exit_code == 0, runner.output


def test_server_side_apply_migrates_old_objects_and_removes_what_a_rendering_drops(namespace):
    """What kmock cannot show: fields a new rendering drops are removed by server-side apply, an
    object an older operator applied client-side (its ``last-applied`` annotation) is migrated so
    its stale fields go too, and a pool deleted while no operator runs is gone at once, its
    children garbage-collected; the finalizer an earlier operator added is removed."""
    import json

    import kubernetes
    from kopf.testing import KopfRunner

    from cadenza.operator import ssa

    pool = yaml.safe_load((ROOT / "manifests/examples/quickstart-cpu.yaml").read_text())
    name = pool["metadata"]["name"] = "ssa"
    pool["metadata"]["namespace"] = namespace
    pool["spec"]["resources"] = {"limits": {"cpu": "2", "memory": "4Gi"}}
    pool["metadata"]["finalizers"] = ["serving.cadenza.dev/finalizer"]  # as earlier operators added (kmock
    # cannot apply the JSON patch kopf removes it with)
    custom, apps, core = (kubernetes.client.CustomObjectsApi(), kubernetes.client.AppsV1Api(),
                          kubernetes.client.CoreV1Api())
    uid = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, pool)["metadata"]["uid"]
    # What an older operator left: its rendering in the annotation, with a label this one drops.
    old = {"apiVersion": "v1", "kind": "Service", "metadata": {
        "name": f"{name}-batch", "namespace": namespace,
        "labels": {"serving.cadenza.dev/pool": name, "app.kubernetes.io/managed-by": "cadenza-operator", "legacy": "yes"},
        "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "ServingPool", "name": name, "uid": uid,
                             "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"selector": {"serving.cadenza.dev/pool": name}, "ports": [{"name": "http", "port": 80}]}}
    old["metadata"]["annotations"] = {ssa.LAST_APPLIED: json.dumps(old, sort_keys=True)}
    core.create_namespaced_service(namespace, old)

    def engine_limits():
        dep = apps.read_namespaced_deployment(f"{name}-colocated", namespace)
        return dep.spec.template.spec.containers[0].resources.limits

    with KopfRunner(["run", "--standalone", "--namespace", namespace, "-m", "cadenza.operator.handlers"],
                    timeout=300) as runner:
        svc = wait_for(lambda: (s := core.read_namespaced_service(f"{name}-batch", namespace)).spec.cluster_ip == "None"
                       and s, 60, "the class Service migrated (and headless)")
        assert "legacy" not in svc.metadata.labels and ssa.LAST_APPLIED not in (svc.metadata.annotations or {})
        managers = {(f.manager, f.operation) for f in svc.metadata.managed_fields}
        assert (ssa.FIELD_MANAGER, "Apply") in managers
        assert wait_for(lambda: engine_limits(), 60, "the engine Deployment") == {"cpu": "2", "memory": "4Gi"}
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                              {"spec": {"resources": {"limits": {"cpu": None, "memory": "4Gi"}}}})
        wait_for(lambda: engine_limits() == {"memory": "4Gi"}, 60, "the dropped CPU limit removed")
        apps.patch_namespaced_deployment(f"{name}-colocated", namespace, {"spec": {"replicas": 5}})  # kubectl scale
        wait_for(lambda: apps.read_namespaced_deployment(f"{name}-colocated", namespace).spec.replicas
                 == pool["spec"]["replicas"], 60, "replicas set back")
        wait_for(lambda: not custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
                 ["metadata"].get("finalizers"), 30, "the earlier operators' finalizer removed")
    assert runner.exit_code == 0, runner.output
    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)  # no operator runs
    wait_for(lambda: not custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"], 30,
             "the pool gone without an operator")
    wait_for(lambda: not apps.list_namespaced_deployment(namespace, label_selector=f"serving.cadenza.dev/pool={name}")
             .items, 120, "its children garbage-collected")


def _events(core, namespace: str, name: str) -> collections.Counter:
    """``(reason, message)`` of the Events about pool ``name``, counted (each Event object once,
    whatever its ``count``: the operator posts a new one for each change)."""
    items = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    return collections.Counter((e.reason, e.message) for e in items if e.involved_object.kind == "ServingPool")


def test_a_pool_that_changed_mode_converges_and_still_repairs_drift(namespace):
    """The quickstart pool created ``dedicated``, switched to ``colocated``: the class Services
    lose the role key, the operator then writes nothing and posts no Event per resync, and a hand
    edit of an engine Deployment's image is set back — the old role's while the shift waits for
    the new one (without ``CADENZA_E2E_IMAGE`` no pod becomes ready, so it waits throughout), the
    new role's once it serves."""
    import kubernetes
    from kopf.testing import KopfRunner

    from cadenza.operator.resync import RESYNC_S

    pool = yaml.safe_load((ROOT / "manifests/examples/quickstart-cpu.yaml").read_text())
    name = pool["metadata"]["name"] = "shift"
    pool["metadata"]["namespace"] = namespace
    pool["spec"]["mode"] = "dedicated"
    image = os.environ.get("CADENZA_E2E_IMAGE")
    if image:
        pool["spec"]["image"] = image
    custom, apps, core = (kubernetes.client.CustomObjectsApi(), kubernetes.client.AppsV1Api(),
                          kubernetes.client.CoreV1Api())

    def deployments():
        return {d.metadata.name for d in apps.list_namespaced_deployment(
            namespace, label_selector=f"serving.cadenza.dev/pool={name}").items}

    def image_of(deployment):
        try:
            return apps.read_namespaced_deployment(deployment, namespace).spec.template.spec.containers[0].image
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None  # retired meanwhile
            raise

    def hand_edit(deployment):  # kubectl set image deployment/NAME engine=evil:latest
        apps.patch_namespaced_deployment(deployment, namespace, {"spec": {"template": {"spec": {
            "containers": [{"name": "engine", "image": "evil:latest"}]}}}})

    def services():
        return {cls: core.read_namespaced_service(f"{name}-{cls}", namespace) for cls in ("interactive", "batch")}

    with KopfRunner(["run", "--standalone", "--namespace", namespace, "-m", "cadenza.operator.handlers"],
                    timeout=900) as runner:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, pool)
        wait_for(lambda: deployments() == {f"{name}-interactive", f"{name}-batch", f"{name}-gateway"}, 60, "dedicated")
        applied = image_of(f"{name}-batch")
        if image:
            wait_for(lambda: custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
                     ["status"].get("ready") == "2/2", 600, "dedicated replicas ready")
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {"spec": {"mode": "colocated"}})
        wait_for(lambda: f"{name}-colocated" in deployments(), 60, "the colocated role")
        hand_edit(f"{name}-batch")
        wait_for(lambda: image_of(f"{name}-batch") in (applied, None), 60, "the old role's image set back")
        wait_for(lambda: all(s.spec.selector == {"serving.cadenza.dev/pool": name,
                                                 "app.kubernetes.io/component": "engine"}
                             for s in services().values()), 60, "the role key gone from the class Services")
        if image:
            wait_for(lambda: deployments() == {f"{name}-colocated", f"{name}-gateway"}, 600, "the shift done")

        # Converged: no write to the Services and no Event per resync.
        time.sleep(3 * RESYNC_S)
        versions, posted = {cls: s.metadata.resource_version for cls, s in services().items()}, _events(core, namespace, name)
        time.sleep(5 * RESYNC_S)
        assert {cls: s.metadata.resource_version for cls, s in services().items()} == versions
        assert _events(core, namespace, name) == posted

        hand_edit(f"{name}-colocated")
        wait_for(lambda: image_of(f"{name}-colocated") == applied, 60, "the engine's image set back")
        time.sleep(3 * RESYNC_S)
        assert _events(core, namespace, name) - posted == {("Updated", f"Deployment {name}-colocated"): 1}
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    assert runner.exit_code == 0, runner.output


def test_a_disaggregated_pools_kv_port_policy_is_accepted_held_and_removed_with_the_mode(namespace):
    """The KV NetworkPolicy as a real API server stores it (its schema is the server's), set back
    after a hand edit, and — with ``CADENZA_E2E_IMAGE``, once the shift to ``colocated`` is done —
    deleted. Whether traffic is filtered depends on the cluster's network plugin, not tested here."""
    import kubernetes
    from kopf.testing import KopfRunner

    from cadenza.operator import render
    from cadenza.pool.spec import Pool
    from cadenza.pool.validate import validate_pool

    pool = yaml.safe_load((ROOT / "manifests/examples/quickstart-cpu.yaml").read_text())
    name = pool["metadata"]["name"] = "kv"
    pool["metadata"]["namespace"] = namespace
    pool["spec"]["mode"] = "disaggregated"
    image = os.environ.get("CADENZA_E2E_IMAGE")
    if image:
        pool["spec"]["image"] = image
    custom, apps = kubernetes.client.CustomObjectsApi(), kubernetes.client.AppsV1Api()
    net = kubernetes.client.NetworkingV1Api()
    client = kubernetes.client.ApiClient()
    expected = next(obj["spec"] for obj in render.render_all(Pool(name, namespace, validate_pool(pool)["spec"]))
                    if obj["kind"] == "NetworkPolicy")

    def policy():
        try:
            return client.sanitize_for_serialization(net.read_namespaced_network_policy(f"{name}-kv", namespace))
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    with KopfRunner(["run", "--standalone", "--namespace", namespace, "-m", "cadenza.operator.handlers"],
                    timeout=900) as runner:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, pool)
        stored = wait_for(policy, 60, "the KV NetworkPolicy")
        assert stored["spec"] == expected
        opened = [expected["ingress"][0], {**expected["ingress"][1], "from": [
            {**expected["ingress"][1]["from"][0], "namespaceSelector": {}}]}]
        net.patch_namespaced_network_policy(f"{name}-kv", namespace, {"spec": {"ingress": opened}})
        wait_for(lambda: policy()["spec"] == expected, 60, "the KV rule set back")
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {"spec": {"mode": "colocated"}})
        if image:
            wait_for(lambda: {d.metadata.name for d in apps.list_namespaced_deployment(
                namespace, label_selector=f"serving.cadenza.dev/pool={name}").items}
                == {f"{name}-colocated", f"{name}-gateway"}, 900, "the shift done")
            wait_for(lambda: policy() is None, 60, "the KV NetworkPolicy deleted")
        else:  # no pod becomes ready: the shift waits, and the old KV pods stay covered
            time.sleep(5)
            assert policy() is not None
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    assert runner.exit_code == 0, runner.output
