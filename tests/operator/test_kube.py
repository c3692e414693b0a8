"""The API client's reads and error kinds: the admin Secret, a stuck pod's reason, a Deployment's rollout."""

from __future__ import annotations

import kubernetes
import pytest

from cadenza.operator import kube


def test_the_admin_secret_of_an_earlier_pool_of_the_same_name_is_not_taken_over(monkeypatch):
    """Deleted and re-created at once: the old pool's Secret is still there until the garbage
    collector takes it, and its token with it. The new pool waits rather than adopting it."""
    old = kubernetes.client.V1Secret(
        metadata=kubernetes.client.V1ObjectMeta(name="chat-admin", owner_references=[kubernetes.client.V1OwnerReference(
            api_version="serving.cadenza.dev/v1alpha1", kind="ServingPool", name="chat", uid="old-uid", controller=True)]),
        data={"token": "b2xk"})
    monkeypatch.setattr(kubernetes.client.CoreV1Api, "read_namespaced_secret", lambda self, name, ns: old)
    meta = {"name": "chat-admin", "namespace": "ns", "ownerReferences": [
        {"apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool", "name": "chat", "uid": "new-uid",
         "controller": True}]}
    with pytest.raises(kube.Transient, match="still ServingPool/chat's"):
        kube.ensure_secret_token(meta, "fresh")
    meta["ownerReferences"][0]["uid"] = "old-uid"
    assert kube.ensure_secret_token(meta, "fresh") == "old"


def test_a_stuck_pod_is_read_as_its_reason():
    c = kubernetes.client

    def container(waiting=None, last=None):
        return c.V1ContainerStatus(name="engine", image="i", image_id="", ready=False, restart_count=3,
                                   state=c.V1ContainerState(waiting=waiting),
                                   last_state=c.V1ContainerState(terminated=last))

    unschedulable = c.V1PodStatus(conditions=[c.V1PodCondition(type="PodScheduled", status="False", reason="Unschedulable",
                                                               message="0/3 nodes are available")])
    assert kube._pod_problem(unschedulable) == {"reason": "Unschedulable", "message": "0/3 nodes are available"}
    pull = c.V1PodStatus(container_statuses=[container(c.V1ContainerStateWaiting(reason="ImagePullBackOff",
                                                                                 message="Back-off pulling x"))])
    assert kube._pod_problem(pull) == {"reason": "ImagePullBackOff", "message": "container engine: Back-off pulling x"}
    oom = c.V1PodStatus(container_statuses=[container(c.V1ContainerStateWaiting(reason="CrashLoopBackOff"),
                                                      c.V1ContainerStateTerminated(exit_code=137, reason="OOMKilled"))])
    assert kube._pod_problem(oom)["reason"] == "OOMKilled"
    assert kube._pod_problem(c.V1PodStatus(container_statuses=[container()])) is None


def test_a_deployment_not_yet_observed_is_still_progressing():
    from cadenza.operator.workload_status import observed

    assert not observed({"generation": 4, "observedGeneration": 3}) and observed({"generation": 4, "observedGeneration": 4})
    assert observed({})  # a server that reports neither
