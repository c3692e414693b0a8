"""Upstreams from the Kubernetes API: the ready endpoints of a pool's role Services (cluster mode).

A ServingPool ``<pool>`` has one Service per role, ``<pool>-interactive`` and ``<pool>-batch``.
Every ``interval_s`` the gateway lists each Service's EndpointSlices (``discovery.k8s.io/v1``,
label ``kubernetes.io/service-name=<service>``) and takes, from every slice, the addresses of
the endpoints whose ``conditions.ready`` holds (the API reference reads an unset ``ready`` as
true) with the slice's port named ``http``: ``http://<address>:<port>``. A role whose listing
fails keeps its last known upstreams.

The listing function is injectable: tests pass a stub returning EndpointSlice-like objects or
plain dicts (the snake_case field names used here are the same in both), no cluster needed. The
default one uses the ``kubernetes`` client, in-cluster config inside a pod, else ``$KUBECONFIG``
(or ``~/.kube/config``); its blocking calls run in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

from cadenza.node.gateway.upstreams import ROLES, Upstreams

logger = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 5.0
PORT_NAME = "http"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

# (namespace, service name) -> the Service's EndpointSlices (V1EndpointSlice objects or dicts).
ListSlices = Callable[[str, str], Iterable[Any]]


class KubernetesConfigError(RuntimeError):
    """No usable cluster credentials (neither in-cluster nor a kubeconfig)."""


def service_name(pool: str, role: str) -> str:
    """The Service of ``role`` in ``pool``: ``<pool>-<role>``."""
    return f"{pool}-{role}"


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def endpoint_urls(slices: Iterable[Any], port_name: str = PORT_NAME) -> list[str]:
    """Sorted, distinct ``http://address:port`` of the ready endpoints in ``slices``.

    A slice without a port named ``port_name`` contributes nothing; IPv6 addresses are bracketed.
    """
    urls = set()
    for s in slices:
        port = next((_field(p, "port") for p in _field(s, "ports") or () if _field(p, "name") == port_name), None)
        if port is None:
            continue
        for endpoint in _field(s, "endpoints") or ():
            conditions = _field(endpoint, "conditions")
            if conditions is not None and _field(conditions, "ready") is False:
                continue
            for address in _field(endpoint, "addresses") or ():
                host = f"[{address}]" if ":" in address else address
                urls.add(f"http://{host}:{port}")
    return sorted(urls)


def kubernetes_list_slices() -> ListSlices:
    """A listing function backed by the ``kubernetes`` client, configured once now.

    Raises:
        KubernetesConfigError: neither in-cluster config nor a kubeconfig could be loaded.
    """
    from kubernetes import client, config

    settings = client.Configuration()  # our own, not the process-wide default
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=settings)
        else:
            # $KUBECONFIG read now (the client reads it once, at import), else ~/.kube/config.
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                    client_configuration=settings)
    except (config.ConfigException, OSError, TypeError, ValueError) as exc:
        raise KubernetesConfigError(f"cannot load Kubernetes credentials: {exc}") from None
    api = client.DiscoveryV1Api(client.ApiClient(settings))

    def list_slices(namespace: str, service: str) -> list[Any]:
        return api.list_namespaced_endpoint_slice(
            namespace, label_selector=f"{SERVICE_NAME_LABEL}={service}", _request_timeout=10
        ).items

    return list_slices


class KubernetesSource:
    """Keeps an :class:`Upstreams` table equal to the ready endpoints of a pool's role Services.

    Args:
        namespace: the pool's namespace.
        pool: the ServingPool name; the Services are ``<pool>-interactive`` and ``<pool>-batch``.
        list_slices: ``(namespace, service) -> EndpointSlices`` (blocking; run in a thread).
            Default: :func:`kubernetes_list_slices`, built at the first refresh.
        interval_s: seconds between refreshes.
    """

    def __init__(self, namespace: str, pool: str, list_slices: ListSlices | None = None,
                 interval_s: float = REFRESH_INTERVAL_S) -> None:
        self.namespace = namespace
        self.pool = pool
        self.interval_s = interval_s
        self._list_slices = list_slices

    async def refresh(self, upstreams: Upstreams) -> bool:
        """List every role once and apply what was read; a failed role keeps its replicas.

        Returns whether the table changed. Never raises for a failed listing (it is logged).
        """
        if self._list_slices is None:
            self._list_slices = kubernetes_list_slices()
        roles = upstreams.urls()
        for role in ROLES:
            service = service_name(self.pool, role)
            try:
                slices = await asyncio.to_thread(self._list_slices, self.namespace, service)
                roles[role] = endpoint_urls(slices)
            except Exception as exc:  # the API server, the network, RBAC: try again next time
                logger.warning("keeping the last %s upstreams: cannot list %s/%s endpoints: %s",
                               role, self.namespace, service, exc)
        changed = upstreams.replace(roles)
        if changed:
            logger.info("upstreams of %s/%s: %s", self.namespace, self.pool, upstreams.urls())
        return changed

    async def watch(self, upstreams: Upstreams) -> None:
        """Refresh now and every ``interval_s`` until cancelled."""
        while True:
            try:
                await self.refresh(upstreams)
            except KubernetesConfigError as exc:
                logger.error("%s", exc)
            await asyncio.sleep(self.interval_s)
