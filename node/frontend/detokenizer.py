"""Incremental detokenization with stop strings: generated token ids -> safe text deltas.

Two buffers sit between the sampler and the client:

1. **UTF-8**: ``tokenizers.decoders.DecodeStream`` decodes a small window of recent ids and holds
   back tokens whose bytes end inside a multi-byte character (byte-level BPE splits emoji and
   CJK across tokens), so a delta never ends in a broken character (U+FFFD).
2. **Stop strings**: text that could still be the start of a stop string is held back until it
   either completes a stop (the request stops; the stop string and anything after it are never
   emitted, as in the OpenAI API) or can no longer match (it is released). The held text is at
   most ``max(len(stop)) - 1`` characters. One Aho–Corasick automaton per request
   (``stop_strings.py``) consumes each new delta once, so a token's cost is amortised O(1) per
   character of its delta: independent of the number of stop strings and of the text so far.

References: vLLM's detokenizer stop-string check (hold back max stop length - 1) and Hugging
Face's ``TextStreamer``; no code is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from cadenza.node.frontend.stop_strings import StopStringMatcher
from cadenza.node.frontend.tokenizer import Tokenizer

_CONTEXT_IDS = 6  # ids of already-emitted text kept as decoding context for flush()


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas, applying stop strings.

    Args:
        tokenizer: the model's tokenizer.
        stop: stop strings (non-empty); generation stops at the first one that appears.
        skip_special_tokens: leave special tokens (e.g. ``<|im_end|>``) out of the text.

    Raises:
        ValueError: a stop string is empty.

    Use: call ``add_token`` for each sampled id and send the returned delta; stop feeding once
    ``stopped`` is True; when the request ends any other way (EOS, length, abort), send
    ``flush()``. Concatenated deltas equal ``tokenizer.decode(ids)`` truncated before the stop.
    """

    def __init__(
        self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stops = StopStringMatcher(stop) if stop else None  # raises on an empty stop
        self._context: list[int] = []  # last ids whose text DecodeStream has released
        self._pending: list[int] = []  # ids whose text DecodeStream still holds
        self._held = ""  # decoded text that may still begin a stop string
        self._emitted: list[str] = []
        self._stopped = False
        self._stop_reason: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """All text emitted so far (after ``flush()`` or a stop: the final text)."""
        return "".join(self._emitted)

    @property
    def stopped(self) -> bool:
        """True once a stop string appeared; later ``add_token`` calls return ""."""
        return self._stopped

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, or None."""
        return self._stop_reason

    @property
    def finished(self) -> bool:
        """True after a stop or ``flush()``."""
        return self._finished

    def add_token(self, token_id: int) -> str:
        """Feed one generated id; return the text that is now safe to send (possibly "").

        Ids the tokenizer does not know (a model's padded vocab rows) decode to "". After a
        stop or ``flush()`` the id is ignored and "" is returned.
        """
        if self._finished:
            return ""
        chunk = self._stream.step(self._tokenizer.hf, token_id)
        self._pending.append(token_id)
        if chunk is None:
            return ""
        self._context = (self._context + self._pending)[-_CONTEXT_IDS:]
        self._pending = []
        return self._accept(chunk)

    def flush(self) -> str:
        """Finish the request: return all held-back text (stop prefixes, a trailing U+FFFD)."""
        if self._finished:
            return ""
        tail = self._undecoded_tail()
        self._pending = []
        delta = self._accept(tail) if tail else ""
        if not self._stopped:
            delta += self._held
            self._emitted.append(self._held)
            self._held = ""
        self._finished = True
        return delta

    def _undecoded_tail(self) -> str:
        """Text of the ids DecodeStream still holds (bytes it could not yet make UTF-8 of)."""
        if not self._pending:
            return ""
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        before = decode(self._context, skip)
        after = decode(self._context + self._pending, skip)
        if after.startswith(before):
            return after[len(before) :]
        return decode(self._pending, skip)  # pragma: no cover - decoders with context quirks

    def _accept(self, chunk: str) -> str:
        """Add decoded text; return the part that can no longer belong to a stop string."""
        if self._stops is None:
            self._emitted.append(chunk)
            return chunk
        window = self._held + chunk  # any match that ends in the new chunk starts in here
        match = self._stops.feed(chunk)  # the automaton has already seen the held text
        if match is not None:
            start = len(self._held) + match.end - len(match.stop)
            self._stopped, self._stop_reason, self._finished = True, match.stop, True
            self._held = ""
            self._emitted.append(window[:start])
            return window[:start]
        keep = self._stops.held  # <= len(window): the held text plus the new chunk
        safe, self._held = window[: len(window) - keep], window[len(window) - keep :]
        self._emitted.append(safe)
        return safe
