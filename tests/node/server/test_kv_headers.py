"""Disaggregated serving over HTTP: a prefill replica answers where its KV is, a decode replica
pulls it and answers exactly what a colocated call would; the headers need the pool's token."""

from __future__ import annotations

import asyncio
import json

import pytest

from cadenza.node.core.config import CacheConfig, EngineConfig, SchedulerConfig
from cadenza.node.core.request import RemoteKV
from cadenza.node.server.app import create_app
from cadenza.node.server.auth import TOKEN_ENV
from cadenza.node.server.kv_headers import format_source, parse_source
from cadenza.node.server.app_keys import ENGINE
from cadenza.node.wire import KV_PUBLISH_HEADER, KV_SOURCE_HEADER
from step_gate import StepGate
from waiting import until

MODEL = "tiny"
TOKEN = "pool-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = list(range(5, 105))  # 100 token ids: all but the last one's KV comes over


def config(tiny_llama_dir, kv: bool, max_num_seqs: int = 64) -> EngineConfig:
    return EngineConfig(model=str(tiny_llama_dir), served_model_name=MODEL, attention_backend="torch",
                        scheduler=SchedulerConfig(token_budget=64, chunk_size=32, max_num_seqs=max_num_seqs,
                                                  max_model_len=512),
                        cache=CacheConfig(block_size=16, num_kv_blocks=96), kv_transfer_port=0 if kv else None)


@pytest.fixture
async def pair(aiohttp_client, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    clients = []
    for kv in (True, True, False):
        app = create_app(config(tiny_llama_dir, kv), MODEL)
        clients.append(await aiohttp_client(app))
        await app[ENGINE].wait_ready()
    return clients


async def test_a_publish_call_answers_once_the_core_has_queued_it_and_a_full_queue_is_a_429(
        aiohttp_client, tiny_llama_dir, monkeypatch):
    """Six publish calls at once on a prefill replica with one running slot (two may wait): the
    core takes three and refuses three. The front end's published stats cannot know that, so the
    calls answer only after the core has: three 200s, each with a KV source the decode replica
    pulls whole and a stream that ends cleanly, and three 429s with Retry-After and no source."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    prefill, decode = [await aiohttp_client(create_app(config(tiny_llama_dir, True, max_num_seqs=seqs), MODEL))
                       for seqs in (1, 64)]
    for client in (prefill, decode):
        await client.app[ENGINE].wait_ready()
    engine = prefill.app[ENGINE]
    gate = StepGate(engine.core.runner, monkeypatch)
    publish = {**AUTH, KV_PUBLISH_HEADER: "1"}

    async def call(i: int):
        prompt = [5 + i] + PROMPT[1:]
        resp = await prefill.post("/v1/completions", json={**body(1), "prompt": prompt}, headers=publish)
        return resp, prompt, await resp.text()

    try:
        gate.hold()
        first = asyncio.create_task(call(0))
        await gate.held()  # the first is running, parked in its step; the others arrive meanwhile
        rest = [asyncio.create_task(call(i)) for i in range(1, 6)]
        await until(lambda: len(engine._streams) == 6, what="the six calls to reach the core")
    finally:
        gate.release()
    answers = await asyncio.gather(first, *rest)
    ok = [(resp, prompt, text) for resp, prompt, text in answers if resp.status == 200]
    refused = [(resp, text) for resp, _prompt, text in answers if resp.status != 200]
    assert len(ok) == 3 and len(refused) == 3
    for resp, text in refused:
        assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1 and KV_SOURCE_HEADER not in resp.headers
        assert json.loads(text)["error"]["code"] == "queue_full"
    for resp, prompt, text in ok:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1])
        got = await decode.post("/v1/completions", json={**body(4), "prompt": prompt},
                                headers={**AUTH, KV_SOURCE_HEADER: resp.headers[KV_SOURCE_HEADER]})
        assert got.status == 200, await got.text()
    decode_core = decode.app[ENGINE].core
    assert decode_core.scheduler.stats.remote_kv_tokens == 3 * 99 and not decode_core.kv_link.stats.failures
    assert engine.core.kv_link.stats.published == 3


def body(max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


async def test_a_decode_replica_pulls_the_prefill_replicas_kv_and_answers_as_colocated(pair):
    prefill, decode, _plain = pair
    resp = await prefill.post("/v1/completions", json=body(1), headers={**AUTH, KV_PUBLISH_HEADER: "1"})
    assert resp.status == 200, await resp.text()
    source = resp.headers[KV_SOURCE_HEADER]
    where = parse_source(source)
    assert where.num_tokens == len(PROMPT) and where.request_id == resp.headers["x-request-id"]
    got = await decode.post("/v1/completions", json=body(8), headers={**AUTH, KV_SOURCE_HEADER: source})
    assert got.status == 200, await got.text()
    want = await decode.post("/v1/completions", json=body(8))
    assert (await got.json())["choices"][0]["text"] == (await want.json())["choices"][0]["text"]
    assert decode.app[ENGINE].core.scheduler.stats.remote_kv_tokens == 99
    metrics = await (await decode.get("/metrics")).text()
    assert "cadenza_kv_transfer_loaded_tokens" in metrics and "cadenza_kv_transfer_loads" in metrics
    assert "cadenza_kv_transfer_released_holds" in metrics


async def test_the_headers_need_the_pools_token_and_an_endpoint_and_a_well_formed_source(pair):
    prefill, decode, plain = pair
    assert (await prefill.post("/v1/completions", json=body(1), headers={KV_PUBLISH_HEADER: "1"})).status == 401
    wrong = {"Authorization": "Bearer nope", KV_SOURCE_HEADER: "kv://127.0.0.1:1/x?boot=b&tokens=5"}
    assert (await decode.post("/v1/completions", json=body(1), headers=wrong)).status == 401
    resp = await plain.post("/v1/completions", json=body(1), headers={**AUTH, KV_PUBLISH_HEADER: "1"})
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "kv_transfer_off"
    for bad in ("http://h:1/x?boot=b&tokens=5", "kv://h/x?boot=b&tokens=5", "kv://h:1/?boot=b&tokens=5",
                "kv://h:1/x?tokens=5", "kv://h:1/x?boot=b&tokens=-1", "kv://h:1/x?boot=b&tokens=%C2%B2", "kv://h:99999/x?boot=b&tokens=5", "x" * 600):
        resp = await decode.post("/v1/completions", json=body(1), headers={**AUTH, KV_SOURCE_HEADER: bad})
        assert resp.status == 400, bad
        assert (await resp.json())["error"]["code"] == "invalid_kv_source"
    resp = await prefill.post("/v1/completions", json=body(1), headers={**AUTH, KV_PUBLISH_HEADER: "yes"})
    assert resp.status == 400


async def test_a_source_that_holds_nothing_is_recomputed_with_the_same_answer(pair):
    _prefill, decode, _plain = pair
    gone = format_source(RemoteKV("127.0.0.1", 9, "cmpl-gone", "boot", len(PROMPT)))  # nothing listens there
    got = await decode.post("/v1/completions", json=body(6), headers={**AUTH, KV_SOURCE_HEADER: gone})
    want = await decode.post("/v1/completions", json=body(6))
    assert got.status == 200 and (await got.json())["choices"][0]["text"] == (await want.json())["choices"][0]["text"]
    assert dict(decode.app[ENGINE].core.kv_link.stats.failures) == {"connection": 1}


def test_a_source_round_trips_through_its_header_form_ipv6_and_odd_ids_included():
    for src in (RemoteKV("10.0.0.5", 7100, "cmpl-1", "abc", 17), RemoteKV("::1", 1, "a/b?c&d=e", "x y", 1)):
        assert parse_source(format_source(src)) == src


async def test_a_streamed_publish_call_ends_with_usage_and_a_decode_call_of_n_choices_pulls_the_kv(pair):
    prefill, decode, _plain = pair
    streamed = {**body(1), "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    resp = await prefill.post("/v1/completions", json=streamed, headers={**AUTH, KV_PUBLISH_HEADER: "1"})
    assert resp.status == 200, await resp.text()
    events = [line[6:] for line in (await resp.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    *chunks, last = [json.loads(e) for e in events[:-1]]
    assert all(c["usage"] is None for c in chunks) and last["choices"] == []
    assert last["usage"]["completion_tokens"] == 1  # the publish call computes the prompt for one sequence
    source = resp.headers[KV_SOURCE_HEADER]
    got = await decode.post("/v1/completions", json={**body(4), "n": 2}, headers={**AUTH, KV_SOURCE_HEADER: source})
    assert got.status == 200, await got.text()
    want = await (await decode.post("/v1/completions", json=body(4))).json()
    choices = (await got.json())["choices"]
    assert [c["text"] for c in choices] == [want["choices"][0]["text"]] * 2  # greedy: alike
    assert decode.app[ENGINE].core.scheduler.stats.remote_kv_tokens == 99
    assert decode.app[ENGINE].core.block_manager.num_used_blocks == 0
