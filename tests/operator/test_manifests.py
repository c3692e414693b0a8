"""The manifests install a structural CRD and a least-privilege, locked-down operator."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import celpy
import jsonschema
import kubernetes.client
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
CRD_COPIES = (ROOT / "pool" / "servingpools.crd.yaml", MANIFESTS / "crd" / "servingpools.yaml")
YAML_FILES = sorted(MANIFESTS.rglob("*.yaml"))
RULE_VERBS = ["create", "get", "list", "watch", "patch", "delete"]


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def find(kind: str, name: str | None = None) -> dict:
    matches = [doc for path in YAML_FILES for doc in documents(path)
               if doc.get("kind") == kind and (name is None or doc["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def crd_version() -> dict:
    [version] = yaml.safe_load(CRD_COPIES[0].read_text())["spec"]["versions"]
    return version


def schema_nodes(node: dict, path: str = "") -> list[tuple[str, dict]]:
    """Every schema node reachable through properties, additionalProperties and items."""
    out = [(path or "<root>", node)]
    for key, child in node.get("properties", {}).items():
        out += schema_nodes(child, f"{path}.{key}")
    if isinstance(node.get("additionalProperties"), dict):
        out += schema_nodes(node["additionalProperties"], f"{path}[*]")
    if isinstance(node.get("items"), dict):
        out += schema_nodes(node["items"], f"{path}[]")
    return out


# --- files ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", YAML_FILES, ids=[str(p.relative_to(MANIFESTS)) for p in YAML_FILES])
def test_every_manifest_parses_into_kubernetes_objects(path):
    docs = documents(path)
    assert docs
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind")
        if doc["kind"] != "Kustomization":
            assert doc["metadata"]["name"]


def test_the_operator_package_ships_the_same_crd_as_the_manifests():
    assert CRD_COPIES[0].read_bytes() == CRD_COPIES[1].read_bytes()


def test_kustomization_lists_files_that_exist_and_the_whole_install():
    kustomization = documents(MANIFESTS / "kustomization.yaml")[0]
    resources = kustomization["resources"]
    assert all((MANIFESTS / resource).is_file() for resource in resources)
    assert set(resources) == {"namespace.yaml", "crd/servingpools.yaml", "rbac.yaml", "operator.yaml"}


# --- CRD --------------------------------------------------------------------------------------------


def test_crd_schema_is_structural():
    # https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/#specifying-a-structural-schema
    for path, node in schema_nodes(crd_version()["schema"]["openAPIV3Schema"]):
        assert "type" in node or node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields"), path
        assert not ("properties" in node and "additionalProperties" in node), path
        if "anyOf" in node:  # only the int-or-string pattern may set types inside a junctor
            assert node.get("x-kubernetes-int-or-string") and node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        assert not {"allOf", "oneOf", "not"} & node.keys(), path
        if path == ".metadata":
            assert node == {"type": "object"}


def test_crd_defaults_are_valid_values_of_their_fields():
    for path, node in schema_nodes(crd_version()["schema"]["openAPIV3Schema"]):
        if "default" in node:
            assert not list(jsonschema.Draft4Validator(node).iter_errors(node["default"])), path


def test_crd_validation_rules_all_compile():
    env = celpy.Environment()
    rules = [rule for _, node in schema_nodes(crd_version()["schema"]["openAPIV3Schema"])
             for rule in node.get("x-kubernetes-validations", ())]
    assert len(rules) >= 3
    for rule in rules:
        env.compile(rule["rule"])
        assert rule["message"]


def test_crd_has_status_and_scale_subresources_pointing_at_real_fields():
    version = crd_version()
    subresources = version["subresources"]
    assert subresources["status"] == {}
    scale = subresources["scale"]
    nodes = dict(schema_nodes(version["schema"]["openAPIV3Schema"]))
    assert nodes[scale["specReplicasPath"]]["type"] == "integer"
    assert nodes[scale["statusReplicasPath"]]["type"] == "integer"
    assert nodes[scale["labelSelectorPath"]]["type"] == "string"


def test_crd_has_the_six_printer_columns():
    version = crd_version()
    columns = version["additionalPrinterColumns"]
    assert [c["name"] for c in columns] == ["Mode", "Ready", "Replicas", "TTFT p99", "ITL p99", "Age"]
    nodes = dict(schema_nodes(version["schema"]["openAPIV3Schema"]))
    for column in columns:
        if not column["jsonPath"].startswith(".metadata"):
            assert column["jsonPath"] in nodes, column


def test_crd_serves_and_stores_v1alpha1_of_servingpools():
    crd = find("CustomResourceDefinition")
    assert crd["metadata"]["name"] == "servingpools.serving.cadenza.dev"
    assert crd["spec"]["scope"] == "Namespaced" and crd["spec"]["names"]["kind"] == "ServingPool"
    assert crd_version()["name"] == "v1alpha1" and crd_version()["served"] and crd_version()["storage"]


# --- RBAC -------------------------------------------------------------------------------------------


def test_rbac_has_no_wildcards():
    for rule in find("ClusterRole", "cadenza-operator")["rules"]:
        for key in ("verbs", "resources", "apiGroups"):
            assert not any("*" in value for value in rule[key]), rule
        assert "nonResourceURLs" not in rule and "resourceNames" not in rule


def granted(group: str, resource: str) -> set[str]:
    rules = find("ClusterRole", "cadenza-operator")["rules"]
    return {verb for rule in rules if group in rule["apiGroups"] and resource in rule["resources"] for verb in rule["verbs"]}


@pytest.mark.parametrize(
    "group, resource, verbs",
    [
        ("serving.cadenza.dev", "servingpools", {"list", "watch", "patch"}),
        ("serving.cadenza.dev", "servingpools/status", {"patch"}),
        ("serving.cadenza.dev", "servingpools/finalizers", {"update"}),  # blockOwnerDeletion (OpenShift)
        ("apps", "deployments", set(RULE_VERBS)),
        ("", "services", set(RULE_VERBS)),
        ("", "configmaps", set(RULE_VERBS)),
        ("", "serviceaccounts", set(RULE_VERBS)),
        ("policy", "poddisruptionbudgets", set(RULE_VERBS)),
        ("autoscaling", "horizontalpodautoscalers", set(RULE_VERBS)),
        ("networking.k8s.io", "networkpolicies", set(RULE_VERBS)),  # the KV port's policy
        ("rbac.authorization.k8s.io", "roles", set(RULE_VERBS)),
        ("rbac.authorization.k8s.io", "rolebindings", set(RULE_VERBS)),
        ("discovery.k8s.io", "endpointslices", {"get", "list", "watch"}),
        ("", "events", {"create", "patch"}),
        ("events.k8s.io", "events", {"create", "patch"}),
        ("apiextensions.k8s.io", "customresourcedefinitions", {"list", "watch"}),
        ("", "namespaces", {"list", "watch"}),
        ("", "pods", {"get", "list", "patch"}),  # scrape gateways; relabel engine pods (in-place roles)
        ("", "secrets", {"create", "get", "delete"}),  # the admin token of a mode auto pool
    ],
)
def test_operator_holds_what_it_needs(group, resource, verbs):
    assert verbs <= granted(group, resource)


def test_every_kind_the_operator_renders_or_watches_is_granted():
    """RBAC kept honest by the code: each kind a pool can render (in any mode, with autoscaling)
    and each child kind kopf watches can be created, read, watched, patched and deleted."""
    from cadenza.operator import render
    from cadenza.operator.children import CHILD_KINDS
    from cadenza.pool.spec import MODES, Pool
    from cadenza.pool.validate import load_pools

    example = load_pools(MANIFESTS / "examples" / "quickstart-cpu.yaml")[0]["spec"]
    spec = {**example, "replicas": 3, "autoscaling": {"minReplicas": 2, "maxReplicas": 4}}
    rendered = {(obj["apiVersion"].rpartition("/")[0], obj["kind"]) for mode in MODES
                for obj in render.render_all(Pool("p", "ns", {**spec, "mode": mode}), {"name": "p", "uid": "u"})}
    watched = {(resource[0] if len(resource) == 3 else "", kind) for kind, resource in CHILD_KINDS.items()}
    plural = {kind: resource[-1] for kind, resource in CHILD_KINDS.items()}
    assert {kind for _group, kind in rendered} <= set(plural)  # every rendered kind is watched
    for group, kind in rendered | watched:
        assert set(RULE_VERBS) <= granted(group, plural[kind]), (group, kind)


def test_operator_cannot_read_every_secret_make_pods_or_escalate():
    assert not granted("rbac.authorization.k8s.io", "clusterroles")
    assert granted("", "pods") == {"get", "list", "patch"}  # labels only: never create or delete a pod
    assert granted("", "secrets") == {"create", "get", "delete"}  # no list or watch of other Secrets
    rules = find("ClusterRole", "cadenza-operator")["rules"]
    verbs = {verb for rule in rules for verb in rule["verbs"]}
    assert not verbs & {"escalate", "bind", "impersonate", "deletecollection"}
    updated = {r for rule in rules if "update" in rule["verbs"] for r in rule["resources"]}
    assert updated == {"servingpools/finalizers"}  # update nowhere else


def test_the_cluster_role_is_bound_to_the_operator_service_account():
    account = find("ServiceAccount", "cadenza-operator")
    binding = find("ClusterRoleBinding", "cadenza-operator")
    assert account["metadata"]["namespace"] == "cadenza-system"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cadenza-operator"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "cadenza-operator", "namespace": "cadenza-system"}]


# --- operator Deployment ----------------------------------------------------------------------------


def operator_pod() -> dict:
    deployment = find("Deployment", "cadenza-operator")
    assert deployment["metadata"]["namespace"] == "cadenza-system"
    assert deployment["spec"]["replicas"] == 1
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    return deployment["spec"]["template"]["spec"]


def test_operator_runs_the_control_plane_image_cluster_wide():
    pod = operator_pod()
    [container] = pod["containers"]
    assert pod["serviceAccountName"] == "cadenza-operator"
    assert container["image"] == "ghcr.io/cadenza-serving/cadenza-control-plane:0.1.0"
    assert container.get("command", ["cadenza"]) == ["cadenza"]
    assert container["args"] == ["operator", "--all-namespaces"]


def test_operator_is_locked_down():
    pod = operator_pod()
    [container] = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    context = container["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] == 65532
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}


def test_operator_has_resource_requests_and_limits():
    [container] = operator_pod()["containers"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= container["resources"][kind].keys()


def test_operator_writes_only_to_a_tmp_volume():
    pod = operator_pod()
    [container] = pod["containers"]
    [mount] = container["volumeMounts"]
    [volume] = pod["volumes"]
    assert mount["mountPath"] == "/tmp" and mount["name"] == volume["name"] and "emptyDir" in volume


def test_operator_liveness_probe_asks_kopf():
    [container] = operator_pod()["containers"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 8080}


def test_operator_namespace_exists():
    assert find("Namespace", "cadenza-system")


# --- Kubernetes API types --------------------------------------------------------------------------


def undeclared_fields(value: object, type_name: str, path: str) -> list[str]:
    """Fields the Kubernetes API type does not declare (kubectl's strict field validation), and
    booleans/integers of the wrong type; the type names are the ``kubernetes`` client's models."""
    if type_name.startswith("List["):
        return [p for i, v in enumerate(value) for p in undeclared_fields(v, type_name[5:-1], f"{path}[{i}]")]
    if type_name.startswith("Dict["):
        inner = type_name[5:-1].split(", ", 1)[1]
        return [p for k, v in value.items() for p in undeclared_fields(v, inner, f"{path}.{k}")]
    if type_name == "bool":
        return [] if isinstance(value, bool) else [f"{path}: not a boolean"]
    if type_name == "int":
        return [] if isinstance(value, int) and not isinstance(value, bool) else [f"{path}: not an integer"]
    model = getattr(kubernetes.client, type_name, None)
    if model is None:  # str, object, datetime: free-form here
        return []
    if not isinstance(value, dict):
        return [f"{path}: not an object"]
    attributes = {json_key: attr for attr, json_key in model.attribute_map.items()}
    problems = []
    for key, child in value.items():
        if key not in attributes:
            problems.append(f"{path}.{key}: not a field of {type_name}")
        else:
            problems += undeclared_fields(child, model.openapi_types[attributes[key]], f"{path}.{key}")
    return problems


API_TYPES = {"Namespace": "V1Namespace", "ServiceAccount": "V1ServiceAccount", "ClusterRole": "V1ClusterRole",
             "ClusterRoleBinding": "V1ClusterRoleBinding", "Deployment": "V1Deployment",
             "CustomResourceDefinition": "V1CustomResourceDefinition"}


@pytest.mark.parametrize("kind", sorted(API_TYPES))
def test_manifests_use_only_fields_of_their_api_types(kind):
    obj = find(kind)
    assert undeclared_fields(obj, API_TYPES[kind], kind) == []


def test_the_field_checker_catches_a_pod_level_container_setting():
    pod = {"securityContext": {"readOnlyRootFilesystem": True, "runAsNonRoot": "yes"}}
    assert undeclared_fields(pod, "V1PodSpec", "pod") == [
        "pod.securityContext.readOnlyRootFilesystem: not a field of V1PodSecurityContext",
        "pod.securityContext.runAsNonRoot: not a boolean",
    ]


# --- kubeconform --------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("kubeconform") is None, reason="kubeconform is not on PATH")
def test_manifests_pass_kubeconform():
    files = [str(p) for p in YAML_FILES if p.name != "kustomization.yaml"]
    result = subprocess.run(["kubeconform", "-strict", "-summary", "-ignore-missing-schemas", *files],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
