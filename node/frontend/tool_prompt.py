"""Tools and tool messages as a chat template gets them.

A template that reads ``tools`` (Llama 3.1+, Qwen2.5, Hermes...) renders them itself, as
``transformers``' ``apply_chat_template(messages, tools=...)`` lets it: it gets the tools, the
assistant messages' ``tool_calls`` and the ``tool`` messages' ``tool_call_id`` as they are, except
that arguments a client sent as a JSON string (OpenAI's form) are parsed into the object templates
expect (``tool_call.arguments | tojson``), as vLLM does.

A template that does not (SmolLM2's) gets plain messages instead, in the convention of Hermes
and Qwen: the tools as JSON schemas inside ``<tools></tools>`` in the system message, followed by
how to answer (the chosen parser's :attr:`~cadenza.node.frontend.tool_parsers.ToolParser.instructions`,
``<tool_call>`` blocks for ``hermes``); earlier calls written into their assistant message in that
format; each run of ``tool`` messages as one ``user`` message of ``<tool_response>`` blocks (a
template without tools may refuse the ``tool`` role or require roles to alternate). The default
system prompt of such a template is replaced by the tools' one when the conversation brings none.
Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from cadenza.node.frontend.tool_parsers import ToolParser

MAX_JSON_DEPTH = 64  # nesting of a tool's schema or a call's arguments rendered as objects

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to answer. Their signatures, as JSON schemas:\n<tools>\n"
)


def template_inputs(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                    native: bool, parser: type[ToolParser]) -> tuple[list[dict], dict[str, Any]]:
    """The messages and extra template variables that render ``messages`` and ``tools``.

    Args:
        messages: ``{"role", "content", "name"?, "tool_calls"?, "tool_call_id"?}`` dicts, each
            call ``{"id", "type", "function": {"name", "arguments"}}`` with arguments as JSON text.
        tools: the tools to render (OpenAI's ``{"type": "function", "function": {...}}``), or
            None to render none (``tool_choice: none``, or a request without tools).
        native: the template reads ``tools`` (renders tools and calls itself).
        parser: the format calls are written in when the template does not.

    Returns:
        ``(messages, extra)``: ``extra`` holds ``tools`` for a native template that gets some.
    """
    if native:
        return [_native(m) for m in messages], ({"tools": [dict(t) for t in tools]} if tools else {})
    out: list[dict] = []
    responses = False  # out[-1] is a run of tool responses
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        m.pop("tool_call_id", None)
        if m["role"] == "tool":
            response = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if responses:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            responses = True
            continue
        responses = False
        if calls:
            written = "\n".join(parser.format_call(c["function"]["name"], _arguments(c["function"]["arguments"]))
                                for c in calls)
            m["content"] = f"{m['content']}\n{written}" if m.get("content") else written
        out.append(m)
    if tools:
        prompt = TOOLS_PREAMBLE + "\n".join(json.dumps(dict(t), ensure_ascii=False) for t in tools)
        prompt += "\n</tools>\n\n" + parser.instructions
        if out and out[0]["role"] in ("system", "developer"):
            first = out[0].get("content")
            out[0] = {**out[0], "content": f"{first}\n\n{prompt}" if first else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _native(message: Mapping[str, Any]) -> dict:
    m = dict(message)
    if m.get("tool_calls"):
        m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
                           for c in m["tool_calls"]]
    return m


def _arguments(text: str) -> dict | str:
    """A call's arguments as the object templates expect; text that is not a JSON object (or
    nests deeper than ``MAX_JSON_DEPTH``) stays text."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) and json_depth(value) <= MAX_JSON_DEPTH else text


def json_depth(value: Any) -> int:
    """How deep JSON data nests (a scalar: 0, ``{}``: 1), level by level, without recursion."""
    depth, level = 0, [value]
    while True:
        containers = [node for node in level if isinstance(node, (dict, list))]
        if not containers:
            return depth
        depth += 1
        level = [v for node in containers for v in (node.values() if isinstance(node, dict) else node)]
