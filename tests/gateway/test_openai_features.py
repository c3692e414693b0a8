"""The OpenAI features of issue 33 through the gateway: the official ``openai`` client talks to
the gateway, which proxies to a real ``cadenza serve`` (the tiny random model). Structured
outputs, ``n`` choices, tool calls and ``include_usage`` come back as the replica made them,
streamed and not, and a replica's 400 reaches the client as it was."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from server_process import cadenza_server

pytestmark = pytest.mark.slow  # one `cadenza serve` process

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
FORECAST = {"type": "function", "function": {
    "name": "forecast",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "days": {"enum": [1, 2, 3]}},
                   "required": ["unit", "days"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def replica_url(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ["--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--max-model-len", "1024"]
    with cadenza_server(args, log) as base_url:
        yield base_url.removesuffix("/v1")


async def test_structured_outputs_choices_and_tool_calls_pass_through_the_gateway(replica_url, start_gateway):
    gateway = await start_gateway({"interactive": [replica_url], "batch": [replica_url]})
    client = openai.AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key="unused", max_retries=0)
    hi = [{"role": "user", "content": "Who are you?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    whole = await client.chat.completions.create(model="tiny", messages=hi, max_tokens=60, temperature=1.0,
                                                 seed=4, n=2, response_format=fmt)
    assert [c.index for c in whole.choices] == [0, 1]
    for choice in whole.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)

    stream = await client.chat.completions.create(model="tiny", messages=hi, max_tokens=60, temperature=1.0,
                                                  seed=4, n=2, response_format=fmt, stream=True,
                                                  stream_options={"include_usage": True})
    texts, usage = {0: "", 1: ""}, None
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens

    called = await client.chat.completions.create(model="tiny", messages=hi, max_tokens=150, temperature=0,
                                                  tools=[FORECAST], tool_choice="required", parallel_tool_calls=False)
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "forecast" and called.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), FORECAST["function"]["parameters"])

    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        await client.chat.completions.create(model="tiny", messages=hi, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}}})


async def test_streamed_tool_calls_of_n_choices_pass_through_the_gateway_intact(replica_url, start_gateway):
    gateway = await start_gateway({"interactive": [replica_url], "batch": [replica_url]})
    client = openai.AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key="unused", max_retries=0)
    hi = [{"role": "user", "content": "Weather?"}]
    named = {"type": "function", "function": {"name": "forecast"}}
    kwargs = dict(model="tiny", messages=hi, max_tokens=80, temperature=1.0, seed=9, n=3, tools=[FORECAST],
                  tool_choice=named)

    whole = await client.chat.completions.create(**kwargs)
    calls: dict[int, list] = {0: [], 1: [], 2: []}
    reasons = {}
    async for chunk in await client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            for call in c.delta.tool_calls or []:
                if call.id is not None:  # a call's first delta: its id and name
                    calls[c.index].append([call.function.name, ""])
                calls[c.index][call.index][1] += call.function.arguments or ""
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    for choice in whole.choices:
        (call,) = choice.message.tool_calls
        assert calls[choice.index] == [[call.function.name, call.function.arguments]]
        assert reasons[choice.index] == choice.finish_reason == "stop"  # OpenAI's for a named function
        jsonschema.validate(json.loads(call.function.arguments), FORECAST["function"]["parameters"])
