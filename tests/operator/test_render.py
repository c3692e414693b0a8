"""The pure renderers: what a ServingPool becomes in each mode, and what each knob changes."""

from __future__ import annotations

import copy
import json
import re

import pytest

from cadenza.pool.spec import Pool, PoolSpecError
from cadenza.operator.pods import KV_PORT
from cadenza.operator.render import (CONFIG_HASH, render_all, selector_string,
                                     stale_deployments, stale_services)

OWNER = {"name": "chat", "uid": "uid-123"}
BASE = {
    "model": {"name": "llama", "source": {"path": "/models/llama"}},
    "image": "cadenza:test",
    "replicas": 3,
    "engine": {"tokenBudget": 512, "chunkSize": 256, "stepTimeTargetMs": 120,
               "classes": {"batch": {"maxPrefillTokens": 128}}, "tenants": {"gold": {"weight": 3}}},
    "mode": "colocated",
    "dedicated": {"interactiveReplicas": 1, "engine": {"chunkSize": 64}},
}


def pool(**changes) -> Pool:
    spec = copy.deepcopy(BASE)
    spec.update(changes)
    return Pool("chat", "prod", spec)


def by_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def engine(objs: dict, role: str) -> dict:
    return objs[("Deployment", f"chat-{role}")]["spec"]["template"]["spec"]["containers"][0]


def test_colocated_pool_runs_one_engine_deployment_behind_class_services_and_a_gateway():
    objs = by_name(render_all(pool(), OWNER))
    assert set(objs) == {
        ("ConfigMap", "chat-engine"), ("Deployment", "chat-colocated"),
        ("Service", "chat-interactive"), ("Service", "chat-batch"), ("Service", "chat-gateway"),
        ("PodDisruptionBudget", "chat-colocated"), ("PodDisruptionBudget", "chat-gateway"),
        ("ServiceAccount", "chat-gateway"), ("Role", "chat-gateway"),
        ("RoleBinding", "chat-gateway"), ("Deployment", "chat-gateway"),
    }
    assert objs[("Deployment", "chat-colocated")]["spec"]["replicas"] == 3
    # In colocated mode both class services select every engine pod; the gateway dials the pods
    # their EndpointSlices list, so they are headless, and the gateway's own Service is not.
    for svc in ("chat-interactive", "chat-batch"):
        assert "serving.cadenza.dev/role" not in objs[("Service", svc)]["spec"]["selector"]
        assert objs[("Service", svc)]["spec"]["clusterIP"] == "None"
    assert "clusterIP" not in objs[("Service", "chat-gateway")]["spec"]
    disaggregated = by_name(render_all(pool(mode="disaggregated"), OWNER))
    assert disaggregated[("Service", "chat-prefill")]["spec"]["clusterIP"] == "None"


def test_every_object_is_owned_by_the_pool_and_namespaced():
    for obj in render_all(pool(), OWNER):
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["uid"] == "uid-123" and ref["kind"] == "ServingPool" and ref["controller"] is True
        assert obj["metadata"]["namespace"] == "prod"
        assert obj["metadata"]["labels"]["serving.cadenza.dev/pool"] == "chat"


def test_engine_knobs_become_serve_flags_and_a_policy_file():
    objs = by_name(render_all(pool(), OWNER))
    args = engine(objs, "colocated")["args"]
    assert args[:5] == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    assert args[args.index("--model") + 1] == "/models/llama" and "--served-model-name" in args
    assert args[args.index("--token-budget") + 1] == "512" and args[args.index("--chunk-size") + 1] == "256"
    assert args[args.index("--policy") + 1] == "/etc/cadenza/colocated.policy.json"
    policy = json.loads(objs[("ConfigMap", "chat-engine")]["data"]["colocated.policy.json"])
    assert policy == {"step_time_target_ms": 120, "classes": {"batch": {"max_prefill_tokens": 128}},
                      "tenants": {"gold": {"weight": 3}}}


def test_dedicated_mode_splits_roles_with_interactive_overrides():
    p = pool(mode="dedicated")
    objs = by_name(render_all(p, OWNER))
    assert objs[("Deployment", "chat-interactive")]["spec"]["replicas"] == 1
    assert objs[("Deployment", "chat-batch")]["spec"]["replicas"] == 2
    assert ("Deployment", "chat-colocated") not in objs
    inter, batch = engine(objs, "interactive")["args"], engine(objs, "batch")["args"]
    assert inter[inter.index("--chunk-size") + 1] == "64" and batch[batch.index("--chunk-size") + 1] == "256"
    assert inter[inter.index("--default-class") + 1] == "interactive"
    assert batch[batch.index("--default-class") + 1] == "batch"
    assert objs[("Service", "chat-interactive")]["spec"]["selector"]["serving.cadenza.dev/role"] == "interactive"
    assert objs[("Service", "chat-batch")]["spec"]["selector"]["serving.cadenza.dev/role"] == "batch"
    assert set(objs[("ConfigMap", "chat-engine")]["data"]) == {"interactive.policy.json", "batch.policy.json"}
    assert stale_deployments(p, p.roles()) == ["chat-colocated", "chat-auto", "chat-prefill", "chat-decode"]


def test_auto_mode_is_one_workload_whose_pods_get_roles_and_routing_in_place():
    objs = by_name(render_all(pool(mode="auto"), OWNER))
    assert [k for k in objs if k[0] == "Deployment"] == [("Deployment", "chat-auto"), ("Deployment", "chat-gateway")]
    dep = objs[("Deployment", "chat-auto")]
    selector = dep["spec"]["selector"]["matchLabels"]
    assert "serving.cadenza.dev/role" not in selector  # relabelling a pod's role keeps it in its ReplicaSet
    template = dep["spec"]["template"]["metadata"]["labels"]
    assert template["serving.cadenza.dev/role"] == "colocated" and all(template[k] == v for k, v in selector.items())
    # A new pod is routed nothing until the controller has applied its role's settings.
    assert not any(k.startswith("serving.cadenza.dev/serves-") for k in template)
    assert objs[("Service", "chat-interactive")]["spec"]["selector"]["serving.cadenza.dev/serves-interactive"] == "true"
    assert objs[("Service", "chat-batch")]["spec"]["selector"]["serving.cadenza.dev/serves-batch"] == "true"
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "CADENZA_ADMIN_TOKEN_FILE", "value": "/var/run/cadenza-admin/token"} in container["env"]
    volume = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "admin-token")
    assert volume["secret"]["secretName"] == "chat-admin"
    assert "CADENZA_ADMIN_TOKEN_FILE" not in str(by_name(render_all(pool(), OWNER))[("Deployment", "chat-colocated")])


def test_disaggregated_mode_runs_prefill_and_decode_roles_with_kv_endpoints_and_the_token():
    spec = {"prefillReplicas": 1, "prefillEngine": {"chunkSize": 512}, "decodeEngine": {"maxNumSeqs": 32}}
    p = pool(mode="disaggregated", disaggregated=spec)
    objs = by_name(render_all(p, OWNER))
    assert objs[("Deployment", "chat-prefill")]["spec"]["replicas"] == 1
    assert objs[("Deployment", "chat-decode")]["spec"]["replicas"] == 2
    prefill, decode = engine(objs, "prefill"), engine(objs, "decode")
    assert prefill["args"][prefill["args"].index("--chunk-size") + 1] == "512"
    assert decode["args"][decode["args"].index("--chunk-size") + 1] == "256"  # the base
    assert decode["args"][decode["args"].index("--max-num-seqs") + 1] == "32"
    for container in (prefill, decode):
        args = container["args"]
        assert args[args.index("--kv-transfer-port") + 1] == str(KV_PORT)
        assert args[args.index("--kv-transfer-host") + 1] == "$(POD_IP)"  # peers dial the pod, not 0.0.0.0
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["CADENZA_ADMIN_TOKEN_FILE"]["value"] == "/var/run/cadenza-admin/token"
        assert {"name": "kv", "containerPort": KV_PORT} in container["ports"]
    # every class decodes on the decode pods; the gateway finds prefill pods through their own Service
    role = "serving.cadenza.dev/role"
    assert objs[("Service", "chat-interactive")]["spec"]["selector"][role] == "decode"
    assert objs[("Service", "chat-batch")]["spec"]["selector"][role] == "decode"
    assert objs[("Service", "chat-prefill")]["spec"]["selector"][role] == "prefill"
    gateway = objs[("Deployment", "chat-gateway")]["spec"]["template"]["spec"]
    assert gateway["volumes"][0]["secret"]["secretName"] == "chat-admin"
    args = gateway["containers"][0]["args"]
    assert args[args.index("--disagg-min-prompt-tokens") + 1] == "auto"
    pinned = by_name(render_all(pool(mode="disaggregated", disaggregated={"minPromptTokens": 700}), OWNER))
    args = pinned[("Deployment", "chat-gateway")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--disagg-min-prompt-tokens") + 1] == "700"
    # leaving the mode deletes what only it runs
    assert stale_deployments(p, p.roles()) == ["chat-colocated", "chat-interactive", "chat-batch", "chat-auto"]
    assert stale_services(p) == ["chat"] and stale_services(pool()) == ["chat", "chat-prefill"]
    # no other mode runs a KV endpoint or gives the gateway the token
    colocated = by_name(render_all(pool(), OWNER))
    assert "--kv-transfer-port" not in engine(colocated, "colocated")["args"]
    assert "volumes" not in colocated[("Deployment", "chat-gateway")]["spec"]["template"]["spec"]


def test_an_auto_pool_that_may_disaggregate_renders_what_a_move_into_prefill_needs():
    """Issue 31: any auto pod may become a prefill replica in place (labels, live settings): each
    runs a KV endpoint, the KV NetworkPolicy covers it whatever role label it has, the gateway
    holds the token and the threshold, and finds the pods labelled serves-prefill."""
    p = pool(mode="auto", disaggregated={"minPromptTokens": 600})
    objs = by_name(render_all(p, OWNER))
    container = engine(objs, "auto")
    args = container["args"]
    assert args[args.index("--kv-transfer-port") + 1] == str(KV_PORT)
    assert args[args.index("--kv-transfer-host") + 1] == "$(POD_IP)"
    assert {"name": "kv", "containerPort": KV_PORT} in container["ports"]
    prefill = objs[("Service", "chat-prefill")]["spec"]
    assert prefill["clusterIP"] == "None" and prefill["selector"] == {
        "serving.cadenza.dev/pool": "chat", "app.kubernetes.io/component": "engine",
        "serving.cadenza.dev/serves-prefill": "true"}
    gateway = objs[("Deployment", "chat-gateway")]["spec"]["template"]["spec"]
    assert gateway["volumes"][0]["secret"]["secretName"] == "chat-admin"
    gw_args = gateway["containers"][0]["args"]
    assert gw_args[gw_args.index("--disagg-min-prompt-tokens") + 1] == "600"
    assert stale_services(p) == ["chat"]
    # a pod the controller relabelled (colocated -> prefill) is still covered: only the pool's pods reach its KV port
    policies = [o for o in objs.values() if o["kind"] == "NetworkPolicy"]
    template = objs[("Deployment", "chat-auto")]["spec"]["template"]["metadata"]["labels"]
    stranger = ("prod", {"app": "curl"})
    for role in ("colocated", "interactive", "prefill"):
        pod = ("prod", {**template, "serving.cadenza.dev/role": role})
        assert admits(policies, pod, ("prod", template), KV_PORT)
        assert not admits(policies, pod, stranger, KV_PORT) and admits(policies, pod, stranger, 8000)
    # spec.controller.disaggregate: false: none of it
    off = by_name(render_all(pool(mode="auto", controller={"disaggregate": False}), OWNER))
    assert "--kv-transfer-port" not in engine(off, "auto")["args"] and ("Service", "chat-prefill") not in off
    assert "volumes" not in off[("Deployment", "chat-gateway")]["spec"]["template"]["spec"]
    assert stale_services(pool(mode="auto", controller={"disaggregate": False})) == ["chat", "chat-prefill"]


def _selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In) matching ``labels``."""
    return (all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
            and all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])
                    if e["operator"] == "In"))


def admits(policies: list[dict], to: tuple[str, dict], source: tuple[str, dict], port: int) -> bool:
    """Whether ingress from pod ``source`` (namespace, labels) to pod ``to`` on TCP ``port`` is
    allowed, as the Kubernetes NetworkPolicy spec reads the policies of ``to``'s namespace: a pod
    no policy selects admits everything; a selected pod admits what one of its rules lists (a rule
    without ``from`` admits every source, a peer with only ``podSelector`` pods of the policy's
    own namespace; a rule without ``ports`` every port)."""
    selecting = [p for p in policies if p["metadata"]["namespace"] == to[0]
                 and _selects(p["spec"]["podSelector"], to[1]) and "Ingress" in p["spec"]["policyTypes"]]
    if not selecting:
        return True

    def peer(p: dict, rule_peer: dict) -> bool:
        assert set(rule_peer) == {"podSelector"}, "only same-namespace pod peers are read here"
        return source[0] == p["metadata"]["namespace"] and _selects(rule_peer["podSelector"], source[1])

    return any((not rule.get("from") or any(peer(p, f) for f in rule["from"]))
               and (not rule.get("ports") or any(x["port"] == port and x["protocol"] == "TCP" for x in rule["ports"]))
               for p in selecting for rule in p["spec"].get("ingress", []))


def test_only_the_pools_own_pods_reach_the_kv_port_and_http_stays_open():
    objs = render_all(pool(mode="disaggregated"), OWNER)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert [p["metadata"]["name"] for p in policies] == ["chat-kv"]
    assert policies[0]["metadata"]["ownerReferences"][0]["uid"] == "uid-123"
    pods = {(o["metadata"]["labels"].get("serving.cadenza.dev/role") or "gateway"): ("prod", o["spec"]["template"]["metadata"]["labels"])
            for o in objs if o["kind"] == "Deployment"}
    ports = {p["name"]: p["containerPort"] for o in objs if o["kind"] == "Deployment"
             for p in o["spec"]["template"]["spec"]["containers"][0]["ports"]}
    kv, http = ports["kv"], ports["http"]
    stranger = ("prod", {"app": "curl"})
    other_pool = ("prod", {**pods["decode"][1], "serving.cadenza.dev/pool": "other"})
    other_namespace = ("team-b", pods["decode"][1])  # the same labels in another namespace
    for target in ("prefill", "decode"):
        to = pods[target]
        assert admits(policies, to, pods["decode"], kv) and admits(policies, to, pods["prefill"], kv)
        for source in (stranger, other_pool, other_namespace, pods["gateway"]):
            assert not admits(policies, to, source, kv)  # the gateway never speaks KV
            assert admits(policies, to, source, http)  # gateway, probes, Prometheus: as before
        assert not admits(policies, to, pods["decode"], 9999)  # and nothing else is opened
    assert admits(policies, pods["gateway"], stranger, http)  # the gateway's pods are not selected


@pytest.mark.parametrize("mode, controller", [("colocated", {}), ("dedicated", {}), ("auto", {"disaggregate": False})])
def test_a_pool_without_kv_endpoints_has_no_network_policy(mode, controller):
    from cadenza.operator.render import stale_network_policies

    p = pool(mode=mode, controller=controller)
    assert not [o for o in render_all(p, OWNER) if o["kind"] == "NetworkPolicy"]
    assert stale_network_policies(p, [r.name for r in p.roles()]) == ["chat-kv"]
    # while a shift away from disaggregated waits, the old KV pods stay covered
    shifting = by_name(render_all(p, OWNER, narrow=False, retiring=("prefill", "decode")))
    assert shifting[("NetworkPolicy", "chat-kv")]["spec"]["podSelector"]["matchExpressions"] == [
        {"key": "serving.cadenza.dev/role", "operator": "In", "values": ["decode", "prefill"]}]
    assert stale_network_policies(p, [*(r.name for r in p.roles()), "prefill", "decode"]) == []


def test_a_disaggregated_split_keeps_one_kv_layout_and_a_decode_replica():
    with pytest.raises(PoolSpecError, match="prefillReplicas"):
        render_all(pool(mode="disaggregated", replicas=2, disaggregated={"prefillReplicas": 2}))
    with pytest.raises(PoolSpecError, match="blockSize"):
        render_all(pool(mode="disaggregated", disaggregated={"decodeEngine": {"blockSize": 32}}))
    with pytest.raises(PoolSpecError, match="chunkSize"):
        render_all(pool(mode="disaggregated", disaggregated={"prefillEngine": {"chunkSize": 1024}}))


def test_changing_a_knob_rolls_only_the_roles_it_affects():
    before = by_name(render_all(pool(mode="dedicated"), OWNER))
    changed = copy.deepcopy(BASE["dedicated"])
    changed["engine"]["chunkSize"] = 32
    after = by_name(render_all(pool(mode="dedicated", dedicated=changed), OWNER))

    def hash_of(objs, role):
        return objs[("Deployment", f"chat-{role}")]["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH]

    assert hash_of(before, "interactive") != hash_of(after, "interactive")
    assert hash_of(before, "batch") == hash_of(after, "batch")
    assert before[("Deployment", "chat-gateway")] == after[("Deployment", "chat-gateway")]


def test_changing_replicas_changes_no_pod_template():
    before = by_name(render_all(pool(), OWNER))
    after = by_name(render_all(pool(replicas=5), OWNER))
    dep_b, dep_a = before[("Deployment", "chat-colocated")], after[("Deployment", "chat-colocated")]
    assert dep_a["spec"]["replicas"] == 5 and dep_a["spec"]["template"] == dep_b["spec"]["template"]


def test_a_pvc_model_is_mounted_read_only_and_gpus_select_cuda():
    p = pool(model={"name": "llama", "source": {"pvc": {"claimName": "weights", "subPath": "llama-8b"}}},
             resources={"limits": {"nvidia.com/gpu": 1, "memory": "40Gi"}})
    objs = by_name(render_all(p, OWNER))
    container = engine(objs, "colocated")
    pod = objs[("Deployment", "chat-colocated")]["spec"]["template"]["spec"]
    assert container["args"][container["args"].index("--model") + 1] == "/models/llama-8b"
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
    assert "--device" in container["args"] and container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert any(v["name"] == "dshm" for v in pod["volumes"])


def test_quantities_are_strings_as_the_api_types_them():
    p = pool(resources={"requests": {"cpu": 8, "memory": "48Gi"}, "limits": {"nvidia.com/gpu": 1}})
    assert engine(by_name(render_all(p, OWNER)), "colocated")["resources"] == {
        "requests": {"cpu": "8", "memory": "48Gi"}, "limits": {"nvidia.com/gpu": "1"}}


@pytest.mark.parametrize(("resources", "threads"), [
    ({"limits": {"cpu": "4"}}, "4"), ({"limits": {"cpu": "2500m"}, "requests": {"cpu": 1}}, "2"),
    ({"requests": {"cpu": "500m"}}, "1"), ({"limits": {"memory": "4Gi"}}, None), ({}, None),
])
def test_torch_threads_follow_the_cpu_quantity(resources, threads):
    env = {e["name"]: e.get("value") for e in engine(by_name(render_all(pool(resources=resources), OWNER)),
                                                      "colocated")["env"]}
    assert env.get("OMP_NUM_THREADS") == threads


@pytest.mark.parametrize("resources", [{"requests": {"nvidia.com/gpu": 2}}, {"limits": {"amd.com/gpu": "2"}},
                                       {"requests": {"amd.com/gpu": 2}, "limits": {"amd.com/gpu": 2}}])
def test_gpus_in_requests_alone_or_from_amd_are_gpus_too(resources):
    objs = by_name(render_all(pool(resources=resources), OWNER))
    container = engine(objs, "colocated")
    [name] = {n for section in resources.values() for n in section}
    assert container["resources"]["limits"][name] == "2"  # Kubernetes takes extended resources from limits
    assert container["args"][container["args"].index("--device") + 1] == "cuda"  # ROCm's torch too
    strategy = objs[("Deployment", "chat-colocated")]["spec"]["strategy"]["rollingUpdate"]
    assert strategy == {"maxSurge": 0, "maxUnavailable": 1}


def test_a_pod_of_several_gpus_runs_one_rank_per_gpu_and_a_tensor_parallel_pod_gets_shared_memory():
    container = engine(by_name(render_all(pool(resources={"limits": {"nvidia.com/gpu": 4}}), OWNER)), "colocated")
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "4"
    one = engine(by_name(render_all(pool(resources={"limits": {"nvidia.com/gpu": 1}}), OWNER)), "colocated")
    assert "--tensor-parallel-size" not in one["args"]  # the engine's default: pools from before the field do not roll
    cpu = by_name(render_all(pool(engine={**BASE["engine"], "tensorParallelSize": 2}), OWNER))
    assert engine(cpu, "colocated")["args"][engine(cpu, "colocated")["args"].index("--tensor-parallel-size") + 1] == "2"
    pod = cpu[("Deployment", "chat-colocated")]["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]  # the ranks' arena (> 64 MiB at 8)
    plain = by_name(render_all(pool(), OWNER))[("Deployment", "chat-colocated")]["spec"]["template"]["spec"]
    assert not any(v["name"] == "dshm" for v in plain["volumes"])


@pytest.mark.parametrize("value", ["1.5", "500m", "1Gi", -1])
def test_a_gpu_count_that_is_not_whole_is_a_spec_error_not_a_crash(value):
    with pytest.raises(PoolSpecError, match="whole number of GPUs"):
        pool(resources={"limits": {"nvidia.com/gpu": value}}).roles()
    with pytest.raises(PoolSpecError, match="one vendor"):
        pool(resources={"limits": {"nvidia.com/gpu": 1, "amd.com/gpu": 1}}).roles()


def test_a_roles_engine_overrides_merge_into_the_base_class_by_class():
    p = pool(mode="dedicated", engine={"classes": {"interactive": {"maxPrefillTokens": 64, "minShare": 0.2},
                                                   "batch": {"minShare": 0.1}}, "chunkSize": 128},
             dedicated={"interactiveReplicas": 1, "engine": {"classes": {"interactive": {"minShare": 0.5}}}})
    interactive = p.role_settings("interactive").engine
    assert interactive["classes"] == {"interactive": {"maxPrefillTokens": 64, "minShare": 0.5},
                                      "batch": {"minShare": 0.1}}  # batch kept, interactive's other field kept
    assert interactive["chunkSize"] == 128
    assert p.spec["engine"]["classes"]["interactive"]["minShare"] == 0.2  # the spec itself untouched


def test_gpu_pools_roll_without_a_spare_gpu_and_cpu_pools_surge():
    def rollout(p):
        return by_name(render_all(p, OWNER))[("Deployment", "chat-colocated")]["spec"]["strategy"]["rollingUpdate"]

    assert rollout(pool(resources={"limits": {"nvidia.com/gpu": 1}})) == {"maxSurge": 0, "maxUnavailable": 1}
    assert rollout(pool()) == {"maxSurge": 1, "maxUnavailable": 0}


def test_the_embedded_model_needs_no_model_flag():
    args = engine(by_name(render_all(pool(model={"name": "SmolLM2-135M-Instruct", "source": {"embedded": True}}),
                                     OWNER)), "colocated")["args"]
    assert "--model" not in args and args[args.index("--served-model-name") + 1] == "SmolLM2-135M-Instruct"


def test_containers_run_hardened():
    for obj in render_all(pool(), OWNER):
        if obj["kind"] == "Deployment":
            for c in obj["spec"]["template"]["spec"]["containers"]:
                ctx = c["securityContext"]
                assert ctx["runAsNonRoot"] and ctx["readOnlyRootFilesystem"] and ctx["capabilities"]["drop"] == ["ALL"]
                assert not ctx["allowPrivilegeEscalation"]
                assert c["command"] == ["cadenza"]  # not left to the image's entrypoint


def test_engine_pods_write_only_to_volumes():
    """torch needs a temp dir and the embedded model a cache: both are volumes on a read-only root."""
    pod = by_name(render_all(pool(), OWNER))[("Deployment", "chat-colocated")]["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]] and "emptyDir" in volumes[mounts["/cache"]]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["HOME"] == env["XDG_CACHE_HOME"] == "/cache"


def test_gateway_reads_endpoints_with_its_own_least_privilege_role():
    objs = by_name(render_all(pool(), OWNER))
    (rule,) = objs[("Role", "chat-gateway")]["rules"]
    assert rule == {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}
    gw = objs[("Deployment", "chat-gateway")]["spec"]["template"]["spec"]
    assert gw["serviceAccountName"] == "chat-gateway"
    assert gw["containers"][0]["args"][:6] == ["gateway", "--kubernetes", "--namespace", "prod", "--pool", "chat"]


def test_the_gateway_runs_its_own_image_and_the_engines_theirs():
    objs = by_name(render_all(pool(gateway={"image": "cadenza-control-plane:test"}), OWNER))
    [gateway] = objs[("Deployment", "chat-gateway")]["spec"]["template"]["spec"]["containers"]
    [engine] = objs[("Deployment", "chat-colocated")]["spec"]["template"]["spec"]["containers"]
    assert (gateway["image"], engine["image"]) == ("cadenza-control-plane:test", "cadenza:test")
    [gateway] = by_name(render_all(pool(), OWNER))[("Deployment", "chat-gateway")]["spec"]["template"]["spec"]["containers"]
    assert gateway["image"] == "cadenza:test"  # a spec without one (before defaults): the engine's image runs it too


def test_specs_the_schema_cannot_catch_are_refused():
    with pytest.raises(PoolSpecError, match="chunkSize"):
        render_all(pool(mode="dedicated", dedicated={"interactiveReplicas": 1, "engine": {"chunkSize": 1024}}))
    with pytest.raises(PoolSpecError, match="interactiveReplicas"):
        render_all(pool(mode="dedicated", replicas=1))
    with pytest.raises(PoolSpecError, match="minShare|min_share"):
        render_all(pool(engine={"classes": {"batch": {"minShare": 0.8}, "interactive": {"minShare": 0.5}}}))


def test_status_selector_matches_every_engine_pod():
    assert selector_string(pool()) == "serving.cadenza.dev/pool=chat,app.kubernetes.io/component=engine"


def test_the_gateway_gets_dense_latency_buckets_around_the_pools_slo_targets():
    def gateway_args(p):
        return by_name(render_all(p, OWNER))[("Deployment", "chat-gateway")]["spec"]["template"]["spec"][
            "containers"][0]["args"]

    assert "--slo-targets-ms" not in gateway_args(pool())
    args = gateway_args(pool(slo={"interactive": {"ttftP99Ms": 500, "itlP99Ms": 80}, "batch": {"ttftP99Ms": 500}}))
    assert args[args.index("--slo-targets-ms") + 1] == "80,500"


def test_engine_pods_leave_the_routing_before_sigterm_and_streams_get_the_grace_period():
    container = engine(by_name(render_all(pool(termination={"gracePeriodSeconds": 900, "drainDelaySeconds": 12}),
                                          OWNER)), "colocated")
    assert container["lifecycle"]["preStop"] == {"sleep": {"seconds": 12}}
    args = container["args"]
    assert args[args.index("--shutdown-timeout-s") + 1] == "883"  # 900 - 12 - 5
    spec = by_name(render_all(pool(), OWNER))[("Deployment", "chat-colocated")]["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] == 600


POD = {
    "labels": {"team": "search"}, "annotations": {"cost-center": "42"},
    "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}},
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                   "whenUnsatisfiable": "ScheduleAnyway"}],
    "priorityClassName": "inference-high", "runtimeClassName": "nvidia", "schedulerName": "kai-scheduler",
    "imagePullSecrets": [{"name": "registry"}], "serviceAccountName": "weights-reader",
    "env": [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel-collector:4318"}],
    "envFrom": [{"configMapRef": {"name": "otel"}}],
    "volumes": [{"name": "extra", "configMap": {"name": "prompts"}}],
    "volumeMounts": [{"name": "extra", "mountPath": "/etc/prompts", "readOnly": True}],
}


@pytest.mark.parametrize("mode", ["colocated", "dedicated", "disaggregated", "auto"])
def test_pod_settings_reach_every_engine_pod_and_only_them(mode):
    objs = by_name(render_all(pool(mode=mode, replicas=3, pod=POD), OWNER))
    engines = [o for (kind, _), o in objs.items() if kind == "Deployment" and not _.endswith("-gateway")]
    assert engines
    for deployment in engines:
        template = deployment["spec"]["template"]
        pod, [container] = template["spec"], template["spec"]["containers"]
        assert template["metadata"]["labels"]["team"] == "search" and "serving.cadenza.dev/pool" in template["metadata"]["labels"]
        assert template["metadata"]["annotations"]["cost-center"] == "42" and CONFIG_HASH in template["metadata"]["annotations"]
        for key in ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "priorityClassName",
                    "runtimeClassName", "schedulerName", "imagePullSecrets", "serviceAccountName"):
            assert pod[key] == POD[key], key
        assert container["env"][-1] == POD["env"][0] and {"name": "CADENZA_POOL", "value": "chat"} in container["env"]
        assert container["envFrom"] == POD["envFrom"]
        assert POD["volumes"][0] in pod["volumes"] and {v["name"] for v in pod["volumes"]} >= {"config", "cache"}
        assert container["volumeMounts"][-1] == POD["volumeMounts"][0]
    gateway = objs[("Deployment", "chat-gateway")]["spec"]["template"]
    assert "team" not in gateway["metadata"]["labels"] and "tolerations" not in gateway["spec"]
    assert gateway["spec"]["serviceAccountName"] == "chat-gateway"


def test_the_gateway_has_pod_settings_of_its_own_but_keeps_its_service_account():
    gw = {"nodeSelector": {"pool": "system"}, "priorityClassName": "gateway",
          "env": [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel:4318"}]}
    objs = by_name(render_all(pool(gateway={"pod": gw}), OWNER))
    template = objs[("Deployment", "chat-gateway")]["spec"]["template"]
    assert template["spec"]["nodeSelector"] == {"pool": "system"} and template["spec"]["priorityClassName"] == "gateway"
    assert template["spec"]["containers"][0]["env"] == gw["env"]
    assert "nodeSelector" not in objs[("Deployment", "chat-colocated")]["spec"]["template"]["spec"]
    with pytest.raises(PoolSpecError, match="spec.gateway.pod.serviceAccountName: the gateway runs as its own"):
        render_all(pool(gateway={"pod": {"serviceAccountName": "other"}}), OWNER)


@pytest.mark.parametrize("settings, problem", [
    ({"labels": {"serving.cadenza.dev/pool": "x"}}, "spec.pod.labels: serving.cadenza.dev/pool set by the operator"),
    ({"annotations": {CONFIG_HASH: "x"}}, f"spec.pod.annotations: {CONFIG_HASH} set by the operator"),
    ({"env": [{"name": "HOME", "value": "/"}]}, "spec.pod.env: HOME set by the operator"),
    ({"volumes": [{"name": "cache", "emptyDir": {}}]}, "spec.pod.volumes: cache set by the operator"),
    ({"volumeMounts": [{"name": "x", "mountPath": "/cache/"}]}, "spec.pod.volumeMounts: /cache/ is the operator's"),
])
def test_pod_settings_never_override_what_the_operator_sets(settings, problem):
    with pytest.raises(PoolSpecError, match=re.escape(problem)):
        render_all(pool(pod=settings), OWNER)


@pytest.mark.parametrize("mode, roles", [("colocated", ["colocated"]), ("dedicated", ["interactive", "batch"]),
                                         ("auto", ["auto"]), ("disaggregated", ["prefill", "decode"])])
def test_each_role_has_a_disruption_budget_selecting_what_its_deployment_selects(mode, roles):
    objs = by_name(render_all(pool(mode=mode, replicas=3), OWNER))
    for role in roles:
        pdb = objs[("PodDisruptionBudget", f"chat-{role}")]
        deployment = objs[("Deployment", f"chat-{role}")]
        assert pdb["spec"] == {"maxUnavailable": 1, "selector": deployment["spec"]["selector"]}
        assert pdb["metadata"]["ownerReferences"][0]["uid"] == OWNER["uid"]
    gateway = objs[("PodDisruptionBudget", "chat-gateway")]
    assert gateway["spec"]["selector"] == objs[("Deployment", "chat-gateway")]["spec"]["selector"]
    # one replica: one gateway pod, and no budget that would only get in a drain's way
    assert ("PodDisruptionBudget", "chat-gateway") not in by_name(render_all(pool(replicas=1), OWNER))


def test_a_retiring_role_keeps_its_budget_until_it_is_gone_and_stale_ones_are_named():
    from cadenza.operator.render import stale_pdbs

    p = pool(mode="dedicated", replicas=3)
    objs = by_name(render_all(p, OWNER, narrow=False, retiring=("colocated",)))
    assert ("PodDisruptionBudget", "chat-colocated") in objs
    stale = stale_pdbs(p, p.roles())
    assert "chat-engine" in stale and "chat-colocated" in stale and "chat-interactive" not in stale
    assert "chat-gateway" not in stale and "chat-gateway" in stale_pdbs(pool(replicas=1), pool(replicas=1).roles())


@pytest.mark.parametrize("old, new", [("dedicated", "colocated"), ("disaggregated", "dedicated"),
                                      ("colocated", "disaggregated"), ("auto", "colocated")])
def test_a_retiring_role_renders_as_its_mode_applied_it_when_only_the_mode_changed(old, new):
    from cadenza.operator.render import render_retiring

    before = by_name(render_all(pool(mode=old), OWNER))
    after = pool(mode=new)
    retiring = tuple(name.removeprefix("chat-") for name in stale_deployments(after, after.roles())
                     if ("Deployment", name) in before)
    assert retiring and by_name(render_retiring(after, retiring, OWNER)) == {
        key: obj for key, obj in before.items() if key[0] == "Deployment" and key[1].removeprefix("chat-") in retiring}
    # a split the spec no longer allows (one replica cannot be split in two roles) renders nothing
    assert render_retiring(pool(mode="colocated", replicas=1), ("interactive", "batch"), OWNER) == []


def test_autoscaling_renders_a_scaler_of_the_pools_own_scale_subresource():
    metrics = [{"type": "Pods", "pods": {"metric": {"name": "cadenza_requests"},
                                         "target": {"type": "AverageValue", "averageValue": "8"}}}]
    objs = by_name(render_all(pool(autoscaling={"minReplicas": 2, "maxReplicas": 6, "metrics": metrics}), OWNER))
    hpa = objs[("HorizontalPodAutoscaler", "chat")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"] == {"scaleTargetRef": {"apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool",
                                              "name": "chat"}, "minReplicas": 2, "maxReplicas": 6, "metrics": metrics}
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == OWNER["uid"]
    # what it scales is spec.replicas: the operator splits the count it sets like any other
    assert objs[("Deployment", "chat-colocated")]["spec"]["replicas"] == 3
    assert not [k for k in by_name(render_all(pool(), OWNER)) if k[0] == "HorizontalPodAutoscaler"]


def test_a_hub_model_is_downloaded_by_an_init_container_and_served_offline_from_the_cache():
    source = {"hf": {"repo": "meta-llama/Llama-3.1-8B-Instruct", "revision": "0e9e39f",
                     "tokenSecret": {"name": "hf", "key": "token"}}}
    p = pool(model={"name": "llama", "source": source}, cache={"claimName": "model-cache"},
             pod={"env": [{"name": "HF_ENDPOINT", "value": "https://hub-mirror.internal"}]})
    spec = by_name(render_all(p, OWNER))[("Deployment", "chat-colocated")]["spec"]["template"]["spec"]
    [init], [container] = spec["initContainers"], spec["containers"]
    assert init["args"] == ["fetch-model", "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f"] and init["image"] == "cadenza:test"
    init_env = {e["name"]: e for e in init["env"]}
    assert init_env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert init_env["HF_ENDPOINT"]["value"] == "https://hub-mirror.internal"  # spec.pod.env reaches it too
    assert {m["mountPath"] for m in init["volumeMounts"]} == {"/cache", "/tmp"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HF_HUB_OFFLINE"] == "1" and "HF_TOKEN" not in env  # the engine reads the cache, never the token
    assert container["args"][container["args"].index("--model") + 1] == "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f"
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "model-cache"}} in spec["volumes"]
    # other sources: no init container, and the cache is an emptyDir
    plain = by_name(render_all(pool(), OWNER))[("Deployment", "chat-colocated")]["spec"]["template"]["spec"]
    assert "initContainers" not in plain and {"name": "cache", "emptyDir": {}} in plain["volumes"]
