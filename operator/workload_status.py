"""Why a role is not serving, from its Deployment's conditions and its pods' states: the
reasons a pool's ``Ready`` and ``Degraded`` conditions carry.

Pure functions over the plain dicts :func:`cadenza.operator.kube.deployment_status` and
:func:`~cadenza.operator.kube.list_pods` return, so they are tested without a cluster.

Reasons, most telling first (a pod's own beats its Deployment's summary):

- a pod's ``Unschedulable`` (with the scheduler's message: "0/8 nodes are available: 8
  Insufficient nvidia.com/gpu"), ``ImagePullBackOff`` / ``ErrImagePull``, ``CrashLoopBackOff``,
  ``OOMKilled`` (its last termination), ``CreateContainerConfigError``;
- the Deployment's ``ProgressDeadlineExceeded`` (Progressing false) and ``ReplicaFailure``
  (e.g. a quota refusing pods).

Of those, all but ``Unschedulable`` are **degraded**: nothing will change until someone acts.
An unschedulable pod may yet be placed (a cluster autoscaler adding a node), so it only keeps
the role from being ready.

Follows the Deployment and Pod status API (``kubectl describe``'s reading of them) and the
condition conventions of the Kubernetes API (``Ready`` / ``Degraded`` with a CamelCase reason).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

DEGRADING = frozenset({"ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "OOMKilled",
                       "CreateContainerConfigError", "InvalidImageName", "ProgressDeadlineExceeded", "ReplicaFailure"})


def pod_problem(pods: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """``(reason, message)`` of the first pod that reports one, None when none does."""
    for pod in pods:
        if problem := pod.get("problem"):
            return problem["reason"], f"pod {pod['name']}: {problem.get('message') or problem['reason']}"
    return None


def deployment_problem(state: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(reason, message)`` from a Deployment's conditions: a rollout past its deadline, or
    pods the ReplicaSet could not create; None when neither."""
    for cond in state.get("conditions", ()):
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return "ReplicaFailure", cond.get("message") or cond.get("reason") or "pods could not be created"
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return "ProgressDeadlineExceeded", cond.get("message") or "the rollout passed its progress deadline"
    return None


def observed(state: Mapping[str, Any]) -> bool:
    """Whether the Deployment's controller has seen its latest spec (``observedGeneration``)."""
    generation, seen = state.get("generation"), state.get("observedGeneration")
    return generation is None or (seen is not None and seen >= generation)
