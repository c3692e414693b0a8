"""The input processor: a validated API call becomes token ids and sampling parameters, checked
once, before anything reaches the engine core.

Checks, in order, each a clear :class:`InputError` naming the parameter: text that cannot fit
``max_model_len`` whatever it tokenizes to (refused before spending CPU on it), the chat template,
token ids outside the vocabulary, prompt + ``max_tokens`` over ``max_model_len``. Fields the
request leaves out take the model's ``generation_config.json`` defaults. Tokenizing runs in a
worker thread (a long prompt must not stall every other stream). The messages follow vLLM's and
OpenAI's wording for context-length errors. No torch here.
"""

from __future__ import annotations

import asyncio
import json
from functools import partial
from typing import Any

from cadenza.node.core.messages import EngineReady
from cadenza.node.core.request import SamplingParams
from cadenza.node.frontend.tokenizer import ChatTemplateError, Tokenizer
from cadenza.node.runner.models.generation import SamplingDefaults


class InputError(ValueError):
    """A request the front end refuses (HTTP ``status``; ``param``: the field at fault;
    ``code``: e.g. ``context_length_exceeded``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


class InputProcessor:
    """Tokenizes and checks requests for one engine.

    Args:
        tokenizer: the model's tokenizer.
        info: what the core reported at start (``max_model_len``, vocabulary size).
        defaults: the model's sampling defaults.
        special_tokens_as_text: special-token text in prompts and chat messages is encoded as plain
            text (``--text-special-tokens plain``; the chat template's markup stays control tokens).
    """

    def __init__(self, tokenizer: Tokenizer, info: EngineReady, defaults: SamplingDefaults,
                 special_tokens_as_text: bool = False) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.defaults = defaults
        self.special_tokens_as_text = special_tokens_as_text

    async def prompt(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's token ids (text is tokenized off the event loop).

        Raises:
            InputError: too long to ever fit, or token ids outside the vocabulary.
        """
        if isinstance(prompt, str):
            self.refuse_oversized_text(len(prompt), "prompt")
            return await asyncio.get_running_loop().run_in_executor(
                None, partial(self.tokenizer.encode, prompt, special_tokens_as_text=self.special_tokens_as_text))
        ids = list(prompt)
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise InputError(400, f"prompt: token ids must be in [0, {self.vocab_size})", param="prompt")
        return ids

    async def chat(self, messages: list[dict], **extra: Any) -> list[int]:
        """The token ids of ``messages`` rendered with the chat template; ``extra`` are further
        template variables (``tools``: :mod:`cadenza.node.frontend.tool_prompt`).

        Raises:
            InputError: too long to ever fit, or the template refused the messages.
        """
        chars = sum(len(m["content"]) + _calls_chars(m) for m in messages) + (len(json.dumps(extra)) if extra else 0)
        self.refuse_oversized_text(chars, "messages", markup_tokens=len(messages) * self.tokenizer.chat_markup_tokens)
        try:
            return await asyncio.get_running_loop().run_in_executor(
                None, partial(self.tokenizer.encode_chat, messages, special_tokens_as_text=self.special_tokens_as_text,
                              **extra))
        except ChatTemplateError as exc:
            raise InputError(400, f"messages: {exc}", param="messages") from None

    def refuse_oversized_text(self, num_chars: int, param: str, markup_tokens: int = 0) -> None:
        """Refuse text that cannot fit ``max_model_len`` whatever it tokenizes to, before spending
        CPU on rendering or tokenizing it: no token covers more than ``max_token_chars``
        characters (doubled for normalizers that compose characters), and a chat template adds
        at least ``markup_tokens``."""
        least = -(-num_chars // (self.tokenizer.max_token_chars * 2)) + markup_tokens
        if least > self.max_model_len:
            raise InputError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; a prompt of "
                f"{num_chars} characters in its content cannot fit it. Please reduce the length of the prompt.",
                param=param, code="context_length_exceeded",
            )

    def sampling(self, body, prompt_len: int, max_tokens: int | None, default_fill: bool) -> SamplingParams:
        """Sampling parameters of a validated request body, refusing a prompt or completion that
        cannot fit ``max_model_len``; fields left out take the model's defaults.

        Args:
            body: a validated completion or chat request (``temperature``, ``top_p``, ``top_k``,
                ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``top_logprobs_asked``,
                ``structured``).
            default_fill: without ``max_tokens``, fill the context (chat) instead of 16 tokens.

        Raises:
            InputError: 400 ``context_length_exceeded``.
        """
        room = self.max_model_len - prompt_len
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            asked = prompt_len + (max_tokens or 0)
            raise InputError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{asked} tokens ({prompt_len} in the prompt, {max_tokens or 0} for the completion). "
                "Please reduce the length of the prompt or completion.",
                param="max_tokens" if room > 0 else "prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = room if default_fill else min(16, room)
        defaults = self.defaults
        top_k = defaults.top_k if body.top_k is None else max(body.top_k, 0)  # -1 (vLLM) and 0: off
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.temperature if body.temperature is None else body.temperature,
            top_p=defaults.top_p if body.top_p is None else body.top_p,
            top_k=0 if top_k >= self.vocab_size else top_k,  # the whole vocabulary: the same as off
            seed=body.seed,
            stop=tuple(body.stop),
            # ids outside the vocabulary can never be sampled: they would stop nothing
            stop_token_ids=tuple(t for t in body.stop_token_ids if t < self.vocab_size),
            ignore_eos=body.ignore_eos,
            logprobs=body.top_logprobs_asked,
            structured=body.structured,
        )


def _calls_chars(message: dict) -> int:
    """Characters of a message's tool calls' names and arguments (text the template renders)."""
    return sum(len(c["function"]["name"]) + len(str(c["function"]["arguments"])) for c in message.get("tool_calls") or ())
