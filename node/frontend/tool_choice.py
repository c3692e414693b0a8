"""``tool_choice`` ``required`` and a named function: the JSON schema the grammar engine holds
the output to, and the parsers of that output.

OpenAI's ``tool_choice`` forces calls: ``{"type": "function", "function": {"name": "f"}}`` one
call of ``f``, ``"required"`` at least one call of any tool. Rather than hope the model writes its
own format, the request is constrained (:class:`~cadenza.node.core.request.StructuredOutput`,
``json_schema``) to output that parses by construction:

- a named function: the output *is* its arguments, valid against its ``parameters`` schema;
- ``required``: a JSON array (``minItems`` 1; ``maxItems`` 1 when ``parallel_tool_calls`` is
  false) of ``{"name": <const>, "parameters": <that tool's schema>}``, one ``anyOf`` branch per
  tool, which the server turns into one call each.

A tool without ``parameters`` takes ``{"type": "object"}``. A tool schema's local references
(``#/$defs/X``, ``#/definitions/X``, ``#``) are moved under the array schema's ``$defs`` with a
prefix per tool, so they still resolve once the schema is nested. vLLM does the same for
``required`` (its ``_get_json_schema_from_tool``); the array of name/parameters objects is its
shape too. Pure: no I/O, no engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cadenza.node.frontend.tool_parsers import Arguments, JsonCalls, ToolParser, new_call_id

ANY_OBJECT: dict = {"type": "object"}


def forced_schema(functions: Sequence[Mapping[str, Any]], tool_choice: str | Mapping[str, Any],
                  parallel_tool_calls: bool = True) -> dict | None:
    """The JSON schema that enforces ``tool_choice``, or None where nothing is forced.

    Args:
        functions: the request's tools' ``function`` objects (``name``, ``parameters``?), checked.
        tool_choice: ``"none"``, ``"auto"``, ``"required"`` or ``{"type": "function",
            "function": {"name": ...}}`` naming one of ``functions``.
        parallel_tool_calls: with ``required``, False allows exactly one call.

    Raises:
        KeyError: a named function that is not among ``functions``.
    """
    if isinstance(tool_choice, Mapping):
        name = tool_choice["function"]["name"]
        function = next((f for f in functions if f["name"] == name), None)
        if function is None:
            raise KeyError(name)
        return dict(function.get("parameters") or ANY_OBJECT)
    if tool_choice != "required":
        return None
    defs: dict[str, Any] = {}
    branches = []
    for i, function in enumerate(functions):
        parameters = _hoist_refs(function.get("parameters") or ANY_OBJECT, f"tool{i}", defs)
        branches.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _hoist_refs(schema: dict, prefix: str, defs: dict) -> dict:
    """``schema`` with its ``$defs``/``definitions`` moved into ``defs`` under ``prefix`` and its
    local ``$ref``s rewritten to match (``#`` itself: the schema, kept in ``defs`` as ``prefix``)."""
    uses_root = False

    def rewrite(node: Any) -> Any:
        nonlocal uses_root
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                if value == "#":
                    uses_root = True
                    value = f"#/$defs/{prefix}"
                else:
                    for head in ("#/$defs/", "#/definitions/"):
                        if value.startswith(head):
                            value = f"#/$defs/{prefix}_{value[len(head):]}"
                out[key] = value
            else:
                out[key] = rewrite(value)
        return out

    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    for key in ("$defs", "definitions"):
        for name, sub in (schema.get(key) or {}).items():
            defs[f"{prefix}_{name}"] = rewrite(sub)
    body = rewrite(body)
    if uses_root:
        defs[prefix] = body
    return body


class NamedCallParser(ToolParser):
    """The output of a named ``tool_choice``: the whole text is one call's arguments.

    Args:
        function: the function's name, given to the call.
    """

    name = "named"

    def __init__(self, function: str, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.function = function

    @staticmethod
    def format_call(name: str, arguments: dict | str) -> str:
        return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)

    def _step(self) -> bool:
        if not self.calls:  # the call starts with the output, named by the request
            self._start_call(self.function)
        if self.pos < len(self.text):  # every character is the arguments' JSON, passed on as it comes
            self._events.append(Arguments(0, self.text[self.pos:]))
            self.pos = len(self.text)
        return False


class RequiredCallsParser(JsonCalls):
    """The output of ``tool_choice: required``: ``[{"name": ..., "parameters": {...}}, ...]``."""

    name = "required"
    opener = "["
    separator = ","
    closer = "]"


def forced_parser(tool_choice: str | Mapping[str, Any], new_id: Callable[[], str] = new_call_id) -> ToolParser:
    """The parser of the output :func:`forced_schema` shapes for ``tool_choice``."""
    if isinstance(tool_choice, Mapping):
        return NamedCallParser(tool_choice["function"]["name"], new_id)
    return RequiredCallsParser(new_id)


def schema_text(schema: dict) -> str:
    """The schema as the compact JSON text a ``StructuredOutput`` carries (and caches by)."""
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"), sort_keys=False)
