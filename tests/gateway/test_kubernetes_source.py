"""Upstreams from EndpointSlices, with a stub in place of the Kubernetes API (no cluster)."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes import client

from cadenza.gateway.app import create_gateway_app
from cadenza.gateway.kubernetes_source import KubernetesSource, endpoint_urls, service_name
from cadenza.gateway.upstreams import Upstreams


def slice_dict(addresses_ready: dict[str, bool | None], port: int = 8000, port_name: str = "http") -> dict:
    """An EndpointSlice as the API returns it (JSON form): one endpoint per address."""
    return {
        "addressType": "IPv4",
        "endpoints": [{"addresses": [a], "conditions": {} if ready is None else {"ready": ready}}
                      for a, ready in addresses_ready.items()],
        "ports": [{"name": "metrics", "port": 9090}, {"name": port_name, "port": port, "protocol": "TCP"}],
    }


def slice_object(addresses_ready: dict[str, bool], port: int = 8000) -> client.V1EndpointSlice:
    """The same, as the ``kubernetes`` client's model objects."""
    return client.V1EndpointSlice(
        address_type="IPv4",
        endpoints=[client.V1Endpoint(addresses=[a], conditions=client.V1EndpointConditions(ready=ready))
                   for a, ready in addresses_ready.items()],
        ports=[client.DiscoveryV1EndpointPort(name="http", port=port)],
    )


def test_only_ready_endpoints_with_the_http_port_become_urls():
    slices = [
        slice_dict({"10.0.0.2": True, "10.0.0.3": False, "10.0.0.4": None}),
        slice_dict({"10.0.0.5": True}, port_name="grpc"),  # no port named http: ignored
        slice_object({"10.0.1.1": True, "10.0.1.2": False}, port=8001),
        slice_dict({"fd00::7": True}),
        slice_dict({"10.0.0.2": True}),  # the same endpoint in two slices: once
    ]
    assert endpoint_urls(slices) == ["http://10.0.0.2:8000", "http://10.0.0.4:8000", "http://10.0.1.1:8001",
                                     "http://[fd00::7]:8000"]


def test_the_role_services_are_named_after_the_pool():
    assert service_name("chat", "interactive") == "chat-interactive"
    assert service_name("chat", "batch") == "chat-batch"


class FakeAPI:
    """``list_slices(namespace, service)`` backed by a dict; raises for services marked broken."""

    def __init__(self, slices: dict[str, list]) -> None:
        self.slices = slices
        self.broken: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def __call__(self, namespace: str, service: str) -> list:
        self.calls.append((namespace, service))
        if service in self.broken:
            raise RuntimeError("apiserver unavailable")
        return self.slices.get(service, [])


async def test_refresh_reads_each_role_service_and_keeps_the_last_upstreams_on_failure():
    api = FakeAPI({"chat-interactive": [slice_dict({"10.0.0.2": True})],
                   "chat-batch": [slice_object({"10.0.0.3": True, "10.0.0.9": False})],
                   "chat-prefill": [slice_dict({"10.0.0.7": True})]})  # a disaggregated pool's prefill pods
    table = Upstreams()
    source = KubernetesSource("serving", "chat", api)
    assert await source.refresh(table)
    assert table.urls() == {"interactive": ["http://10.0.0.2:8000"], "batch": ["http://10.0.0.3:8000"],
                            "prefill": ["http://10.0.0.7:8000"]}
    assert sorted(api.calls) == [("serving", "chat-batch"), ("serving", "chat-interactive"), ("serving", "chat-prefill")]

    api.broken = {"chat-interactive"}
    api.slices["chat-batch"] = [slice_dict({"10.0.0.3": True, "10.0.0.4": True})]
    await source.refresh(table)
    assert table.urls() == {"interactive": ["http://10.0.0.2:8000"],
                            "batch": ["http://10.0.0.3:8000", "http://10.0.0.4:8000"],
                            "prefill": ["http://10.0.0.7:8000"]}

    api.broken = {"chat-interactive", "chat-batch"}
    assert not await source.refresh(table)
    assert table.urls()["batch"] == ["http://10.0.0.3:8000", "http://10.0.0.4:8000"]


async def test_the_gateway_is_ready_once_the_slices_list_a_replica_per_role(aiohttp_client):
    api = FakeAPI({})
    gateway = await aiohttp_client(create_gateway_app(Upstreams(), source=KubernetesSource("ns", "p", api,
                                                                                           interval_s=0.02)))
    assert (await gateway.get("/ready")).status == 503
    api.slices = {"p-interactive": [slice_dict({"10.1.0.1": True})], "p-batch": [slice_dict({"10.1.0.2": True})]}
    async with asyncio.timeout(30):
        while (await gateway.get("/ready")).status != 200:
            await asyncio.sleep(0.02)
    view = await (await gateway.get("/gateway/upstreams")).json()
    assert [u["url"] for u in view["roles"]["batch"]] == ["http://10.1.0.2:8000"]


def test_without_cluster_credentials_the_default_lister_fails_clearly(monkeypatch, tmp_path):
    from cadenza.gateway.kubernetes_source import KubernetesConfigError, kubernetes_list_slices

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    with pytest.raises(KubernetesConfigError, match="credentials"):
        kubernetes_list_slices()


async def test_the_default_lister_asks_the_api_for_the_service_slices(aiohttp_server, monkeypatch, tmp_path):
    from aiohttp import web

    from cadenza.gateway.kubernetes_source import kubernetes_list_slices

    asked = []

    async def list_slices(request: web.Request) -> web.Response:
        asked.append((request.match_info["ns"], request.query.get("labelSelector"),
                      request.headers.get("Authorization")))
        return web.json_response({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                  "metadata": {}, "items": [slice_dict({"10.2.0.1": True}, port=8123)]})

    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", list_slices)
    api = await aiohttp_server(app)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: t\n"
        f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{api.port}'}}}}]\n"
        "users: [{name: u, user: {token: s3cret}}]\n"
        "contexts: [{name: t, context: {cluster: c, user: u}}]\n"
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    table = Upstreams()
    await KubernetesSource("serving", "chat", kubernetes_list_slices()).refresh(table)
    assert table.urls() == {role: ["http://10.2.0.1:8123"] for role in ("interactive", "batch", "prefill")}
    assert sorted(asked) == [("serving", f"kubernetes.io/service-name=chat-{role}", "Bearer s3cret")
                             for role in ("batch", "interactive", "prefill")]


def test_terminating_endpoints_are_not_routed_to():
    s = {"ports": [{"name": "http", "port": 8000}], "endpoints": [
        {"addresses": ["10.0.0.1"], "conditions": {"ready": True, "serving": True, "terminating": False}},
        {"addresses": ["10.0.0.2"], "conditions": {"ready": True, "serving": True, "terminating": True}}]}
    assert endpoint_urls([s]) == ["http://10.0.0.1:8000"]


class FakeWatch:
    """``watch_slices``: events pushed by the test, per service, until it ends the watch."""

    def __init__(self) -> None:
        import queue

        self.queues: dict[str, queue.Queue] = {}
        self.started: list[str] = []
        self._queue = queue.Queue

    def push(self, service: str, kind: str, obj) -> None:
        self.queues.setdefault(service, self._queue()).put((kind, obj))

    def __call__(self, namespace: str, service: str):
        self.started.append(service)
        q = self.queues.setdefault(service, self._queue())
        while True:
            item = q.get()
            if item is None:
                return
            yield item


async def test_a_watch_applies_slice_changes_at_once_not_at_the_next_poll():
    named = lambda name, ready: {"metadata": {"name": name}, **slice_dict(ready)}  # noqa: E731
    api = FakeAPI({"p-interactive": [named("s1", {"10.1.0.1": True})], "p-batch": [named("b1", {"10.2.0.1": True})]})
    watcher = FakeWatch()
    upstreams = Upstreams()
    source = KubernetesSource("ns", "p", api, interval_s=3600, watch_slices=watcher)  # polling would take an hour
    task = asyncio.create_task(source.watch(upstreams))
    try:
        async with asyncio.timeout(10):
            while len(watcher.started) < 2:
                await asyncio.sleep(0.01)
        assert upstreams.urls()["interactive"] == ["http://10.1.0.1:8000"]
        # A second pod becomes ready, then the first starts terminating (its preStop drain).
        watcher.push("p-interactive", "MODIFIED", named("s1", {"10.1.0.1": True, "10.1.0.3": True}))
        async with asyncio.timeout(10):
            while upstreams.urls()["interactive"] != ["http://10.1.0.1:8000", "http://10.1.0.3:8000"]:
                await asyncio.sleep(0.01)
        watcher.push("p-interactive", "MODIFIED", named("s1", {"10.1.0.1": False, "10.1.0.3": True}))
        async with asyncio.timeout(10):
            while upstreams.urls()["interactive"] != ["http://10.1.0.3:8000"]:
                await asyncio.sleep(0.01)
        watcher.push("p-batch", "DELETED", named("b1", {}))
        async with asyncio.timeout(10):
            while upstreams.urls()["batch"]:
                await asyncio.sleep(0.01)
        assert upstreams.urls()["interactive"] == ["http://10.1.0.3:8000"]  # the other role untouched
        calls = len(api.calls)
        watcher.queues["p-batch"].put(None)  # the watch ends (the server's timeout)
        async with asyncio.timeout(10):
            while len(api.calls) == calls:  # a fresh list follows
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        for q in watcher.queues.values():
            q.put(None)
