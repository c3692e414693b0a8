"""Tool calling through the official ``openai`` client against a real ``cadenza serve`` process
(the tiny random model: its ChatML template renders no tools, so the fallback prompt is used;
``tool_choice`` required and named are held to the tools' schemas by the grammar engine)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from server_process import cadenza_server

pytestmark = pytest.mark.slow  # one `cadenza serve` process for the module

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FORECAST = {"type": "function", "function": {  # bounded: a random model's call ends within a few tokens
    "name": "forecast",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "days": {"enum": [1, 2, 3]}},
                   "required": ["unit", "days"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HI = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ["--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--max-model-len", "1024",
            "--tool-parser", "hermes"]
    with cadenza_server(args, log) as base_url:
        yield openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def chat(client, **kwargs):
    return client.chat.completions.create(model="tiny", messages=HI, **{"max_tokens": 8, "temperature": 0, **kwargs})


def test_tools_are_accepted_and_the_answer_is_content_or_calls(client):
    choice = chat(client, tools=[WEATHER]).choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.tool_calls or isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_answers_as_plain_chat(client):
    plain = chat(client, seed=1)
    none = chat(client, seed=1, tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # no tools in the prompt


def test_a_named_tool_choice_answers_one_call_of_that_function(client):
    resp = chat(client, tools=[WEATHER], tool_choice=NAMED)
    (call,) = resp.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert resp.choices[0].message.content is None
    assert resp.choices[0].finish_reason in ("stop", "length")  # OpenAI's for a function it was told to call


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_gives_arguments_valid_for_the_schema(client, stream):
    kwargs = {"tools": [WEATHER, FORECAST], "tool_choice": {"type": "function", "function": {"name": "forecast"}},
              "max_tokens": 40}
    for seed in range(3):
        if stream:
            chunks = list(chat(client, seed=seed, temperature=1.0, stream=True, **kwargs))
            calls = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or ()]
            name, arguments = calls[0].function.name, "".join(c.function.arguments or "" for c in calls)
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = chat(client, seed=seed, temperature=1.0, **kwargs).choices[0]
            (call,) = choice.message.tool_calls
            name, arguments, finish = call.function.name, call.function.arguments, choice.finish_reason
        assert name == "forecast" and finish == "stop"  # OpenAI's, streamed and not, for a named function
        jsonschema.validate(json.loads(arguments), FORECAST["function"]["parameters"])


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_calls_of_the_tools_valid_for_their_schemas(client, parallel):
    clock = {"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}
    schemas = {"forecast": FORECAST["function"]["parameters"], "now": clock["function"]["parameters"]}
    for seed in range(3):
        choice = chat(client, seed=seed, temperature=1.0, max_tokens=60, tools=[FORECAST, clock],
                      tool_choice="required", parallel_tool_calls=parallel).choices[0]
        calls = choice.message.tool_calls
        if parallel and choice.finish_reason == "length":  # a random model may list calls until the limit:
            calls = [c for c in calls if _is_json(c.function.arguments)]  # the last one cut
        else:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_named_tool_choice_streams_the_name_once_then_the_arguments(client):
    whole = chat(client, tools=[WEATHER], tool_choice=NAMED).choices[0].message.tool_calls[0]
    chunks = list(chat(client, tools=[WEATHER], tool_choice=NAMED, stream=True))
    calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or ()]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(c.id is None and c.function.name is None and c.index == 0 for c in calls[1:])
    assert "".join(c.function.arguments or "" for c in calls) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_conversation_with_calls_and_results_is_accepted(client):
    messages = [*HI,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    resp = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=4)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
])
def test_bad_tool_input_is_a_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **kwargs)
    assert info.value.param == param


@pytest.mark.parametrize("stream", [False, True])
def test_each_of_n_choices_gets_its_own_call(client, stream):
    kwargs = {"tools": [FORECAST], "tool_choice": {"type": "function", "function": {"name": "forecast"}},
              "max_tokens": 40, "temperature": 1.0, "seed": 3, "n": 3}
    if stream:
        calls: dict[int, list] = {}
        for chunk in chat(client, stream=True, **kwargs):
            for choice in chunk.choices:
                calls.setdefault(choice.index, []).extend(choice.delta.tool_calls or ())
        found = [(deltas[0].function.name, "".join(d.function.arguments or "" for d in deltas), len(
            {d.id for d in deltas if d.id})) for _i, deltas in sorted(calls.items())]
    else:
        found = [(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments,
                  len(c.message.tool_calls)) for c in chat(client, **kwargs).choices]
    assert len(found) == 3
    for name, arguments, count in found:
        assert name == "forecast" and count == 1
        jsonschema.validate(json.loads(arguments), FORECAST["function"]["parameters"])
