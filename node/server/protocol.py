"""Request bodies of the OpenAI-compatible API, validated with pydantic.

Follows the OpenAI API reference for ``/v1/completions`` and ``/v1/chat/completions`` plus the
vLLM extensions ``top_k``, ``stop_token_ids``, ``ignore_eos`` and ``cache_salt``. A field sent as
``null`` takes its default, as the reference allows; sampling fields left out take the model's
``generation_config.json`` defaults (as vLLM does), so they are None here until the server fills
them in.

Sizes are bounded so that no request shape can cost the engine or the event loop more than its
tokens do: at most ``MAX_STOP_STRINGS`` stop strings (OpenAI allows 4) of at most
``MAX_STOP_STRING_CHARS`` characters, ``MAX_STOP_TOKEN_IDS`` stop token ids, ``MAX_MESSAGES``
messages (OpenAI's limit) with ``MAX_CONTENT_PARTS`` content parts in all; :func:`check_sizes` checks the
counts on the raw JSON, before anything is validated item by item. Unknown fields are ignored (as vLLM does), so clients that
send extra metadata keep working; options cadenza cannot honour — ``n`` above ``MAX_N``,
``best_of`` other than 1 or ``n``, ``echo``, ``suffix``, penalties, ``logit_bias`` — are refused
with a 400 rather than silently ignored. ``logprobs`` are served in OpenAI's shapes: chat
``logprobs: true`` with ``top_logprobs`` 0 to 20, completions ``logprobs`` 0 to 5 (each request's
``top_logprobs_asked``). ``response_format`` (OpenAI's structured outputs: ``text``,
``json_object``, ``json_schema``) is accepted on both endpoints, as vLLM does; the schema is
always enforced, ``strict`` or not. Chat ``tools`` (at most ``MAX_TOOLS`` functions, unique names
of OpenAI's pattern, ``parameters`` a valid JSON schema), ``tool_choice`` and
``parallel_tool_calls`` follow OpenAI's reference, as do assistant ``tool_calls`` (at most
``MAX_TOOL_CALLS`` per message) and ``tool`` messages with their ``tool_call_id``
(:mod:`.tool_protocol`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from cadenza.node.core.request import MAX_LOGPROBS, MAX_N, StructuredOutput
from cadenza.node.http.errors import APIError
from cadenza.node.server.tool_protocol import MAX_TOOL_CALLS, MAX_TOOLS, MessageToolCall, Tool, check_tools
from cadenza.node.server.utf8 import check_utf8 as _utf8

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 4 * MAX_MESSAGES
MAX_CACHE_SALT_CHARS = 256
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for /v1/completions (chat's top_logprobs: MAX_LOGPROBS)

Temperature = Annotated[float, Field(strict=True, ge=0.0, le=2.0)]
TopP = Annotated[float, Field(strict=True, gt=0.0, le=1.0)]
MaxTokens = Annotated[StrictInt, Field(ge=1)]
Seed = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]
Penalty = Annotated[float, Field(strict=True)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema (``name`` as OpenAI restricts it)."""

    model_config = ConfigDict(extra="ignore")

    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``{"type": "text" | "json_object" | "json_schema", "json_schema": ...}``."""

    model_config = ConfigDict(extra="ignore")

    type: StrictStr
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _known_type(self) -> "ResponseFormat":
        if self.type not in ("text", "json_object", "json_schema"):
            raise ValueError(f"type must be one of text, json_object, json_schema, got {self.type!r}")
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object with a name and a schema")
        return self

    def structured(self) -> StructuredOutput | None:
        """The constraint the engine enforces; None for free text."""
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.type == "json_schema":
            return StructuredOutput("json_schema", json.dumps(self.json_schema.schema_))  # key order: output order
        return None


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr = Field(min_length=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: StrictInt | None = Field(default=None, ge=-1)
    seed: Seed | None = None
    stop: StrictStr | list[StrictStr] = Field(default_factory=list)
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] = Field(default_factory=list,
                                                                    max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: StrictBool = False
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    logprobs: Any = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str]) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters")
        return [_utf8(s, "a stop string") for s in stops]

    def check_supported(self) -> None:
        """Refuse options that are valid OpenAI but not implemented here (400)."""
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n: must be an integer from 1 to {MAX_N}, got {self.n}", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise APIError(400, f"{name}: not supported (only 0)", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias: not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def structured(self) -> StructuredOutput | None:
        """The output constraint ``response_format`` asks for (None: free text)."""
        return None if self.response_format is None else self.response_format.structured()


class CompletionRequest(_Common):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: MaxTokens | None = 16
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            v = v[0]
        if len(v) == 0:
            raise ValueError("must not be empty")
        return _utf8(v, "the prompt") if isinstance(v, str) else v

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS):
            raise APIError(400, f"logprobs: must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}, got "
                           f"{self.logprobs!r}", param="logprobs")
        if self.echo:
            raise APIError(400, "echo: not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix: not supported", param="suffix")
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of: only 1 or n is supported", param="best_of")

    @property
    def top_logprobs_asked(self) -> int | None:
        """How many most likely tokens to report with each token's logprob (None: no logprobs)."""
        return self.logprobs


class ContentPart(BaseModel):
    """A part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    model_config = ConfigDict(extra="allow")

    type: StrictStr
    text: StrictStr | None = None

    @model_validator(mode="after")
    def _text_only(self) -> "ContentPart":
        if self.type != "text":
            raise ValueError(f"content part type {self.type!r} is not supported (this model reads text only)")
        if self.text is None:
            raise ValueError("a text part needs a 'text' string")
        _utf8(self.text, "the message content")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS)
    tool_call_id: StrictStr | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message makes tool calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message needs the id of the call it answers")
        return self

    @field_validator("name", "tool_call_id")
    @classmethod
    def _utf8_text(cls, v: str | None) -> str | None:
        return v if v is None else _utf8(v, "the text")

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        roles = ("system", "developer", "user", "assistant", "tool")
        if v not in roles:
            raise ValueError(f"must be one of {', '.join(roles)}, got {v!r}")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (str, list)):
            raise ValueError("must be a string or a list of content parts")
        if isinstance(v, str):
            _utf8(v, "the message content")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it: content as text (``""`` for null), and
        ``name``, ``tool_calls`` and ``tool_call_id`` where given."""
        m: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            m["name"] = self.name
        if self.tool_calls:
            m["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Any = None  # checked by check_supported, for errors that name it plainly
    parallel_tool_calls: StrictBool = True

    @property
    def top_logprobs_asked(self) -> int | None:
        """How many most likely tokens to report with each token's logprob (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise APIError(400, f"logprobs: must be true or false, got {self.logprobs!r}", param="logprobs")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs: must be an integer from 0 to {MAX_LOGPROBS}, got "
                               f"{self.top_logprobs}", param="top_logprobs")
            if not self.logprobs:
                raise APIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
        check_tools(self.tools, self.tool_choice)

    @property
    def tool_choice_value(self) -> str | dict:
        """``tool_choice`` with OpenAI's default: ``auto`` with tools, ``none`` without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


def check_sizes(body: dict, max_model_len: int) -> None:
    """Refuse, from the raw JSON and in O(messages), what is too large before it is validated.

    Raises:
        APIError: 400 for more than ``MAX_MESSAGES`` messages, ``MAX_CONTENT_PARTS`` content
            parts, ``MAX_STOP_STRINGS`` stop strings, ``MAX_STOP_TOKEN_IDS`` stop token ids or
            ``MAX_TOOLS`` tools, and for a prompt of token ids longer than ``max_model_len``
            (``context_length_exceeded``).
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        if len(messages) > MAX_MESSAGES:
            raise APIError(400, f"messages: at most {MAX_MESSAGES} messages, got {len(messages)}", param="messages")
        parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
        if parts > MAX_CONTENT_PARTS:
            raise APIError(400, f"messages: at most {MAX_CONTENT_PARTS} content parts in all, got {parts}",
                           param="messages")
    for field, limit in (("stop", MAX_STOP_STRINGS), ("stop_token_ids", MAX_STOP_TOKEN_IDS), ("tools", MAX_TOOLS)):
        value = body.get(field)
        if isinstance(value, list) and len(value) > limit:
            raise APIError(400, f"{field}: at most {limit} items, got {len(value)}", param=field)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        ids = prompt[0] if len(prompt) == 1 and isinstance(prompt[0], list) else prompt
        if len(ids) > max_model_len and all(isinstance(t, int) for t in ids[:1]):
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                           f"{len(ids)} token ids. Please reduce the length of the prompt.",
                           param="prompt", code="context_length_exceeded")


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body; the first problem becomes a 400 naming the field.

    Raises:
        APIError: 400 with ``param`` set to the offending field.
    """
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # Our own checks (value errors) say the most; else the shallowest error.
        err = min(exc.errors(), key=lambda e: (e["type"] != "value_error", len(e["loc"])))
        loc = [str(part) for part in err["loc"] if not _is_type_tag(part)]
        param = ".".join(loc) or None
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            message = "field required"
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None


def _is_type_tag(part: Any) -> bool:
    """pydantic puts union member names (``str``, ``list[int]``) in error locations; drop them."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "ContentPart"))
