"""Server-side apply and delete of a pool's children, against the real ``kubernetes`` client with fake transports."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes
import pytest
import urllib3
from kubernetes.client.rest import ApiException

from cadenza.operator import kube, render, ssa
from cadenza.pool.spec import Pool
from cadenza.pool.validate import load_pools

EXAMPLES = Path(__file__).parents[2] / "manifests" / "examples"


def test_the_client_side_managers_fields_become_the_operators_applied_fields():
    legacy_fields = {"f:metadata": {"f:annotations": {".": {}, f"f:{ssa.LAST_APPLIED}": {}},
                                    "f:labels": {"f:app": {}}},
                     "f:spec": {"f:selector": {}, "f:ports": {}}}
    entries = [
        {"manager": "OpenAPI-Generator", "operation": "Update", "apiVersion": "v1", "fieldsType": "FieldsV1",
         "fieldsV1": legacy_fields},
        {"manager": "kube-controller-manager", "operation": "Update", "subresource": "status",
         "fieldsV1": {"f:status": {}}},
        {"manager": "kubectl-edit", "operation": "Update", "fieldsV1": {"f:metadata": {"f:labels": {"f:team": {}}}}},
    ]
    upgraded = ssa.upgrade_managed_fields(entries)
    assert upgraded[0]["manager"] == ssa.FIELD_MANAGER and upgraded[0]["operation"] == "Apply"
    assert upgraded[0]["fieldsV1"] == {"f:metadata": {"f:labels": {"f:app": {}}}, "f:spec": {"f:selector": {}, "f:ports": {}}}
    assert upgraded[1:] == entries[1:]  # the others' fields stay theirs
    assert ssa.upgrade_managed_fields(entries[1:]) is None and ssa.upgrade_managed_fields(None) is None


class FakeApi:
    """Stands in for one kind's read/create/patch/delete."""

    def __init__(self, current=None, error=None):
        self.current, self.error, self.calls = current, error, []
        self.answer = None  # what an apply answers (the object as stored); None: nothing checked

    def read(self, name, namespace):
        self.calls.append("read")
        if self.error:
            raise self.error
        if self.current is None:
            raise ApiException(status=404, reason="Not Found")
        return self.current

    def create(self, namespace, body, field_manager=None):
        self.calls.append(("create", body))

    def patch(self, name, namespace, body, field_manager=None, force=None, _content_type=None):
        self.calls.append(("patch", body, _content_type))
        if _content_type == ssa.APPLY_PATCH:
            assert field_manager == "cadenza-operator" and force is True
            return self.answer

    def delete(self, name, namespace, body=None):
        self.calls.append(("delete", body) if body is not None else "delete")
        if self.error:
            raise self.error


@pytest.fixture
def fake(monkeypatch):
    api = FakeApi()
    monkeypatch.setattr(kube, "apis", lambda kind: (api.read, api.create, api.patch, api.delete))
    return api


def live(obj: dict, **server_defaults):
    """What the client's read returns for an object stored from ``obj`` (with fields the API
    server adds, such as ``cluster_ip``)."""
    spec = obj.get("spec", {})
    return kubernetes.client.V1Service(
        api_version=obj.get("apiVersion"), kind=obj.get("kind"),
        metadata=kubernetes.client.V1ObjectMeta(name=obj["metadata"]["name"], namespace=obj["metadata"].get("namespace"),
                                                annotations=obj["metadata"].get("annotations"), uid="server-set"),
        spec=kubernetes.client.V1ServiceSpec(selector=spec.get("selector"), **server_defaults))


def service(selector: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "p-batch", "namespace": "ns"},
            "spec": {"selector": selector}}


def test_apply_creates_then_leaves_alone_then_applies_the_new_rendering_server_side(fake):
    first = service({"pool": "p", "role": "batch"})
    assert ssa.apply(first) == "created"
    _, stored, content_type = fake.calls[-1]
    assert content_type == ssa.APPLY_PATCH and stored["spec"] == first["spec"]
    assert stored["metadata"]["annotations"][ssa.RENDERED] == ssa.digest(first)

    fake.current = live(stored)
    assert ssa.apply(first) == "unchanged" and fake.calls[-1] == "read"

    assert ssa.apply(service({"pool": "p"})) == "updated"
    _, body, content_type = fake.calls[-1]
    # the whole new rendering, no deletions spelled out: the server drops what the operator no
    # longer applies (kmock cannot show that part; the cluster e2e does)
    assert content_type == ssa.APPLY_PATCH and body["spec"]["selector"] == {"pool": "p"}


def test_an_object_an_older_operator_applied_client_side_is_migrated_first(fake):
    old = service({"pool": "p"})
    old["metadata"]["annotations"] = {ssa.LAST_APPLIED: json.dumps(old)}
    fake.current = live(old)
    fake.current.metadata.resource_version = "42"
    fake.current.metadata.managed_fields = [kubernetes.client.V1ManagedFieldsEntry(
        manager="OpenAPI-Generator", operation="Update", api_version="v1", fields_type="FieldsV1",
        fields_v1={"f:metadata": {"f:annotations": {f"f:{ssa.LAST_APPLIED}": {}}}, "f:spec": {"f:selector": {}}})]
    assert ssa.apply(service({"pool": "p"})) == "updated"
    (_, migrate, merge), (_, applied, applied_as) = fake.calls[-2:]
    assert merge == kube.MERGE_PATCH and migrate["metadata"]["annotations"] == {ssa.LAST_APPLIED: None}
    assert migrate["metadata"]["resourceVersion"] == "42"  # only onto the version read
    assert migrate["metadata"]["managedFields"][0]["manager"] == ssa.FIELD_MANAGER
    assert applied_as == ssa.APPLY_PATCH and ssa.LAST_APPLIED not in applied["metadata"]["annotations"]


def test_a_service_turning_headless_is_recreated_as_its_cluster_ip_cannot_change(fake):
    fake.current = live(pool_service({"pool": "p"}), cluster_ip="10.0.0.7")
    fake.current.metadata.owner_references = [kubernetes.client.V1OwnerReference(
        api_version="serving.cadenza.dev/v1alpha1", kind="ServingPool", name="p", uid="pool-uid", controller=True)]
    headless = pool_service({"pool": "p"})
    headless["spec"]["clusterIP"] = "None"
    assert ssa.apply(headless) == "created"
    (_, options), (_, body, _) = fake.calls[-2:]
    assert options.preconditions.uid == "server-set" and body["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("error", [
    ApiException(status=503, reason="Service Unavailable"), ApiException(status=409, reason="Conflict"),
    ApiException(status=429, reason="Too Many Requests"), ConnectionRefusedError("refused"),
    urllib3.exceptions.MaxRetryError(None, "/api", "connection refused"),
    urllib3.exceptions.ProtocolError("connection aborted"),
])
def test_busy_or_unreachable_api_is_transient(fake, error):
    fake.error = error
    with pytest.raises(kube.Transient):
        ssa.apply(service({"pool": "p"}))
    with pytest.raises(kube.Transient):
        ssa.delete("Service", "p-batch", "ns")


def test_a_refusal_is_permanent_and_carries_the_api_message(fake):
    fake.error = ApiException(status=403, reason="Forbidden")
    fake.error.body = json.dumps({"kind": "Status", "message": "services is forbidden: no RBAC"})
    with pytest.raises(kube.Refused, match="403 Forbidden.*no RBAC"):
        ssa.apply(service({"pool": "p"}))


@pytest.mark.parametrize("example", ["quickstart-cpu", "chat-gpu"])
@pytest.mark.parametrize("mode", ["colocated", "dedicated", "disaggregated"])
def test_every_rendered_object_passes_the_clients_own_model_check(example, mode):
    """The client validates bodies before sending (a quantity written as a YAML number fails there)."""
    obj = load_pools(EXAMPLES / f"{example}.yaml")[0]
    spec = {**obj["spec"], "mode": mode, "replicas": max(2, obj["spec"]["replicas"]),
            "autoscaling": {"minReplicas": 2, "maxReplicas": 8, "metrics": [
                {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}]}}
    pool = Pool(obj["metadata"]["name"], "default", spec)
    client = kubernetes.client.ApiClient()
    models = {"Deployment": "V1Deployment", "Service": "V1Service", "ConfigMap": "V1ConfigMap",
              "PodDisruptionBudget": "V1PodDisruptionBudget", "ServiceAccount": "V1ServiceAccount",
              "Role": "V1Role", "RoleBinding": "V1RoleBinding", "HorizontalPodAutoscaler": "V2HorizontalPodAutoscaler",
              "NetworkPolicy": "V1NetworkPolicy"}
    for obj in render.render_all(pool, owner={"name": pool.name, "uid": "u"}):
        model = getattr(kubernetes.client, models[obj["kind"]])
        model.from_dict(obj)  # raises on a wrong type
        assert client.sanitize_for_serialization(model.from_dict(obj))["metadata"]["name"] == obj["metadata"]["name"]


def owned(obj: dict, uid: str | None, kind: str = "ServingPool"):
    """The client's read of ``obj`` stored with a controller owner reference to ``uid`` (None: none)."""
    refs = [kubernetes.client.V1OwnerReference(api_version="serving.cadenza.dev/v1alpha1", kind=kind, name="p",
                                               uid=uid, controller=True)] if uid else None
    return kubernetes.client.V1Service(metadata=kubernetes.client.V1ObjectMeta(
        name=obj["metadata"]["name"], uid="obj-uid", owner_references=refs, annotations=obj["metadata"].get("annotations")))


def pool_service(selector: dict) -> dict:
    obj = service(selector)
    obj["metadata"]["ownerReferences"] = [{"apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool",
                                           "name": "p", "uid": "pool-uid", "controller": True}]
    return obj


@pytest.mark.parametrize("controller", [None, "another-pool-uid"])
def test_an_object_the_pool_does_not_control_is_never_patched(fake, controller):
    fake.current = owned(service({"team": "theirs"}), controller)
    with pytest.raises(ssa.Conflict, match="p-batch exists .*not by this pool: left alone"):
        ssa.apply(pool_service({"pool": "p"}))
    assert fake.calls == ["read"]
    fake.current = owned(pool_service({"pool": "p"}), "pool-uid")
    assert ssa.apply(pool_service({"pool": "p"})) == "updated"
    fake.calls = []
    ours = kubernetes.client.ApiClient().sanitize_for_serialization(owned(pool_service({"pool": "p"}), "pool-uid"))
    assert ssa.apply(pool_service({"pool": "p"}), live=ours) == "updated" and fake.calls[0][0] == "patch"  # no read
    with pytest.raises(ssa.Conflict):
        ssa.apply(pool_service({"pool": "p"}), live={"metadata": {"name": "p-batch"}})


def test_a_child_is_deleted_only_when_the_pool_controls_it_and_only_that_very_object(fake):
    fake.current = owned(service({}), None)
    assert ssa.delete("Service", "p-batch", "ns", owner_uid="pool-uid") is False and fake.calls == ["read"]
    fake.current, fake.calls = owned(service({}), "pool-uid"), []
    assert ssa.delete("Service", "p-batch", "ns", owner_uid="pool-uid") is True
    (_, options) = fake.calls[-1]
    assert options.preconditions.uid == "obj-uid"  # not a same-named object created since the read
    fake.current, fake.calls = None, []
    assert ssa.delete("Service", "p-batch", "ns", owner_uid="pool-uid") is False


def test_a_hand_edit_to_a_field_the_operator_sets_is_reverted_and_server_defaults_are_not_drift(fake):
    first = service({"pool": "p", "role": "batch"})
    ssa.apply(first)
    stored = fake.calls[-1][1]
    fake.current, fake.calls = live(stored, cluster_ip="10.0.0.7", session_affinity="None"), []
    assert ssa.apply(first) == "unchanged" and fake.calls == ["read"]  # what the server added is not ours
    edited = {**stored, "spec": {"selector": {"pool": "p", "role": "interactive"}}}  # kubectl edit
    fake.current = live(edited, cluster_ip="10.0.0.7")
    assert ssa.apply(first) == "updated"
    assert fake.calls[-1][1]["spec"]["selector"] == {"pool": "p", "role": "batch"}  # set back
    widened = {**stored, "spec": {"selector": {"pool": "p", "role": "batch", "extra": "x"}}}  # a key added by hand
    fake.current = live(widened, cluster_ip="10.0.0.7")
    assert ssa.apply(first) == "updated"  # a selector is atomic: applied whole, the key goes


def test_a_key_a_server_kept_after_the_apply_dropped_it_is_removed_once(fake):
    """What the operator relies on: an apply replaces a selector whole. A server that merged it
    instead (kmock) answers with the dropped key still there; a merge patch removes it, once."""
    fake.current = live(service({"pool": "p", "role": "batch"}))
    fake.answer = live(service({"pool": "p", "role": "batch"}))  # merged, not replaced
    assert ssa.apply(service({"pool": "p"})) == "updated"
    (_, applied, applied_as), (_, removal, merge) = fake.calls[-2:]
    assert applied_as == ssa.APPLY_PATCH and applied["spec"]["selector"] == {"pool": "p"}
    assert merge == kube.MERGE_PATCH and removal == {"spec": {"selector": {"role": None}}}

    fake.calls, fake.answer = [], live(service({"pool": "p"}))  # a real server: replaced
    ssa.apply(service({"pool": "p", "tier": "x"}))
    assert [call[2] for call in fake.calls if call != "read"] == [ssa.APPLY_PATCH]  # no second write
    assert ssa.leftovers({"kind": "Service", "spec": {"selector": {"a": "1"}}}, service({"a": "1"})) is None
    assert ssa.leftovers({"spec": {"selector": {"a": "1", "b": "2"}}}, service({"a": "1"})) == {
        "spec": {"selector": {"b": None}}}
    policy = {"kind": "NetworkPolicy", "spec": {"podSelector": {"matchLabels": {"a": "1"}}}}
    widened = {"spec": {"podSelector": {"matchLabels": {"a": "1", "b": "2"}, "matchExpressions": []}}}
    assert ssa.leftovers(widened, policy) == {
        "spec": {"podSelector": {"matchExpressions": None, "matchLabels": {"b": None}}}}


def test_containment_reads_maps_by_key_lists_by_item_and_quantities_as_strings():
    assert ssa.contains({"a": 1, "b": {"c": [{"x": 1, "y": 2}]}}, {"b": {"c": [{"x": 1}]}})
    assert not ssa.contains({"b": {"c": [{"x": 1}, {"x": 2}]}}, {"b": {"c": [{"x": 1}]}})  # a list grew
    assert not ssa.contains({"replicas": 5}, {"replicas": 3}) and not ssa.contains({}, {"replicas": 3})
    assert ssa.contains({"limits": {"nvidia.com/gpu": "1"}}, {"limits": {"nvidia.com/gpu": 1}})
    # the API server stores quantities in canonical form: the same amount is not drift
    assert ssa.contains({"memory": "4Gi", "cpu": "1"}, {"memory": "4096Mi", "cpu": "1000m"})
    assert not ssa.contains({"memory": "4Gi"}, {"memory": "4097Mi"}) and not ssa.contains({"n": "1"}, {"n": "10"})
