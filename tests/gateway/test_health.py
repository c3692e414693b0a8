"""Active health checks: a hung replica is found, a dead one is avoided until it answers again."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from cadenza.gateway import health as health_checks
from cadenza.gateway.state import UPSTREAMS
from waiting import until

BODY = {"model": "fake", "prompt": "hi", "max_tokens": 2}


@pytest.fixture
async def hung_url():
    """A server that accepts connections and never answers (a SIGSTOPped replica, a deadlock)."""
    held = []

    async def hold(reader, writer):
        held.append(writer)
        await asyncio.sleep(3600)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    for w in held:
        w.close()
    server.close()


async def healthy(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def engine_died(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "engine is not running"}}, status=503)


def count_checks(monkeypatch) -> list[str]:
    """The URL of every health check the gateway has completed, in order."""
    done: list[str] = []
    original = health_checks.check

    async def check(session, upstreams, upstream, timeout_s):
        try:
            return await original(session, upstreams, upstream, timeout_s)
        finally:
            done.append(upstream.url)

    monkeypatch.setattr(health_checks, "check", check)
    return done


async def test_a_hung_replica_fails_its_check_and_gets_no_new_requests(start_replica, start_gateway, hung_url):
    good = await start_replica("good")
    gateway = await start_gateway({"interactive": [hung_url, good.url], "batch": [good.url]},
                                  health_interval_s=0.2)
    hung, _ = gateway.app[UPSTREAMS].of_role("interactive")
    await until(lambda: hung.is_down)
    answers = [await asyncio.wait_for(gateway.post("/v1/completions", json=BODY), 30) for _ in range(6)]
    assert [r.status for r in answers] == [200] * 6 and good.calls == 6


async def test_a_dead_replica_comes_back_when_its_check_passes(start_gateway, start_replica, aiohttp_server,
                                                               monkeypatch):
    checks = count_checks(monkeypatch)
    good = await start_replica("good")
    with socket.socket() as s:  # a port for the replica that will come back
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    back = f"http://127.0.0.1:{port}"
    gateway = await start_gateway({"interactive": [back], "batch": [good.url]}, health_interval_s=0.2)
    upstream = gateway.app[UPSTREAMS].of_role("interactive")[0]
    await until(lambda: upstream.is_down)

    async def unavailable():
        resp = await gateway.get("/ready")
        assert resp.status == 200  # batch can still be served
        return (await resp.json())["unavailable"]

    assert await unavailable() == {"interactive": "every replica down"}  # stays so, however long it is dead
    seen = checks.count(back)
    await until(lambda: checks.count(back) >= seen + 2)  # two more failed checks
    assert await unavailable() == {"interactive": "every replica down"}

    app = web.Application()
    app.router.add_get("/health", healthy)
    await aiohttp_server(app, port=port)
    await until(lambda: not upstream.is_down)
    assert await unavailable() == {}


async def test_a_replica_whose_engine_died_answers_503_and_is_down(start_gateway, aiohttp_server):
    app = web.Application()
    app.router.add_get("/health", engine_died)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    gateway = await start_gateway({"interactive": [url], "batch": [url]}, health_interval_s=0.2)
    await until(lambda: gateway.app[UPSTREAMS].of_role("batch")[0].is_down)


async def test_with_live_checks_two_dead_replicas_never_cost_a_later_request(
        start_replica, start_gateway, dead_url, other_dead_url):
    good = await start_replica("good")
    gateway = await start_gateway({"interactive": [dead_url, good.url, other_dead_url], "batch": [good.url]},
                                  health_interval_s=0.1)
    statuses = []
    for _ in range(10):  # spread over several check rounds
        statuses.append((await gateway.post("/v1/completions", json=BODY)).status)
        await asyncio.sleep(0.05)
    assert statuses[1:] == [200] * 9


async def test_a_request_waiting_on_a_replica_that_hangs_is_retried_when_its_check_fails(
        start_replica, start_gateway, hung_url):
    good = await start_replica("good")
    gateway = await start_gateway({"interactive": [hung_url, good.url], "batch": [good.url]},
                                  health_interval_s=0.3)
    hung, good_up = gateway.app[UPSTREAMS].of_role("interactive")
    await until(lambda: hung.is_down)
    gateway.app[UPSTREAMS].answered(hung)  # as if it answered once, then hung: it is picked
    good_up.outstanding += 1  # and preferred over the good one
    resp = await asyncio.wait_for(gateway.post("/v1/completions", json=BODY), 30)
    good_up.outstanding -= 1
    assert resp.status == 200 and (await resp.json())["replica"] == "good" and hung.is_down
