"""The gateway in front of a disaggregated pool: real engine servers (tiny Llama), one prefill and
one decode replica. A long prompt is prefilled on the prefill replica and its KV pulled by the
decode replica; the client sees one ordinary answer, the same as a colocated one."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time

import pytest

from cadenza.node.core.config import CacheConfig, EngineConfig, SchedulerConfig
from cadenza.gateway.state import METRICS, PREFILL_CALLS, UPSTREAMS
from cadenza.gateway.disagg import HEADERS_TIMEOUT_S, prompt_tokens
from cadenza.node.server.app import create_app
from cadenza.node.server.auth import TOKEN_ENV
from cadenza.node.server.app_keys import ENGINE
from cadenza.node.kv_transfer.threshold import Rule
from cadenza.node.wire import DISAGG_RULE_HEADER, KV_SOURCE_HEADER
from step_gate import StepGate
from waiting import until

MODEL = "tiny"
LONG, SHORT = list(range(5, 105)), list(range(5, 25))  # 100 and 20 token ids; the threshold is 32


async def start_engines(aiohttp_server, tiny_llama_dir, prefill_seqs: int = 64) -> list:
    """A prefill and a decode engine server (the prefill one with ``prefill_seqs`` running slots)."""
    servers = []
    for seqs in (prefill_seqs, 64):
        config = EngineConfig(model=str(tiny_llama_dir), served_model_name=MODEL, attention_backend="torch",
                              scheduler=SchedulerConfig(token_budget=64, chunk_size=32, max_num_seqs=seqs,
                                                        max_model_len=512),
                              cache=CacheConfig(block_size=16, num_kv_blocks=96), kv_transfer_port=0)
        app = create_app(config, MODEL)
        server = await aiohttp_server(app)
        await app[ENGINE].wait_ready()
        servers.append(server)
    return servers


def url_of(server) -> str:
    return str(server.make_url("")).rstrip("/")


@pytest.fixture
async def pool(aiohttp_server, start_gateway, tiny_llama_dir, monkeypatch, dead_url):
    monkeypatch.setenv(TOKEN_ENV, "pool-token")
    servers = await start_engines(aiohttp_server, tiny_llama_dir)
    prefill, decode = map(url_of, servers)

    async def gateway(prefill_url=prefill, threshold=32, decode_url=decode):
        return await start_gateway({"interactive": [decode_url], "prefill": [prefill_url]},
                                   disagg_min_prompt_tokens=threshold)

    return gateway, servers[0].app, servers[1].app


def body(prompt, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}


async def text_of(resp) -> str:
    assert resp.status == 200, await resp.text()
    return (await resp.json())["choices"][0]["text"]


async def test_a_long_prompt_is_prefilled_elsewhere_and_answered_as_colocated(pool):
    gateway, prefill_app, decode_app = pool
    gw = await gateway()
    direct = await text_of(await gw.post("/v1/completions", json=body(LONG), headers={"x-cadenza-class": "interactive"}))
    assert gw.app[METRICS].disagg_outcomes == {"prefilled": 1}
    assert decode_app[ENGINE].core.scheduler.stats.remote_kv_tokens == 99
    assert prefill_app[ENGINE].core.scheduler.stats.prefill_tokens_admitted == 100
    # the same prompt prefilled on the decode replica itself, for comparison
    plain = decode_app[ENGINE]
    outputs = [o async for o in plain.generate("ref", LONG, _greedy(6))]
    assert direct == "".join(o.text for o in outputs)


async def test_a_short_prompt_goes_straight_to_the_decode_replica(pool):
    gateway, prefill_app, decode_app = pool
    gw = await gateway()
    await text_of(await gw.post("/v1/completions", json=body(SHORT)))
    assert gw.app[METRICS].disagg_outcomes == {}
    assert prefill_app[ENGINE].core.scheduler.stats.prefill_tokens_admitted == 0


async def test_streams_go_through_the_prefill_replica_too(pool):
    gateway, _prefill_app, decode_app = pool
    gw = await gateway()
    resp = await gw.post("/v1/completions", json=body(LONG, stream=True))
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    events = [line for line in (await resp.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert gw.app[METRICS].disagg_outcomes == {"prefilled": 1}


async def test_a_dead_prefill_replica_falls_back_to_prefilling_on_the_decode_replica(pool, dead_url):
    gateway, _prefill_app, decode_app = pool
    gw = await gateway(prefill_url=dead_url)
    want = await text_of(await (await gateway()).post("/v1/completions", json=body(LONG)))
    assert await text_of(await gw.post("/v1/completions", json=body(LONG))) == want
    assert gw.app[METRICS].disagg_outcomes == {"fallback_failed": 1}


async def test_a_request_the_prefill_replica_refuses_is_the_clients_error_not_a_failed_prefill(pool):
    gateway, _prefill_app, _decode_app = pool
    gw = await gateway()
    resp = await gw.post("/v1/completions", json=body(LONG, temperature=-1))
    assert resp.status == 400 and "temperature" in (await resp.json())["error"]["message"]
    assert gw.app[METRICS].disagg_outcomes == {"fallback_refused": 1}
    assert gw.app[UPSTREAMS].of_role("prefill")[0].is_down is False  # the replica is fine


async def test_a_clients_own_kv_headers_never_reach_a_replica(pool):
    gateway, _prefill_app, decode_app = pool
    gw = await gateway()
    forged = {KV_SOURCE_HEADER: "kv://10.9.9.9:7000/someone-else?boot=x&tokens=100", "x-cadenza-kv-publish": "1"}
    await text_of(await gw.post("/v1/completions", json=body(SHORT), headers=forged))  # no 401: dropped
    assert dict(decode_app[ENGINE].core.kv_link.stats.failures) == {}


def test_prompt_length_is_exact_for_token_ids_and_estimated_for_text():
    assert prompt_tokens({"prompt": LONG}) == 100
    assert prompt_tokens({"prompt": "x" * 401}) == 101
    assert prompt_tokens({"messages": [{"role": "user", "content": "y" * 80}]}) == 20
    assert prompt_tokens({"prompt": [[1, 2, 3], [4]]}) == 3 and prompt_tokens("junk") == 0
    assert prompt_tokens({"prompt": ["abcdefgh", [1, 2, 3]]}) == 3 and prompt_tokens({"prompt": []}) == 0


def test_a_prompt_nested_deeper_than_the_api_allows_is_read_as_nothing_not_recursed_into():
    deep: list = [1]
    for _ in range(5000):
        deep = [deep]
    assert prompt_tokens({"prompt": deep}) == 0


async def test_a_deeply_nested_prompt_gets_the_replicas_400_through_the_gateway(pool):
    gateway, prefill_app, _decode_app = pool
    gw = await gateway()
    resp = await gw.post("/v1/completions", data=json.dumps(body(0)).replace("0", "[" * 600 + "1" + "]" * 600, 1),
                         headers={"Content-Type": "application/json"})
    assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"
    assert prefill_app[ENGINE].core.scheduler.stats.prefill_tokens_admitted == 0


async def test_a_request_the_decode_call_would_refuse_is_refused_before_the_prefill_replica_computes_it(pool):
    gateway, prefill_app, _decode_app = pool
    gw = await gateway()
    resp = await gw.post("/v1/completions", json=body(LONG, max_tokens=10_000))  # past max_model_len
    assert resp.status == 400 and "max_tokens" in (await resp.text())
    assert gw.app[METRICS].disagg_outcomes == {"fallback_refused": 1}
    assert prefill_app[ENGINE].core.scheduler.stats.prefill_tokens_admitted == 0


async def test_no_prompt_is_prefilled_for_a_decode_replica_that_is_down_or_loading(pool, dead_url):
    gateway, prefill_app, _decode_app = pool
    gw = await gateway(decode_url=dead_url)
    (decode,) = gw.app[UPSTREAMS].of_role("interactive")
    gw.app[UPSTREAMS].unreachable(decode)
    assert (await gw.post("/v1/completions", json=body(LONG))).status == 502
    gw = await gateway()
    (decode,) = gw.app[UPSTREAMS].of_role("interactive")
    decode.unready_until = gw.app[UPSTREAMS].clock() + 60  # as a 503 with Retry-After: 60 leaves it
    await text_of(await gw.post("/v1/completions", json=body(LONG)))  # it serves anyway, prefilling itself
    assert gw.app[METRICS].disagg_outcomes == {}
    assert prefill_app[ENGINE].core.scheduler.stats.prefill_tokens_admitted == 0


def _rule(fixed_s: float) -> Rule:  # 1 ms a prompt token, a free link, the last 16 tokens local
    return Rule(1e-3, 0.0, 0.0, local_tokens=16, fixed_s=fixed_s)


async def test_with_auto_the_gateway_solves_the_rule_the_decode_replica_reports(pool, monkeypatch):
    gateway, prefill_app, decode_app = pool
    gw = await gateway(threshold="auto")
    # a decode replica whose cost model is not calibrated reports nothing: nothing moves
    await text_of(await gw.post("/v1/completions", json=body(LONG)))
    assert gw.app[METRICS].disagg_outcomes == {}
    client = decode_app[ENGINE]
    computed = dataclasses.replace(client.stats(), kv_transfer_rule=_rule(0.048).header())
    monkeypatch.setattr(client, "stats", lambda: computed)
    resp = await gw.post("/v1/completions", json=body(SHORT))
    assert DISAGG_RULE_HEADER not in resp.headers  # the gateway's to read, not the client's
    await text_of(resp)
    metrics = (await (await gw.get("/metrics")).text())
    assert re.search(r"^cadenza_gateway_disagg_min_prompt_tokens(\{[^}]*\})? 64\.0$", metrics, re.M)  # 16 + 48
    await text_of(await gw.post("/v1/completions", json=body(LONG)))  # 100 >= 64 tokens: moved
    assert gw.app[METRICS].disagg_outcomes == {"prefilled": 1}


async def test_with_auto_a_prefill_replica_with_a_queue_is_sent_only_prompts_that_pay_after_it(pool, monkeypatch):
    gateway, prefill_app, decode_app = pool
    gw = await gateway(threshold="auto")
    client = decode_app[ENGINE]
    computed = dataclasses.replace(client.stats(), kv_transfer_rule=_rule(0.048).header())
    monkeypatch.setattr(client, "stats", lambda: computed)
    await text_of(await gw.post("/v1/completions", json=body(SHORT)))  # learns the rule
    (prefill,) = gw.app[UPSTREAMS].of_role("prefill")
    prefill.queued_tokens = 40  # another gateway request's prompt: 40 ms more before this one's KV
    await text_of(await gw.post("/v1/completions", json=body(LONG)))  # 100 < 16 + 48 + 40
    assert gw.app[METRICS].disagg_outcomes == {"kept_queued": 1}
    assert prefill_app[ENGINE].core.scheduler.stats.prefill_tokens_admitted == 0
    prefill.queued_tokens = 0
    await text_of(await gw.post("/v1/completions", json=body(LONG)))
    assert gw.app[METRICS].disagg_outcomes == {"kept_queued": 1, "prefilled": 1}
    await asyncio.gather(*gw.app[PREFILL_CALLS], return_exceptions=True)
    assert (prefill.queued_tokens, prefill.queued_pairs, prefill.outstanding) == (0, 0.0, 0)  # its call ended


async def generated(app, prompt: list[int]) -> str:
    """What ``app``'s engine answers ``body(prompt)`` with, called directly (the reference)."""
    return "".join([o.text async for o in app[ENGINE].generate(f"ref-{prompt[0]}", prompt, _greedy(6))])


def _greedy(n):
    from cadenza.node.core.request import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


async def test_a_client_that_leaves_while_the_prefill_replica_is_silent_leaves_no_queue_behind(
        start_replica, aiohttp_server):
    from aiohttp import ClientSession, ClientTimeout

    from cadenza.gateway.app import create_gateway_app
    from cadenza.gateway.upstreams import Upstreams

    prefill, decode = await start_replica("prefill"), await start_replica("decode")
    prefill.gate.clear()  # it sends no headers: hung, or slow to start
    app = create_gateway_app(Upstreams({"interactive": [decode.url], "prefill": [prefill.url]}),
                             health_interval_s=0, disagg_min_prompt_tokens=32)
    server = await aiohttp_server(app)  # handler cancellation on, as `cadenza gateway` runs
    async with ClientSession(timeout=ClientTimeout(total=0.5)) as session:
        with pytest.raises(TimeoutError):
            await session.post(server.make_url("/v1/completions"), json=body(LONG))  # leaves after 0.5 s
    (upstream,) = app[UPSTREAMS].of_role("prefill")
    for _ in range(100):
        if upstream.outstanding == 0:
            break
        await asyncio.sleep(0.01)
    assert prefill.calls == 1 and (upstream.outstanding, upstream.queued_tokens, upstream.queued_pairs) == (0, 0, 0.0)
    prefill.gate.set()


@pytest.mark.parametrize("extra", [{"stream": False, "stream_options": {"include_usage": True}}, {"stream": "yes"},
                                   {"stream": True, "stream_options": "garbage"}])
async def test_a_request_invalid_only_in_how_it_streams_is_refused_before_any_prefill(pool, extra):
    gateway, prefill_app, _decode_app = pool
    gw = await gateway()
    resp = await gw.post("/v1/completions", json=body(LONG, **extra))
    assert resp.status == 400
    assert gw.app[METRICS].disagg_outcomes == {"fallback_refused": 1}
    assert prefill_app[ENGINE].core.scheduler.stats.prefill_tokens_admitted == 0


async def test_a_prefill_replica_with_a_full_queue_is_backed_off_from_and_the_next_one_prefills(pool, start_replica):
    gateway, prefill_app, decode_app = pool
    full = await start_replica("full", mode="429", retry_after="30")
    (real,) = [u for u in (await gateway()).app[UPSTREAMS].of_role("prefill")]
    gw = await gateway()
    gw.app[UPSTREAMS].replace({"interactive": [u.url for u in gw.app[UPSTREAMS].of_role("interactive")],
                               "prefill": [full.url, real.url]})
    by_url = {u.url: u for u in gw.app[UPSTREAMS].of_role("prefill")}
    by_url[real.url].queued_tokens = 1  # so the full one, with none queued, is tried first
    want = await generated(prefill_app, LONG)
    assert await text_of(await gw.post("/v1/completions", json=body(LONG))) == want
    assert full.calls == 1 and gw.app[METRICS].disagg_outcomes == {"prefilled": 1}
    assert by_url[full.url].is_full(100, gw.app[UPSTREAMS].clock())  # 30 s of Retry-After
    decode = decode_app[ENGINE].core
    assert decode.scheduler.stats.remote_kv_tokens == 99 and not decode.kv_link.stats.failures


async def test_when_every_prefill_replica_is_full_the_decode_replica_prefills_at_once(pool, start_replica):
    gateway, prefill_app, decode_app = pool
    full = await start_replica("full", mode="429")
    want = await generated(prefill_app, LONG)
    gw = await gateway(prefill_url=full.url)
    assert await text_of(await gw.post("/v1/completions", json=body(LONG))) == want
    assert full.calls == 1 and gw.app[METRICS].disagg_outcomes == {"fallback_busy": 1}
    decode = decode_app[ENGINE].core
    assert decode.scheduler.stats.remote_kv_loads == 0 and not decode.kv_link.stats.failures


async def test_concurrent_prompts_beyond_a_prefill_replicas_queue_are_prefilled_where_they_decode(
        aiohttp_server, start_gateway, tiny_llama_dir, monkeypatch):
    """Six long prompts at once through the gateway; the prefill replica has one running slot
    and room for two more: it queues three and refuses three with 429 (never a 200 without KV).
    Every client gets the colocated answer; the gateway counts three prefilled, three prefilled
    where they decode; the decode replica pulls exactly the three, and waits for no KV that
    never comes."""
    monkeypatch.setenv(TOKEN_ENV, "pool-token")
    prefill, decode = await start_engines(aiohttp_server, tiny_llama_dir, prefill_seqs=1)
    gw = await start_gateway({"interactive": [url_of(decode)], "prefill": [url_of(prefill)]},
                             disagg_min_prompt_tokens=32)
    prompts = [[5 + i] + LONG[1:] for i in range(6)]
    want = [await generated(prefill.app, p) for p in prompts]
    engine = prefill.app[ENGINE]
    gate = StepGate(engine.core.runner, monkeypatch)
    try:
        gate.hold()
        first = asyncio.create_task(gw.post("/v1/completions", json=body(prompts[0])))
        await gate.held()  # the first is running on the prefill replica, parked in its step
        rest = [asyncio.create_task(gw.post("/v1/completions", json=body(p))) for p in prompts[1:]]
        await until(lambda: len(engine._streams) == 6, what="the six prefill calls to reach the core")
    finally:
        gate.release()
    began = time.monotonic()
    assert [await text_of(resp) for resp in await asyncio.gather(first, *rest)] == want
    assert time.monotonic() - began < HEADERS_TIMEOUT_S  # nobody waited for KV that never came
    assert gw.app[METRICS].disagg_outcomes == {"prefilled": 3, "fallback_busy": 3}
    core = decode.app[ENGINE].core
    assert core.scheduler.stats.remote_kv_loads == 3 and core.scheduler.stats.remote_kv_tokens == 3 * 99
    assert core.scheduler.stats.remote_kv_failed_loads == 0 and not core.kv_link.stats.failures
