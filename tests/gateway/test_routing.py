"""Routing by class, headers both ways, and the gateway's own endpoints."""

from __future__ import annotations

import pytest

BODY = {"model": "fake", "prompt": "hi", "max_tokens": 2}
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
async def pool(start_replica, start_gateway):
    """A dedicated pool: one interactive replica, one batch replica, a gateway in front."""
    inter, batch = await start_replica("inter"), await start_replica("batch")
    gateway = await start_gateway({"interactive": [inter.url], "batch": [batch.url]})
    return gateway, inter, batch


@pytest.mark.parametrize("cls, replica", [("interactive", "inter"), ("batch", "batch"), ("background", "batch"),
                                          ("BATCH", "batch"), (None, "inter")])
async def test_requests_go_to_the_role_of_their_class(pool, cls, replica):
    gateway, *_ = pool
    headers = {"x-cadenza-class": cls} if cls else {}
    resp = await gateway.post("/v1/completions", json=BODY, headers=headers)
    assert resp.status == 200
    assert (await resp.json())["replica"] == replica


async def test_the_default_class_is_configurable(start_replica, start_gateway):
    inter, batch = await start_replica("inter"), await start_replica("batch")
    gateway = await start_gateway({"interactive": [inter.url], "batch": [batch.url]}, default_class="background")
    resp = await gateway.post("/v1/chat/completions", json={"model": "fake", "messages": []})
    assert (await resp.json())["replica"] == "batch"


async def test_an_invalid_class_is_a_400_from_the_gateway_itself(pool):
    gateway, inter, batch = pool
    resp = await gateway.post("/v1/completions", json=BODY, headers={"x-cadenza-class": "urgent"})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "x-cadenza-class"
    assert "urgent" in error["message"]
    assert inter.calls == batch.calls == 0


async def test_trace_tenant_and_auth_headers_reach_the_replica_and_hop_by_hop_ones_do_not(pool):
    gateway, inter, _ = pool
    sent = {"traceparent": TRACEPARENT, "tracestate": "rojo=00f067aa0ba902b7", "x-cadenza-tenant": "acme",
            "x-cadenza-class": "Interactive", "authorization": "Bearer k", "x-custom": "1",
            "Connection": "keep-alive, x-drop-me", "x-drop-me": "1", "Upgrade": "websocket"}
    resp = await gateway.post("/v1/completions?trace=1", json=BODY, headers=sent)
    assert resp.status == 200
    (got,) = inter.received
    assert got["path"] == "/v1/completions?trace=1"
    for name in ("traceparent", "tracestate", "x-cadenza-tenant", "x-cadenza-class", "authorization", "x-custom"):
        assert got["headers"][name] == sent[name]
    assert "x-drop-me" not in got["headers"] and "upgrade" not in got["headers"]
    assert b'"prompt": "hi"' in got["body"]


async def test_status_and_end_to_end_headers_come_back(pool):
    gateway, inter, _ = pool
    inter.mode = "429"  # a lone replica: nothing to retry on, so its answer comes back as it is
    resp = await gateway.post("/v1/completions", json=BODY)
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "7"
    assert resp.headers["x-request-id"] == "inter-1"
    assert resp.headers["content-type"].startswith("application/json")
    assert (await resp.json())["error"]["message"] == "busy"


async def test_models_are_proxied_to_a_replica(pool):
    gateway, *_ = pool
    resp = await gateway.get("/v1/models", headers={"x-cadenza-class": "whatever"})
    assert resp.status == 200
    assert (await resp.json())["data"][0]["id"] == "fake"


async def test_unknown_routes_are_a_404_in_openai_format(pool):
    gateway, *_ = pool
    resp = await gateway.get("/nope")
    assert resp.status == 404
    assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("method", "path"), [("GET", "/admin/config"), ("PUT", "/admin/config")])
async def test_admin_on_the_gateway_says_where_it_lives_without_listing_the_replicas(pool, method, path):
    gateway, inter, batch = pool
    resp = await gateway.request(method, path, json={"chunk_size": 8} if method == "PUT" else None)
    assert resp.status == 404
    error = (await resp.json())["error"]
    assert error["code"] == "per_replica"
    assert f"at {path} on its own address" in error["message"] and "cadenza up" in error["message"]
    for replica in (inter, batch):  # internal addresses are not given to whoever asks
        host_port = replica.url.removeprefix("http://")
        assert host_port not in error["message"] and host_port.split(":")[1] not in error["message"]
    assert inter.calls == batch.calls == 0


async def test_health_is_always_ok_and_ready_needs_a_role_that_can_serve(pool, start_gateway):
    gateway, inter, _ = pool
    assert (await gateway.get("/health")).status == 200
    resp = await gateway.get("/ready")
    assert resp.status == 200 and (await resp.json())["replicas"] == {"interactive": 1, "batch": 1}

    half = await start_gateway({"interactive": [inter.url]})
    assert (await half.get("/health")).status == 200
    resp = await half.get("/ready")  # interactive can be served: ready, naming what cannot
    assert resp.status == 200 and (await resp.json())["unavailable"] == {"batch": "no replica known"}
    none = await start_gateway({})
    resp = await none.get("/ready")
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "no_upstream"
    resp = await half.post("/v1/completions", json=BODY, headers={"x-cadenza-class": "batch"})
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "no_upstream"


async def test_ready_counts_the_replicas_known_and_up_per_role_prefill_included(start_replica, start_gateway,
                                                                               dead_url):
    from cadenza.gateway.state import UPSTREAMS
    from waiting import until

    decode, prefill = await start_replica("decode"), await start_replica("prefill")
    gateway = await start_gateway({"interactive": [decode.url], "batch": [decode.url], "prefill": [prefill.url]})
    body = await (await gateway.get("/ready")).json()
    assert body["replicas"] == body["up"] == {"interactive": 1, "batch": 1, "prefill": 1}
    assert body["unavailable"] == {}

    # its prefill replica down: the pool still serves (the decode replicas prefill), and says so
    gateway = await start_gateway({"interactive": [decode.url], "batch": [decode.url], "prefill": [dead_url]},
                                  health_interval_s=0.05)

    upstreams = gateway.server.app[UPSTREAMS]
    await until(lambda: not upstreams.reachable("prefill"), what="the prefill replica's health check to fail")
    resp = await gateway.get("/ready")
    body = await resp.json()
    assert resp.status == 200 and body["replicas"]["prefill"] == 1 and body["up"]["prefill"] == 0
    assert body["unavailable"] == {"prefill": "every replica down: the decode replicas prefill every prompt"}


async def test_gateway_upstreams_shows_each_replica_load(start_replica, start_gateway):
    shared = await start_replica("shared")
    gateway = await start_gateway({"interactive": [shared.url], "batch": [shared.url]}, max_outstanding=5)
    view = await (await gateway.get("/gateway/upstreams")).json()
    assert view["max_outstanding"] == 5 and view["default_class"] == "interactive"
    assert view["roles"]["batch"] == [{"url": shared.url, "outstanding": 0, "full": False, "retry_after_s": 0,
                                        "down": False}]
    assert view["roles"]["interactive"] == view["roles"]["batch"]


def test_an_invalid_default_class_or_limit_is_refused():
    from cadenza.gateway.app import create_gateway_app
    from cadenza.gateway.upstreams import Upstreams

    with pytest.raises(ValueError, match="class"):
        create_gateway_app(Upstreams(), default_class="urgent")
    with pytest.raises(ValueError, match="max_outstanding"):
        create_gateway_app(Upstreams(), max_outstanding=0)
