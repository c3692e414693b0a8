"""The choices of one response (OpenAI ``n``): each choice's text, finish and logprobs, and usage.

A call of ``n`` choices streams the outputs of its ``n`` sequences interleaved, each tagged with
its choice's ``index`` (:class:`~cadenza.node.frontend.output_processor.RequestOutput`). This
gathers them: per choice the text (non-streamed), the finish reason and the choice's own
``logprobs`` builder; for the call, ``usage`` with the prompt counted once and the completion
tokens summed over the choices. A choice that finishes early leaves the others running.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Choice:
    """One choice as it is gathered: ``logprobs`` is its builder (None when not asked)."""

    index: int
    logprobs: Any = None
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    started: bool = False  # a chunk of it was sent (streams: the chat role goes first)


class Choices:
    """The ``n`` choices of one call.

    Args:
        n: how many choices.
        logprobs: builds a choice's logprobs builder (``None``: none asked).
    """

    def __init__(self, n: int, logprobs: Callable[[], Any] | None = None) -> None:
        self.items = [Choice(i, None if logprobs is None else logprobs()) for i in range(n)]
        self.num_prompt_tokens = 0
        self.any_output = False

    def add(self, output) -> Choice:
        """Account one output (a :class:`RequestOutput`) to its choice; that choice."""
        choice = self.items[output.index]
        self.any_output = True
        self.num_prompt_tokens = output.num_prompt_tokens
        choice.num_output_tokens = output.num_output_tokens
        if output.finish_reason is not None:
            choice.finish_reason = output.finish_reason
        if choice.logprobs is not None:
            choice.logprobs.add(output)
        return choice

    def gather(self, output) -> None:
        """:meth:`add`, keeping the text (a non-streamed response)."""
        self.add(output).text.append(output.text)

    def response(self, chat: bool) -> list[dict]:
        """The ``choices`` of a non-streamed response, by index."""
        out = []
        for c in self.items:
            choice: dict = {"index": c.index, "logprobs": c.logprobs and c.logprobs.take(whole=True),
                            "finish_reason": c.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(c.text)}
            else:
                choice["text"] = "".join(c.text)
            out.append(choice)
        return out

    def usage(self) -> dict:
        """OpenAI ``usage``: the prompt once, the completion tokens of every choice."""
        p = self.num_prompt_tokens
        c = sum(choice.num_output_tokens for choice in self.items)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    @property
    def tokens(self) -> str:
        """``prompt+completion`` tokens, for the access log."""
        usage = self.usage()
        return f"{usage['prompt_tokens']}+{usage['completion_tokens']}"
