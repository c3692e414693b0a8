"""Tool calls in a model's output text, one parser per format, whole or as the text streams.

A parser is fed the output's text deltas (:meth:`ToolParser.feed`) and told when it ends
(:meth:`ToolParser.finish`); each call returns events: :class:`Content` (text outside any call),
:class:`CallStart` (a call's index, id and function name: once per call) and :class:`Arguments`
(the next fragment of a call's arguments, a JSON text). The arguments are the model's own text of
the JSON object, passed through as it arrives, so the fragments streamed add up to exactly what a
whole parse gives — the whole parse *is* the stream fed in one piece (:func:`parse_whole`), and
nothing depends on where the text was cut. Text that could still begin a call is held back until
it is ruled out; whitespace next to a call is dropped.

Formats:

- ``hermes`` (Hermes, Qwen2.5, Qwen3 and the fallback prompt of templates without tools):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number of blocks, with
  content around them. A block whose object does not start with its name is parsed once it is
  closed (``json.loads``); one that does not parse is content.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the output is calls only,
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), several separated
  by ``;``; an output that does not start like one is content.

Both accept ``arguments`` or ``parameters`` and a ``"type": "function"`` key before them. The
outputs of ``tool_choice`` ``required`` and a named function, which the grammar engine shapes,
have their own parsers (:mod:`cadenza.node.frontend.tool_choice`), built on :class:`JsonCalls`.
Pure: no I/O, no engine.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

from cadenza.node.frontend.partial_json import BAD, NEED, WHITESPACE, ObjectEnd, held_prefix, read_call_header, skip_ws


class Content(NamedTuple):
    """Text outside any tool call."""

    text: str


class CallStart(NamedTuple):
    """A tool call begins: ``index`` counts calls from 0 in the output, ``id`` is ``call_<random>``."""

    index: int
    id: str
    name: str


class Arguments(NamedTuple):
    """The next fragment of call ``index``'s arguments (JSON text; the fragments concatenate)."""

    index: int
    text: str


Event = Content | CallStart | Arguments


def new_call_id() -> str:
    """A tool call id as OpenAI writes them: ``call_`` and 24 random characters."""
    return "call_" + secrets.token_hex(12)


# -- parsers --------------------------------------------------------------------------------------


class ToolParser(ABC):
    """The base of every format: the text so far, a position in it, events out.

    Subclasses implement :meth:`_step` and :meth:`format_call` (for history messages of templates
    that render no tools). Whitespace-only content is held and dropped next to a call.

    Args:
        new_id: makes call ids (default :func:`new_call_id`; tests pass a counter).
    """

    name = ""
    instructions = ""  # how the fallback system prompt asks for calls in this format

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self.text = ""
        self.pos = 0
        self.final = False
        self.calls = 0
        self._new_id = new_id
        self._events: list[Event] = []
        self._blank: list[str] = []  # held whitespace content
        self._skipped: dict[int, int] = {}  # skip_ws memo: the text only grows, whitespace stays
        self._args_end: ObjectEnd | None = None

    def feed(self, delta: str) -> list[Event]:
        """The events ``delta`` (the output's next text) completes."""
        self.text += delta
        while self._step():
            pass
        events, self._events = self._events, []
        return events

    def finish(self) -> list[Event]:
        """The events left once the output has ended (held text resolved)."""
        self.final = True
        events = self.feed("")
        if self._blank and not self.calls:
            events.append(Content("".join(self._blank)))
        self._blank = []
        return events

    @staticmethod
    @abstractmethod
    def format_call(name: str, arguments: dict | str) -> str:
        """One call as this format writes it (``arguments`` as an object, or its JSON text)."""

    @abstractmethod
    def _step(self) -> bool:
        """Advance from ``self.pos`` as far as the text allows; whether anything moved."""

    # -- helpers for subclasses

    def _content(self, text: str) -> None:
        if not text:
            return
        body = text.rstrip(WHITESPACE)  # only the new text: held whitespace is never rescanned
        if body:
            self._events.append(Content("".join(self._blank) + body))
            self._blank = []
        self._blank.append(text[len(body):])

    def _start_call(self, name: str) -> None:
        self._blank = []
        self._events.append(CallStart(self.calls, self._new_id(), name))
        self.calls += 1
        self._args_end = ObjectEnd()

    def _skip(self, i: int) -> int:
        """:func:`skip_ws` from ``i``, resumed where the last skip from ``i`` stopped (a state that
        waits on whitespace would otherwise rescan it on every delta)."""
        j = skip_ws(self.text, self._skipped.get(i, i))
        self._skipped[i] = j
        return j

    def _open_call(self, header: tuple[str, int]) -> bool:
        """Start the call a :func:`read_call_header` result names; on to its arguments."""
        self._start_call(header[0])
        self.pos, self.state = header[1], "arguments"
        return True

    def _arguments_step(self) -> bool:
        """The ``arguments`` state: pass them on; once the object closes, on to the ``tail``."""
        done = self._arguments()
        if done:
            self.state = "tail"
        return done

    def _arguments(self) -> bool:
        """Pass the arguments' text on from ``self.pos``; True once the object is closed."""
        end = self._args_end.scan(self.text, self.pos)
        stop = len(self.text) if end is None else end
        if stop > self.pos:
            self._events.append(Arguments(self.calls - 1, self.text[self.pos:stop]))
        self.pos = stop
        return end is not None

    def _whole_call(self, body: str) -> bool:
        """A call written whole (a block whose header did not stream): emitted if it parses."""
        try:
            call = json.loads(body)
        except ValueError:
            return False
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not _utf8(call["name"]):
            return False
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return False
        if not isinstance(arguments, dict):
            return False
        self._start_call(call["name"])
        text = json.dumps(arguments, ensure_ascii=False)
        # a lone surrogate ("\\ud800" in the model's text) stays escaped: UTF-8 cannot carry it
        self._events.append(Arguments(self.calls - 1, text if _utf8(text) else json.dumps(arguments)))
        return True


def _utf8(text: str) -> bool:
    """``text`` can be encoded as UTF-8 (it holds no lone surrogate)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks among content."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    instructions = (
        "To call a function, answer with a JSON object of its name and arguments inside "
        "<tool_call></tool_call> tags, one block per call:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
    )

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.state = "content"
        self.block = 0  # where the current block's <tool_call> starts
        self.searched = 0  # the blocks' tags were looked for up to here (each delta searches only what is new)

    @classmethod
    def format_call(cls, name: str, arguments: dict | str) -> str:
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return f'{cls.OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{cls.CLOSE}'

    def _step(self) -> bool:
        text, pos = self.text, self.pos
        if self.state == "content":
            k = text.find(self.OPEN, pos)
            if k < 0:
                stop = len(text) if self.final else len(text) - held_prefix(text[pos:], self.OPEN)
                self._content(text[pos:stop])
                self.pos = stop
                return False
            self._content(text[pos:k])
            self.block, self.pos, self.state = k, k + len(self.OPEN), "header"
            return True
        if self.state == "header":
            header = read_call_header(text, pos)
            if header is NEED and not self.final:
                return False
            if header is NEED or header is BAD:
                self.state = "block"
                return True
            return self._open_call(header)
        if self.state == "arguments":
            return self._arguments_step()
        if self.state == "tail":  # `}` and whitespace up to </tool_call> (or a next <tool_call>)
            start = max(pos, self.searched)
            ends = [k for k in (text.find(self.CLOSE, start), text.find(self.OPEN, start)) if k >= 0]
            if not ends:
                self._searched_to(len(text))
                return False
            k = min(ends)
            self.pos = k + len(self.CLOSE) if text.startswith(self.CLOSE, k) else k
            self.state = "content"
            return True
        if self.state == "block":  # a block that did not stream: whole once closed, else content
            k = text.find(self.CLOSE, max(pos, self.searched))
            if k < 0 and not self.final:
                self._searched_to(len(text))
                return False
            end = len(text) if k < 0 else k + len(self.CLOSE)
            if not self._whole_call(text[pos:len(text) if k < 0 else k]):
                self._content(text[self.block:end])
            self.pos, self.state = end, "content"
            return True
        return False

    def _searched_to(self, end: int) -> None:
        """No tag starts before ``end`` but one cut by it (the longest tag, less a character)."""
        self.searched = max(self.searched, end - len(self.CLOSE) + 1)


class JsonCalls(ToolParser):
    """Calls written as JSON objects one after another: an optional ``prefix`` (skipped), an
    ``opener`` the output must start with (else it is all content), objects separated by
    ``separator``, and an optional ``closer``. Text after the calls is content; a next call the
    output ends in before its arguments begin is dropped."""

    prefix = ""
    opener = ""
    separator = ";"
    closer = ""

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.state = "start"

    @staticmethod
    def format_call(name: str, arguments: dict | str) -> str:
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": {args}}}'

    def _step(self) -> bool:
        text, pos = self.text, self.pos
        if self.state == "start":
            i = self._skip(pos)
            rest = text[i:]
            if self.prefix and rest.startswith(self.prefix):
                self.pos = i + len(self.prefix)
                return True
            lead = self.opener or "{"
            if rest.startswith(lead):
                self.pos, self.state = i + len(self.opener), "header"
                return True
            if not self.final and (self.prefix.startswith(rest) or lead.startswith(rest)):
                return False  # too little text to tell
            self.pos, self.state = 0, "content"  # not calls: all of it is content
            return True
        if self.state == "header":
            i = self._skip(pos)
            if self.closer and text.startswith(self.closer, i):
                self.pos, self.state = i + len(self.closer), "content"
                return True
            header = read_call_header(text, self._skip(pos))
            if header is NEED and not self.final:
                return False
            if header is NEED and self.calls:  # the output ended inside a next call's name: dropped
                self.pos, self.state = len(text), "content"
                return True
            if header is NEED or header is BAD:
                self.state = "content"
                if not self.calls:
                    self.pos = 0
                return True
            return self._open_call(header)
        if self.state == "arguments":
            return self._arguments_step()
        if self.state == "tail":  # `}`, then a separator (another call), the closer or the end
            i = self._skip(pos)
            if i < len(text) and text[i] == "}":
                i = self._skip(i + 1)
                if i >= len(text):
                    return False
                for mark, state in ((self.separator, "next"), (self.closer, "content")):
                    if mark and text.startswith(mark, i):
                        self.pos, self.state = i + len(mark), state
                        return True
            if i >= len(text):
                return False
            self.pos, self.state = i, "content"  # something else: content from here
            return True
        if self.state == "next":  # after a separator: an optional prefix, then the next call
            i = self._skip(pos)
            if self.prefix and text.startswith(self.prefix, i):
                self.pos, self.state = i + len(self.prefix), "header"
                return True
            if self.prefix and not self.final and self.prefix.startswith(text[i:]):
                return False
            self.pos, self.state = i, "header"
            return True
        if self.state == "content":
            self._content(text[pos:])
            self.pos = len(text)
            return False
        return False


class Llama3JsonParser(JsonCalls):
    """Llama 3.1+ JSON tool calls: ``{"name": ..., "parameters": {...}}``, several with ``;``."""

    name = "llama3_json"
    prefix = "<|python_tag|>"
    instructions = (
        "To call a function, answer only with a JSON object of its name and parameters, "
        'several separated by ";":\n{"name": "<function name>", "parameters": {<arguments as JSON>}}'
    )



TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def detect_tool_parser(chat_template: str | None) -> str:
    """The format a chat template asks its model for: ``hermes`` where it mentions
    ``<tool_call>``, ``llama3_json`` where it mentions ``<|python_tag|>`` or the ``ipython``
    role, else ``hermes`` (the format the fallback prompt asks for)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return HermesParser.name
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonParser.name
    return HermesParser.name


def parse_whole(parser: ToolParser, text: str) -> tuple[str | None, list[dict]]:
    """A whole output's content (None when empty) and tool calls (``{"id", "name",
    "arguments"}``, arguments as JSON text), by feeding ``parser`` the text in one piece."""
    return collect([*parser.feed(text), *parser.finish()])


def collect(events: list[Event]) -> tuple[str | None, list[dict]]:
    """Events put together: the content (None when empty) and the calls in order."""
    content: list[str] = []
    calls: list[dict] = []
    for event in events:
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, CallStart):
            calls.append({"id": event.id, "name": event.name, "arguments": ""})
        else:
            calls[event.index]["arguments"] += event.text
    return "".join(content) or None, calls
