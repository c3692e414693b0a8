"""Least outstanding requests across a role, and 429 from the gateway when every replica is full."""

from __future__ import annotations

import asyncio

from waiting import until

BODY = {"model": "fake", "prompt": "hi", "max_tokens": 2}


async def test_concurrent_slow_requests_spread_to_the_least_busy_replica(start_replica, start_gateway):
    a, b = await start_replica("a"), await start_replica("b")
    gateway = await start_gateway({"interactive": [a.url, b.url], "batch": [a.url, b.url]})
    a.gate.clear()  # a holds every request it gets: its count stays up
    held = asyncio.create_task(gateway.post("/v1/completions", json=BODY))
    await until(lambda: a.in_flight + b.in_flight == 1)
    first = a if a.in_flight else b
    other = b if first is a else a
    first.gate.clear()
    other.gate.set()
    # While `first` holds one request, every new one goes to `other` (0 in flight after each).
    for _ in range(4):
        resp = await gateway.post("/v1/completions", json=BODY)
        assert (await resp.json())["replica"] == other.name
    first.gate.set()
    assert (await held).status == 200


async def test_ties_alternate_between_replicas(start_replica, start_gateway):
    a, b = await start_replica("a"), await start_replica("b")
    gateway = await start_gateway({"interactive": [a.url, b.url], "batch": []})
    names = [(await (await gateway.post("/v1/completions", json=BODY)).json())["replica"] for _ in range(4)]
    assert sorted(names) == ["a", "a", "b", "b"] and names[0] != names[1]


async def test_all_replicas_full_is_a_429_with_retry_after_and_calls_nobody(start_replica, start_gateway):
    a, b = await start_replica("a"), await start_replica("b")
    gateway = await start_gateway({"interactive": [a.url, b.url], "batch": [a.url]}, max_outstanding=1)
    a.gate.clear()
    b.gate.clear()
    held = [asyncio.create_task(gateway.post("/v1/completions", json=BODY)) for _ in range(2)]
    await until(lambda: a.in_flight == 1 and b.in_flight == 1)
    calls = a.calls + b.calls

    resp = await gateway.post("/v1/completions", json=BODY)
    assert resp.status == 429
    assert int(resp.headers["Retry-After"]) >= 1
    error = (await resp.json())["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "upstreams_full"
    assert a.calls + b.calls == calls  # refused at the gateway

    view = await (await gateway.get("/gateway/upstreams")).json()
    assert all(u["full"] and u["outstanding"] == 1 for u in view["roles"]["interactive"])
    a.gate.set()
    b.gate.set()
    assert [r.status for r in await asyncio.gather(*held)] == [200, 200]
    view = await (await gateway.get("/gateway/upstreams")).json()
    assert all(not u["full"] and u["outstanding"] == 0 for u in view["roles"]["interactive"])


async def test_a_replica_that_answered_429_is_skipped_for_its_retry_after(start_replica, start_gateway):
    a, b = await start_replica("a", mode="429", retry_after="30"), await start_replica("b", mode="429",
                                                                                        retry_after="5")
    gateway = await start_gateway({"interactive": [a.url, b.url], "batch": [a.url, b.url]})
    resp = await gateway.post("/v1/completions", json=BODY)
    assert resp.status == 429  # both tried (one retry), the last answer comes back
    assert a.calls == b.calls == 1

    resp = await gateway.post("/v1/completions", json=BODY)
    assert resp.status == 429 and resp.headers["Retry-After"] == "5"  # the soonest of the two back-offs
    assert (await resp.json())["error"]["code"] == "upstreams_full"
    assert a.calls == b.calls == 1
