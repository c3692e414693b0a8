"""One read of a pool per pass: everything its status and its control need, each source read once.

- the Deployments of its roles and of the roles it no longer runs (from the watches' indexes:
  no API call under ``kopf run``);
- the pods of a role short of ready replicas, and only then (why it is short: unschedulable, an
  image that cannot be pulled, a crash loop);
- one scrape of its gateways' and engines' ``/metrics`` (:func:`~.k8s_roles.scrape_pool`),
  shared by the disaggregation threshold and the SLO signals, made only when one needs it;
- the SLO part: a ``mode: auto`` pool's controller tick, or the advice for a pool of fixed shape
  with ``spec.slo`` (:mod:`.slo`), when asked for (the resync loop asks; a reconcile does not).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cadenza.operator import kube, render
from cadenza.operator.children import Children
from cadenza.operator.k8s_roles import scrape_pool
from cadenza.pool.spec import Pool, Role

Scrape = Callable[[], Mapping[str, str] | None]


@dataclass(frozen=True)
class Observed:
    """What one pass read of a pool.

    Attributes:
        deployments: by Deployment name, :func:`kube.deployment_state` (None: there is none).
        pods: by role, its pods (:func:`kube.list_pods`), for a role short of ready replicas only.
        metrics: ``/metrics`` text by pod for the disaggregation threshold, None when not needed
            (another mode, or a pinned threshold) or when no gateway answered.
        slo: the SLO fields (``latency``, ``controller``, ``sloMet`` ...: :mod:`.slo`), None when
            not read this pass (the last ``SLOMet`` condition is kept then).
    """

    deployments: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)
    pods: Mapping[str, Sequence[Mapping[str, Any]]] = field(default_factory=dict)
    metrics: Mapping[str, str] | None = None
    slo: dict | None = None

    def deployment(self, name: str) -> Mapping[str, Any] | None:
        return self.deployments.get(name)

    def role_ready(self, pool: Pool, role: Role) -> bool:
        """Whether every replica of ``role`` runs the current template and is ready."""
        state = self.deployment(f"{pool.name}-{role.name}")
        return state is not None and min(state["readyReplicas"], state["updatedReplicas"]) >= role.replicas


def observe(pool: Pool, roles: Sequence[Role], children: Children,
            slo: Callable[[Scrape], dict | None] | None = None) -> Observed:
    """Read ``pool`` once for this pass (see the module's docstring).

    Args:
        pool, roles: the pool and the roles it runs.
        children: where its Deployments are read (the watches' indexes, or the API).
        slo: reads the SLO part given the pass's one scrape (:func:`.slo.read_slo`); None: not this pass.

    Raises:
        kube.Transient, kube.Refused: an API read failed.
    """
    scrape = functools.cache(lambda: scrape_pool(pool))  # one scrape, whoever asks first
    fields = slo(scrape) if slo is not None else None
    names = [f"{pool.name}-{role.name}" for role in roles] + render.stale_deployments(pool, roles)
    deployments = {name: children.deployment(pool.namespace, name) for name in dict.fromkeys(names)}
    pods = {}
    for role in roles:
        state = deployments[f"{pool.name}-{role.name}"]
        if state and min(state.get("readyReplicas", 0), role.replicas) < role.replicas:
            pods[role.name] = kube.list_pods(pool.namespace, render.role_selector(pool, role.name))
    threshold = pool.mode == "disaggregated" and pool.min_prompt_tokens is None
    return Observed(deployments, pods, scrape() if threshold else None, fields)
