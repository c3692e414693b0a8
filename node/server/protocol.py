"""Request bodies of the OpenAI-compatible API, validated with pydantic.

Follows the OpenAI API reference for ``/v1/completions`` and ``/v1/chat/completions`` plus the
vLLM extensions ``top_k``, ``stop_token_ids`` and ``ignore_eos``. Unknown fields are ignored (as
vLLM does), so clients that send extra options keep working; options cadenza cannot honour
(``n > 1``, ``logprobs``, ``echo``, penalties) are refused with a 400 rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from cadenza.node.server.errors import APIError

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
MaxTokens = Annotated[StrictInt, Field(ge=1)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: StrictInt | None = Field(default=None, ge=-1)
    seed: StrictInt | None = None
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def check_supported(self) -> None:
        """Refuse options that are valid OpenAI but not implemented here (400)."""
        if self.n != 1:
            raise APIError(400, "n: only n=1 is supported", param="n")
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs: not supported", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise APIError(400, f"{name}: not supported (only 0)", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: MaxTokens | None = 16
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            v = v[0]
        if len(v) == 0:
            raise ValueError("must not be empty")
        return v

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo: not supported", param="echo")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


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
        err = min(exc.errors(), key=lambda e: len(e["loc"]))
        loc = [str(part) for part in err["loc"] if not _is_type_tag(part)]
        param = ".".join(loc) or None
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            message = "field required"
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None


def _is_type_tag(part: Any) -> bool:
    """pydantic puts union member names (``str``, ``list[int]``) in error locations; drop them."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))
