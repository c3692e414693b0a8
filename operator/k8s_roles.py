"""Hybrid mode in a cluster: the in-place actuation (:mod:`cadenza.control.in_place`) over the pods of
a ``mode: auto`` pool.

- Replicas are the pool's engine pods (``serving.cadenza.dev/workload: auto``), reached at their
  pod IP on the container port named ``http``.
- A role is the pod label ``serving.cadenza.dev/role`` (``colocated``, ``interactive`` or
  ``prefill``); routing is the labels ``serving.cadenza.dev/serves-interactive`` /
  ``serves-batch`` / ``serves-prefill``, which the route Services ``<pool>-interactive`` /
  ``-batch`` / ``-prefill`` select, so the gateways (following those Services' EndpointSlices)
  route by them — a pod labelled ``serves-prefill`` is a prefill replica to them, as in a
  disaggregated pool. A role change patches labels — the Deployment's selector does not hold
  them, so no pod is created or deleted.
- Settings go through each pod's ``PUT /admin/config`` with the pool's token, read from the Secret
  the operator created and mounted into the pods.
- The gateways' ``/metrics`` (latency) and the engines' (queues, KV, preemptions, predicted step
  time) are scraped at their pod IPs, in parallel.

The loop's state (its history and the actuation's :class:`~cadenza.control.in_place.State`) is
stored in ``status.controller`` by the handler, so an operator that restarts comes back to the same
shape, knobs, cooldown and drain.
"""

from __future__ import annotations

import logging
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPException

from cadenza.operator import kube, render
from cadenza.control.replicas import Replica
from cadenza.pool.spec import Pool

logger = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 2.0
SCRAPE_WORKERS = 16


class PodBackend:
    """The engine and gateway pods of one pool."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def replicas(self) -> list[Replica]:
        pods = kube.list_pods(self.pool.namespace, {render.POOL_LABEL: self.pool.name,
                                                    render.COMPONENT_LABEL: "engine", render.WORKLOAD_LABEL: "auto"})
        return [Replica(p["name"], f"http://{p['ip']}:{p['port']}", ready=bool(p["ready"] and p["ip"]),
                        routes=frozenset(route for route, label in render.ROUTE_LABELS.items()
                                         if p["labels"].get(label) == "true"))
                for p in sorted(pods, key=lambda p: p["name"])]

    def scrape(self) -> dict[str, str] | None:
        return scrape_pool(self.pool)

    def route(self, replica: Replica, role: str, routes: frozenset[str]) -> None:
        """One patch of the pod's role label and its route labels (each set or removed)."""
        kube.patch_pod_labels(replica.name, self.pool.namespace, {
            render.ROLE_LABEL: role,
            **{label: "true" if route in routes else None for route, label in render.ROUTE_LABELS.items()},
        })
        replica.routes = frozenset(routes)


def scrape_pool(pool: Pool) -> dict[str, str] | None:
    """``/metrics`` of every ready gateway and engine pod of ``pool``, by pod name; None when no
    gateway answered (without latency there is nothing to decide on)."""
    pods = [(component, pod) for component in ("gateway", "engine")
            for pod in kube.list_pods(pool.namespace, {render.POOL_LABEL: pool.name, render.COMPONENT_LABEL: component})
            if pod["ready"] and pod["ip"]]
    if not pods:
        return None
    with ThreadPoolExecutor(min(SCRAPE_WORKERS, len(pods))) as workers:
        texts = list(workers.map(lambda cp: (cp[0], cp[1]["name"], _get_metrics(cp[1])), pods))
    if not any(component == "gateway" and text is not None for component, _name, text in texts):
        return None
    return {name: text for _component, name, text in texts if text is not None}


def _get_metrics(pod: dict) -> str | None:
    try:
        with urllib.request.urlopen(f"http://{pod['ip']}:{pod['port']}/metrics", timeout=SCRAPE_TIMEOUT_S) as resp:
            return resp.read().decode()
    except (OSError, HTTPException, ValueError):
        return None  # that pod is not counted this time
