"""The request side of OpenAI tool calling: chat ``tools``, the calls of earlier assistant
messages, and the rules ``tool_choice`` follows, validated with pydantic.

OpenAI's API reference: a tool is ``{"type": "function", "function": {"name", "description"?,
"parameters"?, "strict"?}}``; a request has at most ``MAX_TOOLS`` of them, with unique names of
``FUNCTION_NAME``'s pattern and ``parameters`` a valid JSON schema (nesting at most
``MAX_JSON_DEPTH`` levels: the checks recurse); ``tool_choice`` is ``none``, ``auto``,
``required`` or ``{"type": "function", "function": {"name"}}`` naming one of them, and only
with tools. An assistant message carries at most ``MAX_TOOL_CALLS`` calls.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator

from cadenza.node.frontend.tool_prompt import MAX_JSON_DEPTH, json_depth
from cadenza.node.http.errors import APIError
from cadenza.node.server.utf8 import check_utf8, check_utf8_json

MAX_TOOLS = 128  # OpenAI's bound on a request's tools
MAX_TOOL_CALLS = 128  # calls in one assistant message
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name
TOOL_CHOICES = ("none", "auto", "required")


class FunctionDefinition(BaseModel):
    """A tool's function: its name, what it does, and its arguments' JSON schema."""

    model_config = ConfigDict(extra="ignore")

    name: Annotated[StrictStr, Field(pattern=FUNCTION_NAME)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("description")
    @classmethod
    def _utf8_description(cls, v: str | None) -> str | None:
        return v if v is None else check_utf8(v, "the description")

    @field_validator("parameters")
    @classmethod
    def _a_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            check_utf8_json(v, "the schema")
            if json_depth(v) > MAX_JSON_DEPTH:
                raise ValueError(f"a schema may nest at most {MAX_JSON_DEPTH} levels deep")
            try:
                jsonschema.validators.validator_for(v).check_schema(v)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"not a valid JSON schema: {exc.message}") from None
        return v


class Tool(BaseModel):
    """``{"type": "function", "function": {...}}``, the one kind of tool OpenAI's chat API has."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class ToolCallFunction(BaseModel):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it

    @field_validator("name", "arguments")
    @classmethod
    def _utf8(cls, v: str) -> str:
        return check_utf8(v, "the text")


class MessageToolCall(BaseModel):
    """A call an earlier assistant message made (``tool_calls`` of the conversation)."""

    model_config = ConfigDict(extra="ignore")

    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction

    @field_validator("id")
    @classmethod
    def _utf8(cls, v: str) -> str:
        return check_utf8(v, "the call id")


def check_tools(tools: list[Tool] | None, choice: Any) -> None:
    """Refuse duplicate tool names and a ``tool_choice`` that is malformed, given without tools
    or naming a function that is not one of them.

    Raises:
    APIError: 400 naming ``tools`` or ``tool_choice``.
    """
    names = [tool.function.name for tool in tools or ()]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"tools: function names must be unique; {duplicate!r} is given twice", param="tools")
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise APIError(400, f"tool_choice: must be one of {', '.join(TOOL_CHOICES)} or "
                           f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}', param="tool_choice")
    elif not (isinstance(choice, dict) and choice.get("type") == "function"
              and isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str)):
        raise APIError(400, 'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}',
                       param="tool_choice")
    if not tools:
        raise APIError(400, "tool_choice: only allowed when tools are given", param="tool_choice")
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        raise APIError(400, f"tool_choice: the function {choice['function']['name']!r} is not among the tools",
                       param="tool_choice")
