"""Upstreams from the Kubernetes API: the ready endpoints of a pool's role Services (cluster mode).

A ServingPool ``<pool>`` has one Service per role, ``<pool>-interactive`` and ``<pool>-batch``,
and in disaggregated mode ``<pool>-prefill`` — in mode auto too, selecting the pods the SLO
controller has moved into the prefill role (label ``serves-prefill``), empty until it has (in
the other modes it does not exist: its listing is empty and the gateway prefills nothing elsewhere).
The gateway lists each Service's EndpointSlices (``discovery.k8s.io/v1``, label
``kubernetes.io/service-name=<service>``), then **watches** them, so a pod that stops being ready
or starts terminating (its preStop drain) leaves the routing as soon as the API server says so,
not at the next poll. From every slice it takes the addresses of the endpoints whose
``conditions.ready`` holds (the API reference reads an unset ``ready`` as true) and that are not
``terminating``, with the slice's port named ``http``: ``http://<address>:<port>``. A watch that
ends (the server's timeout, a network error) is followed by a fresh list, then a new watch; a
role whose listing fails keeps its last known upstreams. Without a watch function the gateway
lists every ``interval_s`` instead.

The list and watch functions are injectable: tests pass stubs returning EndpointSlice-like objects
or plain dicts (the snake_case field names used here are the same in both), no cluster needed. The
default ones use the ``kubernetes`` client, in-cluster config inside a pod, else ``$KUBECONFIG``
(or ``~/.kube/config``); their blocking calls run in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from cadenza.gateway.upstreams import ROLES, Upstreams

logger = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 5.0
PORT_NAME = "http"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

WATCH_TIMEOUT_S = 60  # a watch ends after this long and is renewed (after a fresh list)

# (namespace, service name) -> the Service's EndpointSlices (V1EndpointSlice objects or dicts).
ListSlices = Callable[[str, str], Iterable[Any]]
# (namespace, service name) -> ("ADDED" | "MODIFIED" | "DELETED", slice) events until the watch ends.
WatchSlices = Callable[[str, str], Iterator[tuple[str, Any]]]


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
            if conditions is not None and (_field(conditions, "ready") is False
                                           or _field(conditions, "terminating") is True):
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
    return _kubernetes_functions()[0]


def kubernetes_watch_slices() -> WatchSlices:
    """A watch function backed by the ``kubernetes`` client (events until the server's timeout).

    Raises:
        KubernetesConfigError: as :func:`kubernetes_list_slices`.
    """
    return _kubernetes_functions()[1]


def _kubernetes_functions() -> tuple[ListSlices, WatchSlices]:
    from kubernetes import client, config, watch

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

    def watch_slices(namespace: str, service: str) -> Iterator[tuple[str, Any]]:
        for event in watch.Watch().stream(api.list_namespaced_endpoint_slice, namespace,
                                          label_selector=f"{SERVICE_NAME_LABEL}={service}",
                                          timeout_seconds=WATCH_TIMEOUT_S, _request_timeout=WATCH_TIMEOUT_S + 10):
            yield event["type"], event["object"]

    return list_slices, watch_slices


class KubernetesSource:
    """Keeps an :class:`Upstreams` table equal to the ready endpoints of a pool's role Services.

    Args:
        namespace: the pool's namespace.
        pool: the ServingPool name; the Services are ``<pool>-<role>`` for each of :data:`ROLES`.
        list_slices: ``(namespace, service) -> EndpointSlices`` (blocking; run in a thread).
            Default: :func:`kubernetes_list_slices`, built at the first refresh.
        watch_slices: ``(namespace, service) -> events`` (blocking; run in a thread per role).
            Default: :func:`kubernetes_watch_slices` when ``list_slices`` is the default too;
            with a stub lister and no watcher, the source polls every ``interval_s``.
        interval_s: seconds between lists when not watching, and before a new list after a
            watch failed.
    """

    def __init__(self, namespace: str, pool: str, list_slices: ListSlices | None = None,
                 interval_s: float = REFRESH_INTERVAL_S, watch_slices: WatchSlices | None = None) -> None:
        self.namespace = namespace
        self.pool = pool
        self.interval_s = interval_s
        self._list_slices = list_slices
        self._watch_slices = watch_slices
        self._slices: dict[str, dict[str, Any]] = {role: {} for role in ROLES}  # role -> slice name -> slice

    async def refresh(self, upstreams: Upstreams) -> bool:
        """List every role once and apply what was read; a failed role keeps its replicas.

        Returns whether the table changed. Never raises for a failed listing (it is logged).
        """
        if self._list_slices is None:
            self._list_slices, self._watch_slices = _kubernetes_functions()
        roles = upstreams.urls()
        for role in ROLES:
            service = service_name(self.pool, role)
            try:
                slices = list(await asyncio.to_thread(self._list_slices, self.namespace, service))
                self._slices[role] = {_slice_name(s, i): s for i, s in enumerate(slices)}
                roles[role] = endpoint_urls(slices)
            except Exception as exc:  # the API server, the network, RBAC: try again next time
                logger.warning("keeping the last %s upstreams: cannot list %s/%s endpoints: %s",
                               role, self.namespace, service, exc)
        changed = upstreams.replace(roles)
        if changed:
            logger.info("upstreams of %s/%s: %s", self.namespace, self.pool, upstreams.urls())
        return changed

    async def watch(self, upstreams: Upstreams) -> None:
        """List, then follow the watch of every role (or, without a watcher, list every
        ``interval_s``), until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                await self.refresh(upstreams)
            except KubernetesConfigError as exc:
                logger.error("%s", exc)
            if self._watch_slices is None:
                await asyncio.sleep(self.interval_s)
                continue
            ended = [loop.create_future() for _ in ROLES]
            for role, done in zip(ROLES, ended):
                threading.Thread(target=self._follow, args=(role, upstreams, loop, done), daemon=True,
                                 name=f"gateway-watch-{role}").start()
            # Relist when any watch ends: the events of the others are then listed again anyway.
            finished, _ = await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
            if any(f.result() for f in finished):  # it failed, not just timed out: back off first
                await asyncio.sleep(self.interval_s)

    def _follow(self, role: str, upstreams: Upstreams, loop: asyncio.AbstractEventLoop,
                done: asyncio.Future) -> None:
        """Apply one role's watch events (in a thread) until the watch ends; ``done`` gets whether
        it failed. A watch outliving its relist is harmless: both apply the API server's state."""
        service = service_name(self.pool, role)
        failed = False
        try:
            for kind, obj in self._watch_slices(self.namespace, service):
                name = _slice_name(obj, 0)
                slices = dict(self._slices[role])
                if kind == "DELETED":
                    slices.pop(name, None)
                else:
                    slices[name] = obj
                self._slices[role] = slices
                urls = endpoint_urls(slices.values())
                try:
                    loop.call_soon_threadsafe(self._apply, upstreams, role, urls)
                except RuntimeError:  # the gateway is shutting down: its loop is closed
                    return
        except Exception as exc:  # noqa: BLE001 - the API server, the network, RBAC: relist, then watch again
            logger.warning("watch of %s/%s endpoints ended: %s", self.namespace, service, exc)
            failed = True
        try:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(failed))
        except RuntimeError:
            pass

    def _apply(self, upstreams: Upstreams, role: str, urls: list[str]) -> None:
        roles = upstreams.urls()
        roles[role] = urls
        if upstreams.replace(roles):
            logger.info("upstreams of %s/%s: %s", self.namespace, self.pool, upstreams.urls())


def _slice_name(obj: Any, index: int) -> str:
    meta = _field(obj, "metadata")
    return (_field(meta, "name") if meta is not None else None) or f"#{index}"
