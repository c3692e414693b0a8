"""The schema that enforces ``tool_choice`` required / a named function, checked with ``jsonschema``."""

from __future__ import annotations

import jsonschema
import pytest

from cadenza.node.frontend.tool_choice import forced_parser, forced_schema, schema_text
from cadenza.node.frontend.tool_parsers import parse_whole

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                  "required": ["city"], "additionalProperties": False}}
CLOCK = {"name": "now"}  # no parameters: any object
TREE = {"name": "tree", "parameters": {
    "$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                       "additionalProperties": False}},
    "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"]}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def valid(schema: dict, instance) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_auto_and_none_force_nothing():
    assert forced_schema([WEATHER], "auto") is None
    assert forced_schema([WEATHER], "none") is None


def test_a_named_function_is_held_to_its_parameters():
    schema = forced_schema([WEATHER, CLOCK], NAMED)
    assert schema == WEATHER["parameters"]
    assert forced_schema([WEATHER, CLOCK], {"type": "function", "function": {"name": "now"}}) == {"type": "object"}


def test_a_named_function_that_is_not_a_tool_is_a_key_error():
    with pytest.raises(KeyError):
        forced_schema([WEATHER], {"type": "function", "function": {"name": "nope"}})


def test_required_is_a_non_empty_array_of_calls_of_the_tools():
    schema = forced_schema([WEATHER, CLOCK, TREE], "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    assert valid(schema, [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}])
    assert valid(schema, [{"name": "tree", "parameters": {"root": {"kids": [{"kids": []}]}}}])  # $defs still resolve
    assert not valid(schema, [])
    assert not valid(schema, [{"name": "get_weather", "parameters": {"town": "Paris"}}])
    assert not valid(schema, [{"name": "tree", "parameters": {"root": {"kids": [{"leaf": 1}]}}}])
    assert not valid(schema, [{"name": "other", "parameters": {}}])
    assert not valid(schema, [{"name": "now"}])


def test_required_without_parallel_calls_is_one_call():
    schema = forced_schema([WEATHER, CLOCK], "required", parallel_tool_calls=False)
    one = {"name": "now", "parameters": {}}
    assert valid(schema, [one]) and not valid(schema, [one, one])


def test_output_valid_for_the_schema_parses_into_those_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    content, calls = parse_whole(forced_parser("required"), text)
    assert content is None
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    content, calls = parse_whole(forced_parser(NAMED), '{"city": "Paris"}')
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_the_schema_text_is_compact_json():
    assert schema_text({"type": "object", "properties": {}}) == '{"type":"object","properties":{}}'


@pytest.mark.parametrize("choice", ["required", NAMED, {"type": "function", "function": {"name": "tree"}}])
def test_the_grammar_engine_compiles_the_forced_schemas(choice):
    llguidance = pytest.importorskip("llguidance")
    schema = forced_schema([WEATHER, CLOCK, TREE], choice)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
