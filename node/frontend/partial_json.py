"""Reading JSON as it arrives: each reader says how far the text so far takes it, or that it
needs more text (:data:`NEED`), or that the text cannot be what it expects (:data:`BAD`).

What the tool-call parsers (:mod:`cadenza.node.frontend.tool_parsers`) need and no more: a JSON
string, a call's header ``{"name": ..., "arguments": `` and where an object ends, found with
string and escape awareness as its text streams. Pure: no I/O.
"""

from __future__ import annotations

import json

NEED = object()  # the text ends before the answer is known
BAD = object()  # the text cannot be what was expected
WHITESPACE = " \t\r\n"
# Most characters a call's header ``{"name": ..., "arguments": `` may span: far above any real one
# (OpenAI's names have at most 64 characters), and it bounds the rescan of a header still arriving,
# which is repeated on every delta — a model writing an endless name would cost quadratic time.
MAX_HEADER_CHARS = 1024


def skip_ws(text: str, i: int) -> int:
    """The index of the first character at or after ``i`` that is not JSON whitespace."""
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def read_string(text: str, i: int):
    """The JSON string starting at ``text[i]`` and the index after it; NEED, or BAD (also for a
    string whose escapes make a lone surrogate, which UTF-8 cannot carry)."""
    if i >= len(text):
        return NEED
    if text[i] != '"':
        return BAD
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            try:
                value = json.loads(text[i:j + 1])
                value.encode()  # a lone surrogate escape ("\\ud800") is no text a response can carry
            except (ValueError, UnicodeEncodeError):
                return BAD
            return value, j + 1
        j += 1
    return NEED


def read_call_header(text: str, i: int):
    """Read ``{"name": "f", "arguments": `` (also ``"parameters"``, and ``"type"`` before them)
    from ``text[i]`` on, whitespace allowed around every token.

    Returns:
        ``(name, j)`` with ``text[j]`` the ``{`` of the arguments object; NEED when ``text``
        ends first; BAD when it cannot be such a header, or spans more than
        :data:`MAX_HEADER_CHARS` from its ``{`` (decided alike wherever the text is cut).
    """
    i = skip_ws(text, i)
    if i >= len(text):
        return NEED
    if text[i] != "{":
        return BAD
    window = text[i:i + MAX_HEADER_CHARS + 1]  # the arguments' `{` may be at most this far on
    header = _read_header(window, 0)
    if header is NEED or header is BAD:
        return BAD if header is NEED and len(text) - i > len(window) else header
    return header[0], i + header[1]


def _read_header(text: str, i: int):
    """:func:`read_call_header` from the ``{`` at ``text[i]``, unbounded."""
    i += 1
    name = None
    while True:
        key = read_string(text, skip_ws(text, i))
        if key is NEED or key is BAD:
            return key
        key, i = key
        i = skip_ws(text, i)
        if i >= len(text):
            return NEED
        if text[i] != ":":
            return BAD
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return NEED
        if key in ("arguments", "parameters"):
            return (name, i) if name is not None and text[i] == "{" else BAD
        if key not in ("name", "type"):
            return BAD
        value = read_string(text, i)
        if value is NEED or value is BAD:
            return value
        value, i = value
        if key == "name":
            name = value
        elif value != "function":
            return BAD
        i = skip_ws(text, i)
        if i >= len(text):
            return NEED
        if text[i] != ",":
            return BAD
        i += 1


class ObjectEnd:
    """Where a JSON object ends, found as its text arrives (string- and escape-aware)."""

    __slots__ = ("depth", "in_string", "escaped")

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def scan(self, text: str, i: int) -> int | None:
        """Read ``text[i:]``; the index after the object's closing brace, or None if not there yet."""
        for j in range(i, len(text)):
            c = text[j]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return j + 1
        return None


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
