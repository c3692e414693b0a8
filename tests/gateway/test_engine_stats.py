"""``GET /gateway/stats``: the pool's engine counters, its replicas' ``/ready`` summed, no address given."""

from __future__ import annotations

import asyncio

from aiohttp import web

from cadenza.gateway.engine_stats import additive, pool_sums

CALLS = web.AppKey("calls", list)


def replica_app(counters: dict, answer: dict) -> web.Application:
    """A replica whose ``/ready`` answers ``counters`` while ``answer["ok"]``, else hangs past the timeout."""
    calls = []

    async def ready(request: web.Request) -> web.Response:
        calls.append(request.path)
        if not answer["ok"]:
            await asyncio.sleep(30)
        return web.json_response({"status": "ready", **counters})

    app = web.Application()
    app.router.add_get("/ready", ready)
    app[CALLS] = calls
    return app


def test_only_integer_counters_and_gauges_add_up():
    body = {"status": "ready", "num_steps": 5, "kv_blocks_used": 3, "step_time_ms_p99": 12.5, "cost_model_error": 0.1,
            "kv_transfer_min_prompt_tokens": 900, "kv_transfer_rule": "a b", "classes": {"batch": {"running": 1}},
            "tenant_cache_isolation": True}
    assert additive(body) == {"num_steps": 5, "kv_blocks_used": 3}
    assert additive(["not", "an", "object"]) == {}
    assert pool_sums([{"num_steps": 5, "decode_tokens": 1}, {"num_steps": 2}]) == {"num_steps": 7, "decode_tokens": 1}


async def test_the_gateway_sums_every_role_and_keeps_a_silent_replicas_last_counters(
        aiohttp_server, start_gateway, monkeypatch):
    from cadenza.gateway import engine_stats

    monkeypatch.setattr(engine_stats, "TIMEOUT_S", 0.3)
    answer = {"ok": True}
    urls = []
    for counters in ({"num_steps": 10, "kv_blocks_total": 64}, {"num_steps": 1, "kv_blocks_total": 64},
                     {"num_steps": 100, "kv_blocks_total": 32, "step_time_ms_mean": 3.5}):
        server = await aiohttp_server(replica_app(counters, answer if counters["num_steps"] == 100 else {"ok": True}))
        urls.append(str(server.make_url("")).rstrip("/"))
    decode, other, prefill = urls
    # colocated-style: one replica in both serving roles counts once; the prefill replica counts too
    gateway = await start_gateway({"interactive": [decode, other], "batch": [decode], "prefill": [prefill]})

    ready = await (await gateway.get("/ready")).json()
    assert ready["engine_stats"] == "/gateway/stats"
    stats = await (await gateway.get("/gateway/stats")).json()
    assert stats["num_steps"] == 111 and stats["kv_blocks_total"] == 160 and "step_time_ms_mean" not in stats
    assert stats["replicas"] == {"known": 3, "answered": 3, "stale": 0}
    for url in urls:  # internal addresses are not given to whoever asks
        assert url.rsplit(":", 1)[1] not in str(stats)

    answer["ok"] = False  # the prefill replica hangs: its last counters still count, marked stale
    stats = await (await gateway.get("/gateway/stats")).json()
    assert stats["num_steps"] == 111 and stats["replicas"] == {"known": 3, "answered": 2, "stale": 1}


async def test_concurrent_calls_share_one_collection(aiohttp_server, start_gateway):
    app = replica_app({"num_steps": 1}, {"ok": True})
    server = await aiohttp_server(app)
    gateway = await start_gateway({"interactive": [str(server.make_url("")).rstrip("/")]})
    answers = await asyncio.gather(*(gateway.get("/gateway/stats") for _ in range(20)))
    assert all(a.status == 200 for a in answers)
    assert len(app[CALLS]) < 20  # the replica is not asked once per caller
