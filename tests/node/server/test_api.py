"""The OpenAI-compatible API over a tiny random model: formats, bad input, cancellation."""

from __future__ import annotations

import asyncio
import json

import pytest

from cadenza.node.core.config import CacheConfig, EngineConfig, SchedulerConfig
from cadenza.node.engine.engine_core import EngineCore
from cadenza.node.server.app import create_app
from cadenza.node.server.app_keys import ENGINE, TELEMETRY
from step_gate import StepGate
from waiting import until

MODEL = "tiny"
MAX_MODEL_LEN = 256


@pytest.fixture
async def client(aiohttp_client, tiny_llama_dir):
    config = EngineConfig(
        model=str(tiny_llama_dir),
        served_model_name=MODEL,
        scheduler=SchedulerConfig(token_budget=64, chunk_size=16, max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_kv_blocks=64),
    )
    app = create_app(config, MODEL)
    client = await aiohttp_client(app)
    await app[ENGINE].wait_ready()
    return client


def engine_of(client) -> EngineCore:
    return client.app[ENGINE].core


async def sse_events(resp) -> list:
    """Parse a server-sent-event body into JSON objects, with "[DONE]" kept as a string."""
    events = []
    async for line in resp.content:
        line = line.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


GOOD_COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4}


async def assert_still_serving(client) -> None:
    resp = await client.post("/v1/completions", json=GOOD_COMPLETION)
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["usage"]["completion_tokens"] == 4


# -- happy paths -----------------------------------------------------------------------------------


async def test_completion_returns_text_and_usage(client):
    resp = await client.post("/v1/completions", json=GOOD_COMPLETION)
    body = await resp.json()
    assert resp.status == 200
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    prompt_len = len(client.app[ENGINE].tokenizer.encode("Hello there"))
    assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 4, "total_tokens": prompt_len + 4}


async def test_completion_accepts_token_ids_as_the_prompt(client):
    resp = await client.post("/v1/completions", json={**GOOD_COMPLETION, "prompt": [5, 6, 7]})
    assert (await resp.json())["usage"]["prompt_tokens"] == 3


async def test_chat_completion_returns_an_assistant_message(client):
    resp = await client.post("/v1/chat/completions", json=GOOD_CHAT)
    body = await resp.json()
    assert resp.status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


async def test_completion_stream_ends_with_done_and_usage_when_asked(client):
    payload = {**GOOD_COMPLETION, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    resp = await client.post("/v1/completions", json=payload)
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    chunks = events[:-2]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks)
    full = await (await client.post("/v1/completions", json={**GOOD_COMPLETION, "max_tokens": 6, "ignore_eos": True})).json()
    assert text == full["choices"][0]["text"]


async def test_chat_stream_opens_with_the_role_and_closes_with_finish_reason(client):
    resp = await client.post("/v1/chat/completions", json={**GOOD_CHAT, "stream": True})
    events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in c for c in chunks)


async def test_models_health_and_ready(client):
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert (await client.get("/health")).status == 200
    ready = await client.get("/ready")
    assert ready.status == 200 and (await ready.json())["kv_blocks_total"] == 64


# -- bad input: a clear 4xx, and the server goes on serving ------------------------------------------

LONG_PROMPT = [5] * (MAX_MODEL_LEN + 1)

BAD_REQUESTS = {
    "malformed-json": ("/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    "not-an-object": ("/v1/completions", [1, 2], 400, None),
    "missing-prompt": ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    "empty-prompt": ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    "empty-token-prompt": ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    "token-outside-vocab": ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
    "missing-messages": ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    "empty-messages": ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    "bad-role": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    "unknown-model": ("/v1/completions", {"model": "gpt-5", "prompt": "hi"}, 404, "model"),
    "max-tokens-zero": ("/v1/completions", {**GOOD_COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    "max-tokens-negative": ("/v1/chat/completions", {**GOOD_CHAT, "max_tokens": -3}, 400, "max_tokens"),
    "max-tokens-float": ("/v1/completions", {**GOOD_COMPLETION, "max_tokens": 2.5}, 400, "max_tokens"),
    "max-tokens-string": ("/v1/completions", {**GOOD_COMPLETION, "max_tokens": "4"}, 400, "max_tokens"),
    "prompt-over-max-model-len": ("/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT}, 400, "prompt"),
    "prompt-plus-max-tokens-over-max-model-len": (
        "/v1/completions", {"model": MODEL, "prompt": [5] * 200, "max_tokens": 100}, 400, "max_tokens"),
    "negative-temperature": ("/v1/completions", {**GOOD_COMPLETION, "temperature": -0.1}, 400, "temperature"),
    "top-p-zero": ("/v1/completions", {**GOOD_COMPLETION, "top_p": 0}, 400, "top_p"),
    "top-p-above-one": ("/v1/chat/completions", {**GOOD_CHAT, "top_p": 1.01}, 400, "top_p"),
    "empty-stop-string": ("/v1/completions", {**GOOD_COMPLETION, "stop": [""]}, 400, "stop"),
    "n-above-max": ("/v1/completions", {**GOOD_COMPLETION, "n": 17}, 400, "n"),
    "n-zero": ("/v1/chat/completions", {**GOOD_CHAT, "n": 0}, 400, "n"),
    "seed-beyond-int64": ("/v1/completions", {**GOOD_COMPLETION, "seed": 2**70}, 400, "seed"),
    "temperature-boolean": ("/v1/completions", {**GOOD_COMPLETION, "temperature": True}, 400, "temperature"),
    "lone-surrogate-prompt": ("/v1/completions", {**GOOD_COMPLETION, "prompt": "x\ud800y"}, 400, "prompt"),
    "lone-surrogate-message": (
        "/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": "\ud83d"}]}, 400,
        "messages.0.content"),
    "lone-surrogate-tool-description": (
        "/v1/chat/completions", {**GOOD_CHAT, "tools": [{"type": "function", "function": {
            "name": "f", "description": "\ud800"}}]}, 400, "tools.0.function.description"),
    "lone-surrogate-tool-schema": (
        "/v1/chat/completions", {**GOOD_CHAT, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"\udfff": {}}}}}]}, 400,
        "tools.0.function.parameters"),
    "lone-surrogate-call-arguments": (
        "/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": "\ud800"}'}}]}]},
        400, "messages.0.tool_calls.0.function.arguments"),
    "lone-surrogate-message-name": (
        "/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": "x", "name": "\ud800"}]},
        400, "messages.0.name"),
    "deeply-nested-json": ("/v1/completions", b'{"model": "tiny", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                           400, None),
    "image-content-part": (
        "/v1/chat/completions",
        {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400, "messages.0.content.0"),
    "text-part-without-text": (
        "/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
        "messages.0.content.0"),
    "logit-bias": ("/v1/completions", {**GOOD_COMPLETION, "logit_bias": {"5": 10}}, 400, "logit_bias"),
    "top-logprobs-above-20": ("/v1/chat/completions", {**GOOD_CHAT, "logprobs": True, "top_logprobs": 21}, 400,
                              "top_logprobs"),
    "top-logprobs-without-logprobs": ("/v1/chat/completions", {**GOOD_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    "chat-logprobs-a-number": ("/v1/chat/completions", {**GOOD_CHAT, "logprobs": 3}, 400, "logprobs"),
    "completion-logprobs-above-5": ("/v1/completions", {**GOOD_COMPLETION, "logprobs": 6}, 400, "logprobs"),
    "completion-logprobs-boolean": ("/v1/completions", {**GOOD_COMPLETION, "logprobs": True}, 400, "logprobs"),
    "response-format-unknown-type": ("/v1/chat/completions", {**GOOD_CHAT, "response_format": {"type": "yaml"}},
                                     400, "response_format"),
    "response-format-schema-unimplemented": (
        "/v1/chat/completions", {**GOOD_CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "array", "uniqueItems": True}}}}, 400, "response_format"),
    "response-format-schema-invalid-type": (
        "/v1/completions", {**GOOD_COMPLETION, "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "float"}}}}, 400, "response_format"),
    "response-format-schema-missing": ("/v1/chat/completions", {**GOOD_CHAT, "response_format": {
        "type": "json_schema"}}, 400, "response_format"),
    "response-format-bad-name": ("/v1/chat/completions", {**GOOD_CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}}, 400, "response_format.json_schema.name"),
    "tool-choice-unknown-function": (
        "/v1/chat/completions", {**GOOD_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                                 "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    "tool-choice-without-tools": ("/v1/chat/completions", {**GOOD_CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    "tool-choice-unknown-word": (
        "/v1/chat/completions", {**GOOD_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                                 "tool_choice": "always"}, 400, "tool_choice"),
    "tools-duplicate-names": (
        "/v1/chat/completions", {**GOOD_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, 400,
        "tools"),
    "tools-too-many": ("/v1/chat/completions", {**GOOD_CHAT, "tools": [
        {"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, 400, "tools"),
    "tool-bad-function-name": ("/v1/chat/completions", {**GOOD_CHAT, "tools": [
        {"type": "function", "function": {"name": "get weather"}}]}, 400, "tools.0.function.name"),
    "tool-parameters-not-a-schema": ("/v1/chat/completions", {**GOOD_CHAT, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]}, 400,
        "tools.0.function.parameters"),
    "tool-parameters-too-deep": ("/v1/chat/completions", {**GOOD_CHAT, "tools": [
        {"type": "function", "function": {"name": "f",
                                          "parameters": json.loads('{"items": ' * 500 + "{}" + "}" * 500)}}]}, 400,
        "tools.0.function.parameters"),
    "tool-message-without-call-id": (
        "/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "tool", "content": "42"}]}, 400, "messages.0"),
    "tool-choice-schema-unimplemented": ("/v1/chat/completions", {**GOOD_CHAT, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tools"),
    "suffix": ("/v1/completions", {**GOOD_COMPLETION, "suffix": "end"}, 400, "suffix"),
    "best-of": ("/v1/completions", {**GOOD_COMPLETION, "best_of": 3}, 400, "best_of"),
    "oversized-prompt-text": ("/v1/completions", {**GOOD_COMPLETION, "prompt": "word " * 200_000}, 400, "prompt"),
    "too-many-stop-strings": ("/v1/completions", {**GOOD_COMPLETION, "stop": [f"s{i}" for i in range(17)]}, 400,
                              "stop"),
    "a-million-stop-strings": ("/v1/completions", {**GOOD_COMPLETION, "stop": ["x"] * 1_000_000}, 400, "stop"),
    "over-long-stop-string": ("/v1/completions", {**GOOD_COMPLETION, "stop": ["x" * 257]}, 400, "stop"),
    "too-many-stop-token-ids": ("/v1/completions", {**GOOD_COMPLETION, "stop_token_ids": list(range(257))}, 400,
                                "stop_token_ids"),
    "negative-stop-token-id": ("/v1/completions", {**GOOD_COMPLETION, "stop_token_ids": [-1]}, 400,
                               "stop_token_ids.0"),
    "too-many-messages": ("/v1/chat/completions",
                          {**GOOD_CHAT, "messages": [{"role": "user", "content": "x"}] * 2049}, 400, "messages"),
    "too-many-content-parts": (
        "/v1/chat/completions",
        {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 8193}]}, 400,
        "messages"),
    "many-tiny-messages-over-max-model-len": (
        "/v1/chat/completions", {**GOOD_CHAT, "messages": [{"role": "user", "content": "x"}] * 2000}, 400,
        "messages"),
    "million-token-ids": ("/v1/completions", {**GOOD_COMPLETION, "prompt": [5] * 1_000_000}, 400, "prompt"),
    "empty-cache-salt": ("/v1/completions", {**GOOD_COMPLETION, "cache_salt": ""}, 400, "cache_salt"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
async def test_bad_request_is_a_4xx_in_openai_format_and_serving_goes_on(client, case):
    path, body, status, param = BAD_REQUESTS[case]
    if isinstance(body, bytes):
        resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    else:
        resp = await client.post(path, json=body)
    assert resp.status == status
    error = (await resp.json())["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    await assert_still_serving(client)
    assert engine_of(client).block_manager.num_used_blocks == 0


async def test_null_fields_take_their_defaults(client):
    body = {**GOOD_COMPLETION, "n": None, "stream": None, "presence_penalty": None, "stop": None, "seed": None,
            "temperature": None, "top_p": None, "stream_options": None, "logit_bias": None}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200, await resp.text()


async def test_text_content_parts_are_joined(client):
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    with_parts = await client.post("/v1/chat/completions", json={**GOOD_CHAT, "temperature": 0,
                                                                  "messages": [{"role": "user", "content": parts}]})
    plain = await client.post("/v1/chat/completions", json={**GOOD_CHAT, "temperature": 0,
                                                             "messages": [{"role": "user", "content": "Hello there"}]})
    assert (await with_parts.json())["choices"] == (await plain.json())["choices"]


async def test_extreme_but_valid_sampling_values_never_fail_other_requests(client):
    """A temperature or top_p that underflows in fp32 is served (as greedy), never a failed step."""
    stream = asyncio.ensure_future(client.post("/v1/completions", json={**GOOD_COMPLETION, "max_tokens": 30, "ignore_eos": True}))
    for extreme in ({"temperature": 1e-38}, {"temperature": 1e-300}, {"top_p": 1e-46, "temperature": 1.0}):
        resp = await client.post("/v1/completions", json={**GOOD_COMPLETION, **extreme})
        assert resp.status == 200, (extreme, await resp.text())
    resp = await stream
    assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 30


async def test_context_length_error_says_how_long_the_model_is(client):
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": LONG_PROMPT})
    error = (await resp.json())["error"]
    assert error["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in error["message"]


async def test_unknown_route_and_wrong_method_answer_in_openai_format(client):
    resp = await client.get("/v1/nothing")
    assert resp.status == 404 and "error" in await resp.json()
    resp = await client.get("/v1/completions")
    assert resp.status == 405 and "error" in await resp.json()
    await assert_still_serving(client)


# -- cancellation ------------------------------------------------------------------------------------


def record_aborts(engine: EngineCore, monkeypatch) -> list[dict]:
    """Record each abort's request state as the engine thread applies it."""
    seen: list[dict] = []
    original = engine.abort_request

    def abort(request_id: str, reason: str = "abort") -> bool:
        req = engine.scheduler.requests.get(request_id)
        if req is not None:
            seen.append({"id": request_id, "computed": req.num_computed_tokens,
                         "prompt": req.num_prompt_tokens, "output": req.num_output_tokens})
        return original(request_id, reason)

    monkeypatch.setattr(engine, "abort_request", abort)
    return seen


def record_outputs(engine: EngineCore, monkeypatch) -> list[str]:
    produced: list[str] = []
    original = engine.step

    def step():
        deltas, record = original()
        produced.extend(d.request_id for d in deltas)
        return deltas, record

    monkeypatch.setattr(engine, "step", step)
    return produced


def record_cancellations(client, monkeypatch) -> list[str]:
    """Request ids whose handler saw its client go away (by then the abort is queued for the engine)."""
    telemetry = client.app[TELEMETRY]
    original = telemetry.fail_request
    cancelled: list[str] = []

    def fail_request(request_id: str, error_type: str, message: str) -> None:
        if error_type == "cancelled":
            cancelled.append(request_id)
        original(request_id, error_type, message)

    monkeypatch.setattr(telemetry, "fail_request", fail_request)
    return cancelled


async def test_client_disconnect_mid_decode_aborts_and_frees_blocks(client, monkeypatch):
    engine = engine_of(client)
    aborts = record_aborts(engine, monkeypatch)
    produced = record_outputs(engine, monkeypatch)
    cancelled = record_cancellations(client, monkeypatch)
    gate = StepGate(engine.runner, monkeypatch, delay_s=0.01)  # 200 tokens take seconds: still decoding below
    payload = {**GOOD_COMPLETION, "max_tokens": 200, "ignore_eos": True, "stream": True}
    resp = await client.post("/v1/completions", json=payload)
    received = 0
    try:
        async for line in resp.content:
            if line.startswith(b"data: "):
                received += 1
            if received == 3:
                break
        gate.hold()
        await gate.held()  # mid-decode, and it stays there until the server has seen the disconnect
        resp.close()  # the client goes away mid-decode
        await until(lambda: cancelled)
    finally:
        gate.release()
    await until(lambda: aborts and engine.block_manager.num_used_blocks == 0)
    (abort,) = aborts
    assert abort["computed"] >= abort["prompt"] and 3 <= abort["output"] < 200
    count_at_abort = produced.count(abort["id"])
    await assert_still_serving(client)
    assert produced.count(abort["id"]) == count_at_abort == abort["output"]


async def test_client_disconnect_aborts_every_choice_at_once_and_frees_their_blocks(client, monkeypatch):
    engine = engine_of(client)
    aborts = record_aborts(engine, monkeypatch)
    cancelled = record_cancellations(client, monkeypatch)
    gate = StepGate(engine.runner, monkeypatch, delay_s=0.01)
    payload = {**GOOD_COMPLETION, "prompt": list(range(5, 45)), "max_tokens": 200, "ignore_eos": True,
               "stream": True, "n": 4, "temperature": 1.0}
    resp = await client.post("/v1/completions", json=payload)
    indexes = set()
    try:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                indexes.add(json.loads(line[6:])["choices"][0]["index"])
            if len(indexes) == 4:  # every choice is decoding (two blocks of the prompt shared)
                break
        gate.hold()
        await gate.held()
        resp.close()
        await until(lambda: cancelled)
    finally:
        gate.release()
    await until(lambda: len(aborts) == 4 and engine.block_manager.num_used_blocks == 0)
    assert all(a["output"] >= 1 for a in aborts) and not engine.scheduler.requests
    assert engine.block_manager.consistent()
    await assert_still_serving(client)


async def test_client_disconnect_mid_prefill_aborts_before_any_token(client, monkeypatch):
    engine = engine_of(client)
    aborts = record_aborts(engine, monkeypatch)
    produced = record_outputs(engine, monkeypatch)
    cancelled = record_cancellations(client, monkeypatch)
    gate = StepGate(engine.runner, monkeypatch)
    payload = {"model": MODEL, "prompt": [5] * 200, "max_tokens": 10}  # 13 chunks of 16
    gate.hold()
    try:
        posted = asyncio.ensure_future(client.post("/v1/completions", json=payload))
        await gate.held()  # its first chunk is in the step
        posted.cancel()  # the client goes away mid-prefill
        await until(lambda: cancelled)
    finally:
        gate.release()
    with pytest.raises(asyncio.CancelledError):
        await posted
    await until(lambda: aborts and engine.block_manager.num_used_blocks == 0)
    (abort,) = aborts
    assert 0 < abort["computed"] < abort["prompt"] and abort["output"] == 0
    await assert_still_serving(client)
    assert abort["id"] not in produced


async def test_a_failing_step_fails_the_requests_in_flight_and_serving_goes_on(client, monkeypatch):
    engine = engine_of(client)
    original = engine.runner.execute
    calls = {"n": 0}

    def execute(step, masks=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device fault")
        return original(step, masks)

    monkeypatch.setattr(engine.runner, "execute", execute)
    resp = await client.post("/v1/completions", json=GOOD_COMPLETION)
    assert resp.status == 500
    assert "simulated device fault" in (await resp.json())["error"]["message"]
    assert engine.block_manager.num_used_blocks == 0
    await assert_still_serving(client)
    assert (await client.get("/health")).status == 200


async def test_huge_shapes_are_refused_before_they_are_validated_item_by_item(client, monkeypatch):
    """A quarter of a million one-character messages: a 400 from the raw JSON's counts, without
    pydantic validating the messages or the template rendering them."""
    from cadenza.node.server import protocol

    validated = []
    original = protocol.parse
    monkeypatch.setattr("cadenza.node.server.openai_api.parse", lambda model, body: validated.append(1) or
                        original(model, body))
    rendered = []
    monkeypatch.setattr(client.app[ENGINE].tokenizer, "encode_chat", lambda *a, **k: rendered.append(1))
    body = {**GOOD_CHAT, "messages": [{"role": "user", "content": "x"}] * 250_000}
    resp = await client.post("/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
    assert resp.status in (400, 413)
    assert not validated and not rendered
    monkeypatch.undo()
    await assert_still_serving(client)


async def test_many_stop_strings_within_the_limit_work(client):
    stops = [f"zz{i}qq" for i in range(16)]
    resp = await client.post("/v1/completions", json={**GOOD_COMPLETION, "stop": stops, "stop_token_ids": [0] * 256})
    assert resp.status == 200, await resp.text()


async def test_unset_sampling_fields_take_the_models_generation_config(aiohttp_client, tiny_llama_dir, tmp_path):
    """temperature 0 in generation_config.json: a request without a temperature is greedy."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5, "top_p": 2.0}))
    config = EngineConfig(model=str(model), served_model_name=MODEL,
                          scheduler=SchedulerConfig(token_budget=64, chunk_size=16, max_model_len=MAX_MODEL_LEN),
                          cache=CacheConfig(block_size=16, num_kv_blocks=64))
    app = create_app(config, MODEL)
    client = await aiohttp_client(app)
    await app[ENGINE].wait_ready()
    defaults = app[ENGINE].inputs.defaults
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.0, 5, 1.0)  # the out-of-range top_p is ignored
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 8, "ignore_eos": True}
    texts = {(await (await client.post("/v1/completions", json={**body, "seed": seed})).json())["choices"][0]["text"]
             for seed in range(4)}
    assert len(texts) == 1  # greedy whatever the seed
    sampled = {(await (await client.post("/v1/completions", json={**body, "seed": seed, "temperature": 1.5,
                                                                  "top_k": 0})).json())["choices"][0]["text"]
               for seed in range(4)}
    assert len(sampled) > 1  # a request's own values win


async def test_a_cache_salt_keeps_a_prompt_out_of_other_requests_prefix_cache(client):
    prompt = list(range(10, 90))  # five full blocks of 16
    stats = engine_of(client).scheduler.stats

    async def hits(extra) -> int:
        before = stats.prefix_cache_hit_tokens
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra})
        assert resp.status == 200, await resp.text()
        return stats.prefix_cache_hit_tokens - before

    assert await hits({"cache_salt": "tenant-a-secret"}) == 0
    assert await hits({}) == 0  # the salted copy is invisible without the salt
    assert await hits({"cache_salt": "tenant-b"}) == 0
    assert await hits({"cache_salt": "tenant-a-secret"}) == 64


async def test_the_step_log_records_every_step_the_server_runs(aiohttp_client, tiny_llama_dir, tmp_path):
    from cadenza.sim.calibrate import load_step_table

    log = tmp_path / "steps.jsonl"
    config = EngineConfig(model=str(tiny_llama_dir), served_model_name=MODEL,
                          scheduler=SchedulerConfig(token_budget=64, chunk_size=16, max_model_len=MAX_MODEL_LEN),
                          cache=CacheConfig(block_size=16, num_kv_blocks=64))
    app = create_app(config, MODEL, step_log=log)
    client = await aiohttp_client(app)
    await app[ENGINE].wait_ready()
    resp = await client.post("/v1/completions", json={**GOOD_COMPLETION, "prompt": "word " * 40, "ignore_eos": True})
    body = await resp.json()
    steps = load_step_table(log)  # flushed as it goes: readable while the server runs
    prompt, output = body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]
    assert sum(s.composition.prefill_tokens for s in steps) == prompt
    assert sum(s.composition.num_sampled for s in steps) == output
    assert all(s.composition.prefill_tokens <= 16 for s in steps)  # chunks of the server's chunk size
    assert all(s.seconds > 0 and s.host_seconds > 0 for s in steps)
