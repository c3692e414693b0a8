"""A chat response's tool calls from scripted outputs (no engine): OpenAI's message, and the
stream deltas that add up to it wherever the text is cut."""

from __future__ import annotations

import pytest

from cadenza.node.frontend.output_processor import RequestOutput
from cadenza.node.frontend.tool_choice import forced_parser
from cadenza.node.frontend.tool_parsers import HermesParser, Llama3JsonParser
from cadenza.node.server.tool_calls import ToolCallOutput

HERMES = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')


def outputs(pieces: list[str], finish_reason: str = "stop") -> list[RequestOutput]:
    last = len(pieces) - 1
    return [RequestOutput("r", [1], piece, finish_reason if i == last else None, 3, i + 1)
            for i, piece in enumerate(pieces)]


def accumulate(chunks: list[tuple[dict | None, str | None]]) -> dict:
    """Put stream deltas together as a client does (the openai library's way)."""
    message: dict = {"role": "assistant", "content": None, "tool_calls": []}
    reason = None
    for delta, finish in chunks:
        reason = finish or reason
        for call in (delta or {}).get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(message["tool_calls"])
                assert call["type"] == "function" and call["function"]["arguments"] == ""
                message["tool_calls"].append({"id": call["id"], "type": "function",
                                              "function": {"name": call["function"]["name"], "arguments": ""}})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                message["tool_calls"][call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        if (delta or {}).get("content"):
            message["content"] = (message["content"] or "") + delta["content"]
    return {"message": message, "finish_reason": reason}


def _without_ids(choice: dict) -> dict:
    calls = [{**c, "id": None} for c in choice["message"].get("tool_calls") or []]
    return {**choice, "message": {**choice["message"], "tool_calls": calls}}


def test_the_whole_response_has_the_calls_and_finish_reason_tool_calls():
    choice = ToolCallOutput(HermesParser()).choice(HERMES, "stop")
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "I will check."
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("function", "get_weather", '{"city": "Paris"}'), ("function", "now", "{}")]
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_the_stream_adds_up_to_the_whole_response(step):
    whole = ToolCallOutput(HermesParser()).choice(HERMES, "stop")
    stream = ToolCallOutput(HermesParser())
    chunks = [c for out in outputs([HERMES[i:i + step] for i in range(0, len(HERMES), step)])
              for c in stream.chunks(out)]
    assert chunks[-1] == (None, "tool_calls")
    assert _without_ids(accumulate(chunks)) == _without_ids(whole)


def test_text_without_calls_is_the_content_as_it_is():
    text = "  No tools needed: 2 < 3.\n"
    assert ToolCallOutput(HermesParser()).choice(text, "stop") == {
        "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    stream = ToolCallOutput(Llama3JsonParser())
    chunks = [c for out in outputs(list(text)) for c in stream.chunks(out)]
    assert accumulate(chunks) == {"message": {"role": "assistant", "content": text, "tool_calls": []},
                                  "finish_reason": "stop"}


def test_without_parallel_calls_only_the_first_call_is_kept():
    choice = ToolCallOutput(HermesParser(), parallel=False).choice(HERMES, "stop")
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    stream = ToolCallOutput(HermesParser(), parallel=False)
    chunks = [c for out in outputs(list(HERMES)) for c in stream.chunks(out)]
    assert [c["function"]["name"] for c in accumulate(chunks)["message"]["tool_calls"]] == ["get_weather"]


def test_a_call_cut_by_the_length_limit_keeps_finish_reason_length():
    choice = ToolCallOutput(HermesParser()).choice('<tool_call>{"name": "f", "arguments": {"a": ', "length")
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"][0]["function"]["name"] == "f"


def test_a_named_choice_streams_one_call_from_the_first_chunk():
    stream = ToolCallOutput(forced_parser({"type": "function", "function": {"name": "get_weather"}}), named=True)
    chunks = [c for out in outputs(['{"ci', 'ty": "Paris"}']) for c in stream.chunks(out)]
    first = chunks[0][0]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    message = accumulate(chunks)
    assert message["finish_reason"] == "stop"  # OpenAI's for a named function; auto and required: tool_calls
    assert message["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
