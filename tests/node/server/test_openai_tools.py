"""Tool calling through the official ``openai`` client against a real ``cadenza serve`` process
(the tiny random model: its ChatML template renders no tools, so the fallback prompt is used)."""

from __future__ import annotations

import openai
import pytest

from server_process import cadenza_server

pytestmark = pytest.mark.slow  # one `cadenza serve` process for the module

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
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
    return client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=0, **kwargs)


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
    assert resp.choices[0].finish_reason in ("tool_calls", "length")


def test_a_named_tool_choice_streams_the_name_once_then_the_arguments(client):
    whole = chat(client, tools=[WEATHER], tool_choice=NAMED).choices[0].message.tool_calls[0]
    chunks = list(chat(client, tools=[WEATHER], tool_choice=NAMED, stream=True))
    calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or ()]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(c.id is None and c.function.name is None and c.index == 0 for c in calls[1:])
    assert "".join(c.function.arguments or "" for c in calls) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason in ("tool_calls", "length")


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
