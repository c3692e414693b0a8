"""Tool calling in ``/v1/chat/completions``: what a request's tools change in the prompt and the
sampling, and the response's ``tool_calls``, whole or streamed.

:func:`prepare` reads a validated request once: the messages and template variables that render
its tools (:mod:`cadenza.node.frontend.tool_prompt`), the grammar that enforces ``tool_choice``
``required`` or a named function (:mod:`cadenza.node.frontend.tool_choice`), and — unless
``tool_choice`` is ``none`` — a :class:`ToolCallOutput` that turns the output text into OpenAI's
shapes with the model's format parser (:mod:`cadenza.node.frontend.tool_parsers`: chosen from the
chat template, or ``cadenza serve --tool-parser``).

OpenAI's shapes: a message ``{"role": "assistant", "content": null, "tool_calls": [{"id",
"type": "function", "function": {"name", "arguments"}}]}`` (content only where the model wrote
some); streamed, a call's first delta ``{"tool_calls": [{"index", "id", "type": "function",
"function": {"name", "arguments": ""}}]}``, then ``{"tool_calls": [{"index", "function":
{"arguments": <fragment>}}]}``; ``finish_reason`` ``tool_calls`` where a call was made and the
output stopped by itself (``stop`` for a function ``tool_choice`` named, as OpenAI's). With ``parallel_tool_calls: false`` calls after the first are dropped
(``required`` is held to one by its grammar).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache, partial
from typing import Any, NamedTuple

from cadenza.node.core.request import StructuredOutput
from cadenza.node.frontend.tokenizer import ChatTemplateError, chat_template_variables
from cadenza.node.frontend.tool_choice import forced_parser, forced_schema, schema_text
from cadenza.node.frontend.tool_parsers import (TOOL_PARSERS, Arguments, CallStart, Content, Event, ToolParser,
                                                collect, detect_tool_parser)
from cadenza.node.frontend.tool_prompt import template_inputs

AUTO = "auto"  # --tool-parser: from the chat template


class ToolRequest(NamedTuple):
    """What a chat request's tools mean for its prompt, sampling and response."""

    messages: list[dict]  # for the chat template
    template_extra: dict[str, Any]  # further template variables (``tools``)
    structured: StructuredOutput | None  # the grammar that forces tool_choice, if any
    output: Callable[[], ToolCallOutput] | None  # makes one per choice; None: a plain chat answer


def prepare(body, chat_template: str | None, tool_parser: str = AUTO) -> ToolRequest:
    """Read a validated :class:`~cadenza.node.server.protocol.ChatCompletionRequest`'s tools.

    Args:
        body: the request (``messages``, ``tools``, ``tool_choice_value``, ``parallel_tool_calls``).
        chat_template: the model's chat template source (None: it has none).
        tool_parser: the format of the model's calls, or ``auto`` (from the template).
    """
    name = detect_tool_parser(chat_template) if tool_parser == AUTO else tool_parser
    parser = TOOL_PARSERS[name]
    choice = body.tool_choice_value
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    messages = [m.template_dict() for m in body.messages]
    messages, extra = template_inputs(messages, tools if choice != "none" else None, _reads_tools(chat_template),
                                      parser)
    if choice == "none":
        return ToolRequest(messages, extra, None, None)
    schema = forced_schema([t["function"] for t in tools], choice, body.parallel_tool_calls)
    structured = StructuredOutput("json_schema", schema_text(schema)) if schema is not None else None
    new_parser = partial(forced_parser, choice) if schema is not None else parser
    parallel = body.parallel_tool_calls
    named = isinstance(choice, dict)  # a forced function: OpenAI ends it as ``stop``, not ``tool_calls``
    return ToolRequest(messages, extra, structured, lambda: ToolCallOutput(new_parser(), parallel, named))


@lru_cache(maxsize=16)
def _reads_tools(chat_template: str | None) -> bool:
    """Whether the template renders tools itself (it reads the variable ``tools``)."""
    if chat_template is None:
        return False
    try:
        return "tools" in chat_template_variables(chat_template)
    except ChatTemplateError:
        return False


class ToolCallOutput:
    """One choice's output through a tool parser, as OpenAI's message or stream deltas.

    Args:
        parser: a fresh parser of the output's format.
        parallel: more than one call may be made (``parallel_tool_calls``).
        named: ``tool_choice`` named the function. OpenAI then reports ``finish_reason: stop``,
            where calls the model chose (``auto``, ``required``) end as ``tool_calls`` (vLLM
            aligned with it in #25054).
    """

    def __init__(self, parser: ToolParser, parallel: bool = True, named: bool = False) -> None:
        self.parser = parser
        self.parallel = parallel
        self.named = named
        self.made_calls = False

    def chunks(self, output) -> list[tuple[dict | None, str | None]]:
        """The ``(delta, finish_reason)`` of each chunk a stream sends for ``output`` (a
        :class:`~cadenza.node.frontend.output_processor.RequestOutput`); the last, once it has
        finished, carries the finish reason alone."""
        events = self.parser.feed(output.text)
        if output.finished:
            events += self.parser.finish()
        out: list[tuple[dict | None, str | None]] = [(delta, None) for delta in self._deltas(events)]
        if output.finished:
            out.append((None, self.finish_reason(output.finish_reason)))
        return out

    def choice(self, text: str, finish_reason: str | None) -> dict:
        """A non-streamed choice's ``message`` and ``finish_reason`` for the whole output ``text``."""
        content, calls = collect(self._kept([*self.parser.feed(text), *self.parser.finish()]))
        message: dict[str, Any] = {"role": "assistant", "content": content if calls else (content or "")}
        if calls:
            self.made_calls = True
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        return {"message": message, "finish_reason": self.finish_reason(finish_reason)}

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.made_calls and not self.named else reason

    def _kept(self, events: list[Event]) -> list[Event]:
        if self.parallel:
            return events
        return [e for e in events if isinstance(e, Content) or e.index == 0]

    def _deltas(self, events: list[Event]) -> list[dict]:
        """Events as chat deltas: content runs and one call's argument runs merged."""
        deltas: list[dict] = []
        for event in self._kept(events):
            last = deltas[-1] if deltas else {}
            if isinstance(event, Content):
                if "content" in last:
                    last["content"] += event.text
                else:
                    deltas.append({"content": event.text})
            elif isinstance(event, CallStart):
                self.made_calls = True
                deltas.append({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                               "function": {"name": event.name, "arguments": ""}}]})
            elif isinstance(event, Arguments):
                call = _only_call(last)
                if call is not None and call["index"] == event.index and "id" not in call:
                    call["function"]["arguments"] += event.text
                else:
                    deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
        return deltas


def _only_call(delta: Mapping[str, Any]) -> dict | None:
    calls = delta.get("tool_calls")
    return calls[0] if calls else None
