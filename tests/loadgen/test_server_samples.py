"""Polling a cadenza server's ``/ready`` counters during a replay, and tolerating other servers."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from cadenza.loadgen.client import ReplayConfig, replay
from cadenza.loadgen.server_samples import (
    OPTIONAL_KEYS, SAMPLE_KEYS, PrefixCacheHits, ServerSampler, parse_sample, prefix_cache_hits,
    ready_url)
from cadenza.loadgen.trace import TraceRequest
from fake_time import FakeTime
from waiting import until


def test_the_ready_url_is_the_origin_of_the_base_url():
    assert ready_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/ready"
    assert ready_url("https://gw.example/tenant/a/v1/") == "https://gw.example/ready"


def test_a_sample_keeps_the_time_and_the_counters_only():
    body = '{"status": "ready", "classes": {}, ' + ", ".join(f'"{k}": 1' for k in SAMPLE_KEYS) + "}"
    assert parse_sample(body, 1.5) == {"t": 1.5, **{k: 1 for k in SAMPLE_KEYS}}


def test_a_sample_keeps_the_prefix_cache_counters_only_when_the_server_has_them_as_numbers():
    counters = ", ".join(f'"{k}": 1' for k in SAMPLE_KEYS)
    with_them = "{" + counters + ', "prefix_cache_queried_tokens": 80, "prefix_cache_hit_tokens": 20}'
    assert parse_sample(with_them, 0.0)["prefix_cache_hit_tokens"] == 20
    odd = "{" + counters + ', "prefix_cache_queried_tokens": "80", "prefix_cache_hit_tokens": null}'
    assert set(parse_sample(odd, 0.0)) == {"t", *SAMPLE_KEYS}
    assert set(parse_sample("{" + counters + "}", 0.0)) == {"t", *SAMPLE_KEYS}


def _cache_sample(t: float, queried: int, hit: int) -> dict:
    return {"t": t, "prefix_cache_queried_tokens": queried, "prefix_cache_hit_tokens": hit}


def test_the_prefix_cache_hit_rate_is_the_counters_growth_from_first_to_last_sample():
    samples = [_cache_sample(0.0, 100, 10), _cache_sample(0.5, 300, 60), _cache_sample(1.0, 500, 110)]
    hits = prefix_cache_hits(samples)
    assert hits == PrefixCacheHits(hit_tokens=100, queried_tokens=400)
    assert hits.rate == pytest.approx(0.25)  # tokens cached before the replay do not count
    assert prefix_cache_hits([{"t": 0.0}, *samples, {"t": 2.0}]) == hits  # samples without them


@pytest.mark.parametrize("samples", [
    [],
    [{"t": 0.0, "num_steps": 1}, {"t": 1.0, "num_steps": 2}],  # a server without the counters
    [_cache_sample(0.0, 100, 10)],                              # one sample: no interval
    [_cache_sample(0.0, 100, 10), _cache_sample(1.0, 100, 10)],  # no prompt looked up
    [_cache_sample(0.0, 900, 90), _cache_sample(1.0, 100, 10)],  # counters reset by a restart
])
def test_the_prefix_cache_hit_rate_is_not_available_without_growing_counters(samples):
    assert prefix_cache_hits(samples) is None


@pytest.mark.parametrize("body, reason", [("<html></html>", "not JSON"), ("[1]", "not a JSON object"),
                                          ('{"num_steps": 1}', "lacks"),
                                          ('{' + ", ".join(f'"{k}": "x"' for k in SAMPLE_KEYS) + "}",
                                           "non-numeric")])
def test_a_body_that_is_not_cadenzas_is_rejected_with_a_reason(body, reason):
    with pytest.raises(ValueError, match=reason):
        parse_sample(body, 0.0)


async def test_the_sampler_keeps_growing_counters_at_increasing_times(fake_base_url, fake_app, fake):
    sampler = ServerSampler(f"{fake_base_url}/v1", interval_s=0.02)
    async with aiohttp.ClientSession() as session:
        zero = time.perf_counter()
        for _ in range(3):
            assert await sampler.poll(session, zero)
    assert len(fake_app[fake.READY_POLLS]) == 3
    assert [s["num_steps"] for s in sampler.samples] == [3, 6, 9]
    assert [s["t"] for s in sampler.samples] == sorted(s["t"] for s in sampler.samples)
    assert all(set(s) == {"t", *SAMPLE_KEYS, *OPTIONAL_KEYS} for s in sampler.samples)
    assert sampler.note is None


async def test_a_replay_is_sampled_from_its_start_until_after_its_last_request(aiohttp_server, fake):
    gate = asyncio.Event()  # no request gets a token until the sampler has polled twice
    app = fake.make_app(first_token_gate=gate)
    base = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    sampler = ServerSampler(f"{base}/v1", interval_s=0.03)
    trace = [TraceRequest(t, 4, 4) for t in (0.0, 0.05, 0.1)]
    replaying = asyncio.ensure_future(replay(trace, ["abcd"] * 3, ReplayConfig(f"{base}/v1", "fake-model"),
                                             sampler=sampler))
    try:
        await until(lambda: len(sampler.samples) >= 2, what="two samples while the replay waits")
    finally:
        gate.set()
    result = await asyncio.wait_for(replaying, 30)
    samples = sampler.samples
    assert len(samples) >= 3  # those two, then stop()'s
    first_token = min(r.start_s + r.ttft_ms / 1e3 for r in result.records)
    assert samples[0]["t"] < samples[1]["t"] < first_token  # sampling began with the replay, not after it
    assert samples[-1]["t"] >= result.duration_s  # the last one is taken after every request ended
    assert samples[-1]["num_running"] == 3  # the fake server reports requests received
    steps = [s["num_steps"] for s in samples]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)


@pytest.mark.parametrize("ready, reason", [("missing", "HTTP 404"), ("html", "not JSON"),
                                           ("partial", "lacks")])
async def test_a_server_without_cadenzas_counters_gives_no_samples_and_one_note(
        start_fake_server, ready, reason):
    base = await start_fake_server(ready=ready)
    sampler = ServerSampler(f"{base}/v1", interval_s=0.01)
    trace = [TraceRequest(t, 4, 3) for t in (0.0, 0.05)]
    result = await replay(trace, ["abcd"] * 2, ReplayConfig(f"{base}/v1", "fake-model"),
                          sampler=sampler)
    assert all(r.ok for r in result.records)  # the replay itself is unaffected
    assert sampler.samples == []
    assert reason in sampler.note and "not a cadenza server" in sampler.note


async def test_an_unreachable_ready_endpoint_is_noted_and_retried_not_raised():
    from server_process import free_port

    sampler = ServerSampler(f"http://127.0.0.1:{free_port()}/v1", timeout_s=0.5)
    async with aiohttp.ClientSession() as session:
        assert not await sampler.poll(session, time.perf_counter())
        assert not await sampler.poll(session, time.perf_counter())
    assert sampler.samples == []
    assert "Connect" in sampler.note and "2 of 2 polls failed" in sampler.note


async def test_a_busy_server_loses_only_the_samples_it_did_not_answer(aiohttp_server):
    from aiohttp import web

    answers = iter([web.json_response({k: 1 for k in SAMPLE_KEYS}),
                    web.json_response({"error": "loading"}, status=503),
                    web.json_response({k: 2 for k in SAMPLE_KEYS})])

    async def ready(request: web.Request) -> web.Response:
        return next(answers)

    app = web.Application()
    app.router.add_get("/ready", ready)
    server = await aiohttp_server(app)
    sampler = ServerSampler(str(server.make_url("/v1")))
    async with aiohttp.ClientSession() as session:
        assert [await sampler.poll(session, time.perf_counter()) for _ in range(3)] == [
            True, False, True]
    assert [s["num_steps"] for s in sampler.samples] == [1, 2]
    assert "1 of 3 polls" in sampler.note and "HTTP 503" in sampler.note


def test_the_sampling_interval_must_be_positive():
    with pytest.raises(ValueError):
        ServerSampler("http://h/v1", interval_s=0)


async def test_a_slow_answer_skips_the_ticks_it_missed_instead_of_catching_up(aiohttp_server, monkeypatch):
    from aiohttp import web

    from cadenza.loadgen import server_samples

    clock = FakeTime(stop_at=0.375)  # stops between ticks 7 (0.35 s) and 8 (0.40 s)
    clock.install(monkeypatch, server_samples)
    polled: list[float] = []

    async def ready(request: web.Request) -> web.Response:
        polled.append(clock.now)
        if len(polled) == 1:
            clock.now += 0.25  # five ticks of 0.05 s pass while the first poll is answered
        return web.json_response({k: len(polled) for k in SAMPLE_KEYS})

    app = web.Application()
    app.router.add_get("/ready", ready)
    server = await aiohttp_server(app)
    sampler = ServerSampler(str(server.make_url("/v1")), interval_s=0.05)
    async with aiohttp.ClientSession() as session:
        sampler.start(session, clock.perf_counter())
        await asyncio.wait_for(clock.stopped.wait(), 30)
        await sampler.stop()
    # The slow poll at tick 0, ticks 6 and 7 (0.30 s, 0.35 s), then stop()'s; catching up would add
    # ticks 1-5 right after the slow answer.
    assert [round(t / 0.05) for t in polled] == [0, 6, 7, 7]
    assert len(sampler.samples) == 4
