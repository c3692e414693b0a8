"""Tool-call parsers: golden whole parses per format, and the stream cut at every boundary gives
the same content, names and arguments."""

from __future__ import annotations

import json
import time

import pytest

from cadenza.node.frontend.tool_choice import NamedCallParser, RequiredCallsParser
from cadenza.node.frontend.tool_parsers import (
    CallStart,
    HermesParser,
    Llama3JsonParser,
    collect,
    detect_tool_parser,
    parse_whole,
)

WEATHER = '{"city": "Paris \\"centre\\" {x}", "days": [1, 2], "unit": "°C"}'

# (parser, output text, content, [(name, arguments)])
GOLDEN = {
    "hermes-content-then-two-calls": (
        HermesParser,
        f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>',
        "Let me look.", [("get_weather", WEATHER), ("time", "{}")]),
    "hermes-plain-text-with-angle-brackets": (
        HermesParser, "a <b> c <tool_ d <tool_call", "a <b> c <tool_ d <tool_call", []),
    "hermes-keys-swapped": (
        HermesParser, '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [("f", '{"a": 1}')]),
    "hermes-arguments-as-a-string": (
        HermesParser, '<tool_call>{"arguments": "{\\"a\\": 1}", "name": "f"}</tool_call>', None, [("f", '{"a": 1}')]),
    "hermes-broken-block-is-content": (
        HermesParser, "x <tool_call>not json</tool_call> y", "x <tool_call>not json</tool_call> y", []),
    "hermes-cut-in-the-arguments": (
        HermesParser, '<tool_call>\n{"name": "f", "arguments": {"a": [1, ', None, [("f", '{"a": [1, ')]),
    "hermes-cut-in-the-header": (
        HermesParser, 'ok <tool_call>\n{"na', 'ok <tool_call>\n{"na', []),
    "hermes-type-key-and-parameters": (
        HermesParser, '<tool_call>{"type": "function", "name": "f", "parameters": {"q": "}"}}</tool_call>', None,
        [("f", '{"q": "}"}')]),
    "hermes-no-closing-tag-before-the-next-call": (
        HermesParser, '<tool_call>{"name": "f", "arguments": {}}<tool_call>{"name": "g", "arguments": {"b": 2}}',
        None, [("f", "{}"), ("g", '{"b": 2}')]),
    "llama3-python-tag-two-calls": (
        Llama3JsonParser,
        '<|python_tag|>{"name": "get_weather", "parameters": ' + WEATHER + '}; {"name": "time", "parameters": {}}',
        None, [("get_weather", WEATHER), ("time", "{}")]),
    "llama3-bare-json-call": (
        Llama3JsonParser, ' {"type": "function", "name": "f", "parameters": {"x": [{"y": "]"}]}}', None,
        [("f", '{"x": [{"y": "]"}]}')]),
    "llama3-plain-text": (Llama3JsonParser, "The weather is fine. {not a call}", "The weather is fine. {not a call}",
                          []),
    "llama3-json-that-is-not-a-call": (Llama3JsonParser, '{"result": 42}', '{"result": 42}', []),
    "llama3-text-after-the-calls": (
        Llama3JsonParser, '{"name": "f", "parameters": {}} and more', "and more", [("f", "{}")]),
    "required-two-calls": (
        RequiredCallsParser, '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', None,
        [("f", '{"a": 1}'), ("g", "{}")]),
    "required-not-an-array": (RequiredCallsParser, "no", "no", []),
    "required-cut-in-a-next-call": (
        RequiredCallsParser, '[{"name": "f", "parameters": {}}, {"na', None, [("f", "{}")]),
    # a lone surrogate escape cannot be UTF-8: such a name is no call, such arguments stay escaped
    "hermes-lone-surrogate-name-is-content": (
        HermesParser, '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>', []),
    "hermes-lone-surrogate-name-after-arguments-is-content": (
        HermesParser, '<tool_call>{"arguments": {}, "name": "f\\udfff"}</tool_call>',
        '<tool_call>{"arguments": {}, "name": "f\\udfff"}</tool_call>', []),
    "hermes-lone-surrogate-in-reordered-arguments-stays-escaped": (
        HermesParser, '<tool_call>{"arguments": {"x": "\\ud800é"}, "name": "f"}</tool_call>', None,
        [("f", '{"x": "\\ud800\\u00e9"}')]),
    # a header past MAX_HEADER_CHARS is not read as it streams: a closed block is still parsed whole
    "hermes-overlong-header-is-parsed-once-closed": (
        HermesParser, '<tool_call>{"name": "' + "n" * 1100 + '", "arguments": {"a": 1}}</tool_call>', None,
        [("n" * 1100, '{"a": 1}')]),
    "llama3-overlong-header-is-content": (
        Llama3JsonParser, '{"name": "' + "n" * 1100 + '", "parameters": {}}',
        '{"name": "' + "n" * 1100 + '", "parameters": {}}', []),
    "llama3-lone-surrogate-name-is-content": (
        Llama3JsonParser, '{"name": "\\ud83d", "parameters": {}}', '{"name": "\\ud83d", "parameters": {}}', []),
}


@pytest.mark.parametrize("case", list(GOLDEN))
def test_whole_parse_gives_the_golden_content_and_calls(case):
    parser, text, content, calls = GOLDEN[case]
    got_content, got_calls = parse_whole(parser(), text)
    assert got_content == content
    assert [(c["name"], c["arguments"]) for c in got_calls] == calls
    assert all(c["id"].startswith("call_") for c in got_calls)
    if not case.endswith("cut-in-the-arguments"):
        assert all(isinstance(json.loads(arguments), dict) for _name, arguments in calls)


@pytest.mark.parametrize("case", list(GOLDEN))
def test_every_parse_is_text_a_response_can_carry(case):
    parser, text, _content, _calls = GOLDEN[case]
    json.dumps(parse_whole(parser(), text), ensure_ascii=False).encode()  # no lone surrogate: no 500


@pytest.mark.parametrize("parser, opening, filler", [
    (HermesParser, '<tool_call>{"name": "', "x"), (HermesParser, '<tool_call>{"name": "f", "arguments": "', "x"),
    (HermesParser, '<tool_call>{"name": "f", "arguments": {}} ', "x"), (Llama3JsonParser, '{"name": "', "x"),
    (HermesParser, "", " \n"), (Llama3JsonParser, "", " \n"), (RequiredCallsParser, "", " \n"),
    (Llama3JsonParser, '{"name": "f", "parameters": {}}', " "), (Llama3JsonParser, '{"name": "f", "parameters": {}};', " ")])
def test_an_endless_output_streams_in_linear_time(parser, opening, filler):
    """A model that never closes a name, a string or a block, or writes only whitespace, costs
    each delta about its own length (rescans from the block's start or over held whitespace made
    40k characters take 11-14 s, blocking the server's event loop)."""
    text = opening + filler * (200_000 // len(filler))
    p, start = parser(), time.perf_counter()
    for i in range(0, len(text), 4):
        p.feed(text[i:i + 4])
    p.finish()
    assert time.perf_counter() - start < 10  # ~0.3 s; quadratic: minutes


def _stream(parser, pieces: list[str]) -> list:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


@pytest.mark.parametrize("case", list(GOLDEN))
def test_a_stream_cut_anywhere_adds_up_to_the_whole_parse(case):
    parser, text, _content, _calls = GOLDEN[case]
    whole = collect(_stream(parser(), [text]))
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        events = _stream(parser(), pieces)
        content, calls = collect(events)
        assert content == whole[0], pieces
        assert [(c["name"], c["arguments"]) for c in calls] == [(c["name"], c["arguments"]) for c in whole[1]], pieces
        starts = [e for e in events if isinstance(e, CallStart)]
        assert [e.index for e in starts] == list(range(len(calls)))  # each name once, indices in order
        assert len({e.id for e in starts}) == len(starts)


def test_content_streams_before_the_output_ends():
    parser = HermesParser()
    assert collect(parser.feed("Hello there, <tool"))[0] == "Hello there,"  # "<tool" held; trailing blank held
    assert collect(parser.feed("box> more"))[0] == " <toolbox> more"


def test_arguments_stream_as_they_arrive():
    parser = HermesParser()
    events = parser.feed('<tool_call>{"name": "f", "arguments": {"city": "Pa')
    assert isinstance(events[0], CallStart) and events[0].name == "f"
    assert events[1].text == '{"city": "Pa'
    assert parser.feed('ris"}}</tool_call>')[0].text == 'ris"}'


def test_named_choice_output_is_one_call_of_that_function():
    parser = NamedCallParser("get_weather", new_id=lambda: "call_1")
    events = parser.feed('{"city"') + parser.feed(': "Paris"}') + parser.finish()
    assert collect(events) == (None, [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}])


@pytest.mark.parametrize("template, parser", [
    ("{% for m in messages %}<tool_call>{% endfor %}", "hermes"),
    ("{{ '<|python_tag|>' }}{% if m.role == 'ipython' %}{% endif %}", "llama3_json"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
    (None, "hermes"),
])
def test_the_parser_is_chosen_from_the_chat_template(template, parser):
    assert detect_tool_parser(template) == parser
