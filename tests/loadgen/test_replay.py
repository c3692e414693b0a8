"""Open-loop streaming replay against the fake OpenAI-compatible server (see conftest.py)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from cadenza.loadgen.client import ReplayConfig, api_base_url, fetch_model, replay
from cadenza.loadgen.trace import TraceRequest
from fake_time import FakeTime
from waiting import until


MODEL_ID = "fake-model"  # the first id the fake server lists


def _config(base: str, **kw) -> ReplayConfig:
    return ReplayConfig(base_url=f"{base}/v1", model=MODEL_ID, **kw)


@pytest.mark.parametrize("given", ["http://127.0.0.1:8000", "http://127.0.0.1:8000/",
                                   "http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/",
                                   " http://127.0.0.1:8000/v1// "])
def test_the_api_root_is_taken_with_or_without_v1_and_trailing_slashes(given):
    assert api_base_url(given) == "http://127.0.0.1:8000/v1"


def test_a_path_prefix_gets_v1_appended_and_another_version_is_kept():
    assert api_base_url("https://gw.example/tenant/a/") == "https://gw.example/tenant/a/v1"
    assert api_base_url("https://gw.example/tenant/a/v1") == "https://gw.example/tenant/a/v1"
    assert api_base_url("http://h:9000/v2/") == "http://h:9000/v2"
    assert api_base_url("http://h/v1?x=1#top") == "http://h/v1"


@pytest.mark.parametrize("bad", ["127.0.0.1:8000", "localhost", "ftp://h/v1", "http:///v1", ""])
def test_an_api_root_that_is_not_an_http_url_is_refused(bad):
    with pytest.raises(ValueError, match="not an http"):
        api_base_url(bad)


async def test_each_request_gets_a_ttft_and_one_itl_gap_per_token_after_the_first(
        fake_base_url, fake):
    trace = [TraceRequest(0.0, 10, 4), TraceRequest(0.0, 20, 1), TraceRequest(0.01, 5, 6)]
    result = await replay(trace, ["a" * 10, "b" * 20, "c" * 5], _config(fake_base_url))

    for record, request in zip(result.records, trace):
        assert record.ok, record.error
        assert record.completion_tokens == request.output_len
        assert record.prompt_tokens == request.input_len  # the fake server counts bytes
        assert len(record.itl_ms) == request.output_len - 1
        assert record.ttft_ms >= fake.FIRST_TOKEN_DELAY_S * 1e3 * 0.9
        assert record.e2e_ms >= record.ttft_ms + sum(record.itl_ms) * 0.99
    assert result.duration_s >= max(r.e2e_ms for r in result.records) / 1e3


async def test_requests_are_sent_at_their_scheduled_arrival(fake_base_url, monkeypatch):
    from cadenza.loadgen import client

    clock = FakeTime(oversleep=0.01)  # every sleep wakes 10 ms late, as on a loaded machine
    clock.install(monkeypatch, client)
    trace = [TraceRequest(t, 4, 2) for t in (0.0, 0.15, 0.3, 0.3, 0.5)]
    result = await replay(trace, ["abcd"] * 5, _config(fake_base_url))
    # Never early, and late only by the one sleep before it: lateness does not add up over a trace.
    assert [round(r.start_s - r.arrival_s, 6) for r in result.records] == [0.0, 0.01, 0.01, 0.01, 0.01]


async def test_a_slow_request_does_not_delay_later_arrivals(aiohttp_server, fake):
    gate = asyncio.Event()  # no completion gets a token until the test says so
    app = fake.make_app(first_token_gate=gate)
    base = str((await aiohttp_server(app)).make_url("")).rstrip("/")
    trace = [TraceRequest(0.0, 4, 2), TraceRequest(0.05, 4, 2)]
    replaying = asyncio.ensure_future(replay(trace, ["abcd"] * 2, _config(base)))
    try:
        await until(lambda: len(app[fake.RECEIVED]) == 2)  # sent while the first one still waits for a token
    finally:
        gate.set()
    result = await asyncio.wait_for(replaying, 30)
    assert all(r.ok for r in result.records)


async def test_the_payload_asks_for_exactly_the_traces_output_length(
        fake_base_url, fake_app, fake):
    await replay([TraceRequest(0.0, 3, 5)], ["abc"], _config(fake_base_url))
    (body,) = fake_app[fake.RECEIVED]
    assert body == {"path": "/v1/completions", "model": MODEL_ID, "prompt": "abc",
                    "max_tokens": 5, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": 0}


async def test_chat_endpoint_sends_one_user_message_and_skips_role_only_chunks(
        fake_base_url, fake_app, fake):
    result = await replay([TraceRequest(0.0, 3, 3)], ["abc"],
                          _config(fake_base_url, endpoint="chat"))
    (body,) = fake_app[fake.RECEIVED]
    assert body["path"] == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "abc"}]
    (record,) = result.records
    assert record.ok and record.completion_tokens == 3 and len(record.itl_ms) == 2


async def test_http_errors_are_failed_requests_with_status_and_message(fake_base_url, fake):
    trace = [TraceRequest(0.0, 4, 3), TraceRequest(0.0, 4, fake.FAIL_MAX_TOKENS)]
    ok, failed = (await replay(trace, ["abcd"] * 2, _config(fake_base_url))).records
    assert ok.ok
    assert not failed.ok and failed.error == "HTTP 500: boom"
    assert failed.ttft_ms is None and failed.itl_ms == []

    busy = await replay([TraceRequest(0.0, 4, 3)], ["abcd"],
                        ReplayConfig(f"{fake_base_url}/busy/v1", MODEL_ID))
    assert busy.records[0].error == "HTTP 429: server overloaded"


async def test_a_stream_cut_before_done_is_a_failed_request(fake_base_url):
    result = await replay([TraceRequest(0.0, 4, 3)], ["abcd"],
                          ReplayConfig(f"{fake_base_url}/truncated/v1", MODEL_ID))
    (record,) = result.records
    assert not record.ok and "[DONE]" in record.error
    assert record.completion_tokens == 3  # counted from the chunks that did arrive


async def test_connection_errors_are_failed_requests_not_crashes():
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = await replay([TraceRequest(0.0, 4, 3)] * 2, ["abcd"] * 2,
                          ReplayConfig(f"http://127.0.0.1:{port}/v1", MODEL_ID))
    assert all(not r.ok and "Connect" in r.error for r in result.records)


async def test_the_request_timeout_fails_a_request_that_takes_too_long(start_fake_server):
    base = await start_fake_server(stall_s=600.0)  # its first token would come 10 minutes late
    result = await replay([TraceRequest(0.0, 4, 3)], ["abcd"], _config(base, timeout_s=0.1))
    (record,) = result.records
    assert not record.ok and record.error == "timed out after 0.1 s"
    assert record.e2e_ms < 60_000  # given up on, not waited for


async def test_the_default_model_is_the_first_listed_id(fake_base_url):
    async with aiohttp.ClientSession() as session:
        assert await fetch_model(session, f"{fake_base_url}/v1") == MODEL_ID
        with pytest.raises(RuntimeError, match="pass --model"):
            await fetch_model(session, f"{fake_base_url}/nowhere/v1")


async def test_an_unreachable_server_is_reported_as_such():
    from server_process import free_port

    async with aiohttp.ClientSession() as session:
        with pytest.raises(RuntimeError, match="is the server running"):
            await fetch_model(session, f"http://127.0.0.1:{free_port()}/v1")


async def test_requests_and_prompts_must_pair_up(fake_base_url):
    with pytest.raises(ValueError):
        await replay([TraceRequest(0.0, 1, 1)], [], _config(fake_base_url))
