"""A replica whose engine thread died exits (code 1), so its supervisor restarts it, instead of
answering 503 forever while its process lives."""

from __future__ import annotations

import asyncio
import time

from cadenza.node.core.config import CacheConfig, EngineConfig, SchedulerConfig
from cadenza.node.server.app import create_app, until_stopped_or_failed
from cadenza.node.server.app_keys import ENGINE
from step_gate import StepGate


class SimulatedCrash(BaseException):
    """What no command handler catches: a bug in the engine loop itself."""


async def test_the_server_exits_with_1_when_its_loaded_engine_dies(aiohttp_client, tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), served_model_name="tiny",
                          scheduler=SchedulerConfig(token_budget=64, chunk_size=16, max_model_len=256),
                          cache=CacheConfig(num_kv_blocks=64))
    app = create_app(config, "tiny")
    client = await aiohttp_client(app)
    await app[ENGINE].wait_ready()
    engine = app[ENGINE].core
    stop = asyncio.Event()
    serving = asyncio.ensure_future(until_stopped_or_failed(app, stop))
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    assert (await client.post("/v1/completions", json=body)).status == 200
    assert not serving.done()

    def crash():
        raise SimulatedCrash("the engine loop broke")

    engine.step = crash
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 503  # the request in flight fails at once, not after a timeout
    assert await asyncio.wait_for(serving, timeout=30) == 1
    assert (await client.get("/health")).status == 503


async def test_the_server_exits_with_0_when_stopped(aiohttp_client, tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), served_model_name="tiny",
                          scheduler=SchedulerConfig(max_model_len=256), cache=CacheConfig(num_kv_blocks=64))
    app = create_app(config, "tiny")
    await aiohttp_client(app)
    await app[ENGINE].wait_ready()
    stop = asyncio.Event()
    serving = asyncio.ensure_future(until_stopped_or_failed(app, stop))
    await asyncio.sleep(0)
    stop.set()
    assert await asyncio.wait_for(serving, timeout=30) == 0


async def test_a_step_that_never_returns_in_the_engine_thread_is_a_dead_engine_after_the_stall_timeout(
        aiohttp_client, tiny_llama_dir, monkeypatch):
    """``--engine-process off``: the core cannot be stopped apart from its server (a SIGSTOP freezes
    both, and the liveness probe's timeout restarts the pod), but a step stuck in the model is
    caught by the same watch as a stopped core process; steps slower than a second are not."""
    config = EngineConfig(model=str(tiny_llama_dir), served_model_name="tiny",
                          scheduler=SchedulerConfig(token_budget=64, chunk_size=16, max_model_len=256),
                          cache=CacheConfig(num_kv_blocks=64))
    app = create_app(config, "tiny", stall_timeout_s=1.5)
    client = await aiohttp_client(app)
    await app[ENGINE].wait_ready()
    serving = asyncio.ensure_future(until_stopped_or_failed(app, asyncio.Event()))
    gate = StepGate(app[ENGINE].core.runner, monkeypatch, delay_s=0.5)  # slow, legitimate steps
    try:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        assert (await client.post("/v1/completions", json=body)).status == 200
        await asyncio.sleep(2.5)  # idle past the timeout
        assert (await client.get("/health")).status == 200 and not serving.done()
        gate.hold()  # the next step never returns
        started = time.monotonic()
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 503 and "sent nothing" in (await resp.json())["error"]["message"]
        assert 1.0 < time.monotonic() - started < 15
        assert (await client.get("/health")).status == 503 and (await client.get("/ready")).status == 503
        assert await asyncio.wait_for(serving, timeout=30) == 1
    finally:
        gate.release()
