"""The engine core in its own process: serving through it, its death noticed at once, a clean stop.

The server's default (``cadenza serve --engine-process on``); the rest of the server tests run the
same core loop in a thread, behind the same messages.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from cadenza.node.core.config import CacheConfig, EngineConfig, SchedulerConfig
from cadenza.node.server.app import create_app
from cadenza.node.server.app_keys import ENGINE
from waiting import until

pytestmark = pytest.mark.slow  # each test starts a core process that loads torch and a model

MODEL = "tiny"


@pytest.fixture
async def served(aiohttp_client, tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), served_model_name=MODEL,
                          scheduler=SchedulerConfig(token_budget=64, chunk_size=16, max_model_len=1024),
                          cache=CacheConfig(block_size=16, num_kv_blocks=128))
    app = create_app(config, MODEL, engine_process=True)
    client = await aiohttp_client(app)
    await app[ENGINE].wait_ready()
    return client


def core_process(client):
    return client.app[ENGINE].transport.process


def completion(**extra) -> dict:
    return {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0, **extra}


async def test_requests_are_served_through_the_core_process(served):
    assert core_process(served).pid != os.getpid() and served.app[ENGINE].core is None
    resp = await served.post("/v1/completions", json=completion(max_tokens=5, ignore_eos=True))
    body = await resp.json()
    assert resp.status == 200 and body["usage"]["completion_tokens"] == 5
    ready = await (await served.get("/ready")).json()
    assert ready["kv_blocks_total"] == 128 and ready["num_finished"] >= 1


async def test_a_stop_string_ends_the_request_in_the_core(served):
    full = (await (await served.post("/v1/completions", json=completion(max_tokens=40, ignore_eos=True))).json())
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), "the tiny model should produce visible text"
    before = served.app[ENGINE].stats()
    resp = await served.post("/v1/completions", json=completion(max_tokens=40, ignore_eos=True, stop=[stop]))
    choice = (await resp.json())["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == text[: text.index(stop)]
    await until(lambda: served.app[ENGINE].stats().num_finished > before.num_finished
                and served.app[ENGINE].stats().num_running == 0)
    after = served.app[ENGINE].stats()
    assert after.num_aborted == before.num_aborted  # the core finished it as stopped, not aborted
    assert after.kv_blocks_used == 0


async def test_a_killed_core_process_is_noticed_within_a_second_and_fails_requests_cleanly(served):
    stream = await served.post("/v1/completions", json=completion(max_tokens=900, ignore_eos=True, stream=True))
    first = await stream.content.readline()
    assert first.startswith(b"data: ")  # streaming: the core is stepping
    waiting = asyncio.ensure_future(served.post("/v1/completions", json=completion(max_tokens=900, ignore_eos=True)))
    await until(lambda: served.app[ENGINE].stats().num_running == 2)
    killed = time.monotonic()
    core_process(served).send_signal(signal.SIGKILL)
    await until(lambda: not served.app[ENGINE].is_alive, timeout=5)
    health = await served.get("/health")
    assert health.status == 503 and time.monotonic() - killed < 1.0
    rest = (await stream.content.read()).decode()
    events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
    assert "error" in events[-1] and events[-1]["error"]["type"] == "service_unavailable"  # a clean error event
    blocking = await asyncio.wait_for(waiting, 10)
    assert blocking.status == 503 and "engine" in (await blocking.json())["error"]["message"]
    refused = await served.post("/v1/completions", json=completion())
    assert refused.status == 503


async def test_a_clean_shutdown_stops_the_core_process(aiohttp_client, tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), served_model_name=MODEL,
                          scheduler=SchedulerConfig(max_model_len=256), cache=CacheConfig(num_kv_blocks=64))
    app = create_app(config, MODEL, engine_process=True)
    client = await aiohttp_client(app)
    await app[ENGINE].wait_ready()
    process = app[ENGINE].transport.process
    assert (await client.post("/v1/completions", json=completion())).status == 200
    await client.close()  # runs the app's cleanup: Shutdown to the core, then wait for it
    assert process.wait(timeout=30) == 0


async def test_a_config_the_model_cannot_serve_fails_the_start_with_the_engines_message(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), scheduler=SchedulerConfig(max_model_len=999_999))
    app = create_app(config, MODEL, engine_process=True)
    engine = app[ENGINE]
    engine.start()
    with pytest.raises(Exception, match="max_model_len"):
        await asyncio.wait_for(engine.wait_ready(), 120)
    await engine.shutdown()


async def test_values_too_large_for_the_wire_are_answered_like_in_a_thread(served, monkeypatch):
    huge = 2**64
    resp = await served.post("/v1/completions", json=completion(top_k=huge, stop_token_ids=[huge, 10**30]))
    assert resp.status == 200  # top_k beyond the vocabulary is off; ids outside it can stop nothing
    monkeypatch.setenv("CADENZA_ADMIN_TOKEN", "t")
    auth = {"Authorization": "Bearer t"}
    refused = await served.put("/admin/config", json={"token_budget": huge}, headers=auth)
    assert refused.status == 400 and "token_budget: must be <= 1048576" in (await refused.json())["error"]["message"]
    weight = await served.put("/admin/config", json={"tenants": {"a": {"weight": huge}}}, headers=auth)
    assert weight.status == 400
    client = served.app[ENGINE]
    assert not client._streams and not client._calls and len(client.outputs) == 0  # nothing left behind
    assert (await served.post("/v1/completions", json=completion())).status == 200
