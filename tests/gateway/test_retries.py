"""One retry, to another replica of the role, and only before the client has seen a byte."""

from __future__ import annotations

import pytest

from cadenza.gateway.state import UPSTREAMS

BODY = {"model": "fake", "prompt": "hi", "max_tokens": 2}


def prefer_first(gateway, role: str = "interactive") -> None:
    """Make the role's first replica the first pick: the others look busier (by one request)."""
    for upstream in gateway.app[UPSTREAMS].of_role(role)[1:]:
        upstream.outstanding += 1


def settle(gateway, role: str = "interactive") -> None:
    for upstream in gateway.app[UPSTREAMS].of_role(role)[1:]:
        upstream.outstanding -= 1


async def test_a_connection_refused_is_retried_on_another_replica(start_replica, start_gateway, dead_url):
    good = await start_replica("good")
    gateway = await start_gateway({"interactive": [dead_url, good.url], "batch": [good.url]})
    prefer_first(gateway)
    resp = await gateway.post("/v1/completions", json=BODY, headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16
                                                                     + "-01"})
    settle(gateway)
    assert resp.status == 200 and (await resp.json())["replica"] == "good"
    assert good.received[0]["headers"]["traceparent"].startswith("00-111")
    assert b'"prompt": "hi"' in good.received[0]["body"]  # the body is sent again


@pytest.mark.parametrize("mode", ["close", "503"])
async def test_a_replica_that_drops_the_connection_or_answers_503_is_retried(start_replica, start_gateway, mode):
    bad, good = await start_replica("bad", mode=mode), await start_replica("good")
    gateway = await start_gateway({"interactive": [bad.url, good.url], "batch": [good.url]})
    prefer_first(gateway)
    resp = await gateway.post("/v1/completions", json=BODY)
    settle(gateway)
    assert resp.status == 200 and (await resp.json())["replica"] == "good"
    assert bad.calls == good.calls == 1


async def test_a_429_is_retried_on_a_replica_that_is_not_full(start_replica, start_gateway):
    busy, full, good = (await start_replica("busy", mode="429"), await start_replica("full"),
                        await start_replica("good"))
    gateway = await start_gateway({"interactive": [], "batch": [busy.url, full.url, good.url]}, max_outstanding=2)
    table = gateway.app[UPSTREAMS]
    busy_up, full_up, good_up = table.of_role("batch")
    full_up.outstanding = 2  # full: must not be the retry's target
    good_up.outstanding = 1  # busier than `busy`, so `busy` is picked first
    resp = await gateway.post("/v1/completions", json=BODY, headers={"x-cadenza-class": "background"})
    assert resp.status == 200 and (await resp.json())["replica"] == "good"
    assert (busy.calls, full.calls, good.calls) == (1, 0, 1)
    assert busy_up.blocked_until > table.clock()  # backed off for its Retry-After


async def test_there_is_only_one_retry_and_the_last_upstream_error_comes_back(start_replica, start_gateway):
    replicas = [await start_replica(f"r{i}", mode="503") for i in range(3)]
    urls = [r.url for r in replicas]
    gateway = await start_gateway({"interactive": urls, "batch": urls})
    resp = await gateway.post("/v1/completions", json=BODY)
    assert resp.status == 503
    assert (await resp.json())["error"]["message"] == "draining"
    assert sum(r.calls for r in replicas) == 2
    assert resp.headers["x-request-id"] in {f"{r.name}-1" for r in replicas}


async def test_an_answer_is_preferred_to_a_later_connection_error(start_replica, start_gateway, dead_url):
    bad = await start_replica("bad", mode="503")
    gateway = await start_gateway({"interactive": [bad.url, dead_url], "batch": [bad.url]})
    prefer_first(gateway)
    resp = await gateway.post("/v1/completions", json=BODY)
    settle(gateway)
    assert resp.status == 503 and (await resp.json())["error"]["message"] == "draining"


async def test_when_no_replica_answers_the_gateway_returns_502(start_gateway, dead_url, other_dead_url):
    gateway = await start_gateway({"interactive": [dead_url, other_dead_url], "batch": [dead_url]})
    resp = await gateway.post("/v1/completions", json=BODY)
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert error["type"] == "server_error" and error["code"] == "upstream_unreachable"
    view = await (await gateway.get("/gateway/upstreams")).json()
    assert all(u["outstanding"] == 0 for u in view["roles"]["interactive"])


async def test_a_lone_replica_that_fails_is_not_retried_on_itself(start_replica, start_gateway):
    bad = await start_replica("bad", mode="503")
    gateway = await start_gateway({"interactive": [bad.url], "batch": [bad.url]})
    resp = await gateway.post("/v1/completions", json=BODY)
    assert resp.status == 503 and bad.calls == 1


async def test_dead_replicas_are_avoided_so_later_requests_reach_the_live_one(
        start_replica, start_gateway, dead_url, other_dead_url):
    good = await start_replica("good")
    gateway = await start_gateway({"interactive": [dead_url, other_dead_url, good.url], "batch": [good.url]})
    statuses = [(await gateway.post("/v1/completions", json=BODY)).status for _ in range(12)]
    # The first request may try both dead replicas (its one retry); each is then down.
    assert statuses[1:] == [200] * 11 and statuses[0] in (200, 502)
    view = await (await gateway.get("/gateway/upstreams")).json()
    assert [u["down"] for u in view["roles"]["interactive"]] == [True, True, False]
    ready = await gateway.get("/ready")  # the role still has a reachable replica
    assert ready.status == 200 and (await ready.json())["up"] == {"interactive": 1, "batch": 1}


async def test_a_role_whose_replicas_are_all_down_is_named_and_the_others_keep_the_gateway_ready(
        start_replica, start_gateway, dead_url):
    good = await start_replica("good")
    gateway = await start_gateway({"interactive": [dead_url], "batch": [good.url]})
    assert (await gateway.get("/ready")).status == 200  # nothing has failed yet
    assert (await gateway.post("/v1/completions", json=BODY)).status == 502
    resp = await gateway.get("/ready")
    assert resp.status == 200 and (await resp.json())["unavailable"] == {"interactive": "every replica down"}
    assert (await gateway.post("/v1/completions", json=BODY, headers={"x-cadenza-class": "batch"})).status == 200

    only_dead = await start_gateway({"interactive": [dead_url], "batch": [dead_url]})
    assert (await only_dead.post("/v1/completions", json=BODY)).status == 502
    resp = await only_dead.get("/ready")
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "upstreams_unreachable"
