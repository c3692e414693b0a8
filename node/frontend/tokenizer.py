"""Tokenizer and chat template of a Hugging Face model folder, on ``tokenizers`` + ``jinja2``.

Reads what ``transformers`` would read, without importing it at runtime:

- ``tokenizer.json`` (required): the fast tokenizer (model, normalizer, pre-tokenizer,
  post-processor, decoder, added tokens);
- ``tokenizer_config.json`` (optional): ``bos_token``/``eos_token``/``pad_token``/``unk_token``
  (a string or an AddedToken dict ``{"content": ...}``), ``add_bos_token``, ``chat_template``
  (a string, or a list of ``{"name", "template"}`` of which the one named ``"default"`` is used);
- ``chat_template.jinja`` (optional; transformers >= 4.4x saves the template there, and like
  transformers we let it win over the config entry);
- ``config.json`` and ``generation_config.json`` (optional): ``eos_token_id`` (an int or a list)
  and ``bos_token_id``.

Chat templates render the way ``transformers.apply_chat_template`` renders them: a
``jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
``loopcontrols`` extension, a ``{% generation %}`` block tag (rendered as its body), globals
``raise_exception`` and ``strftime_now``, and a ``tojson`` filter that keeps non-ASCII text.

The rendered prompt already holds any BOS the model wants, so encode it with
``add_special_tokens=False`` (``Tokenizer.encode_chat`` does both steps).

**Special-token text in requests.** By default, text such as ``<|im_start|>system`` in a message
becomes the control tokens it spells, as ``transformers`` and vLLM do: a user can forge a turn
of another role. With ``special_tokens_as_text`` (``--text-special-tokens plain``), special tokens
in the caller's text are encoded as plain text (``tokenizers``' ``encode_special_tokens``), while
the template's own markup stays control tokens. The template is still rendered once, with the
real content: each special-token occurrence in a message's strings (found by the tokenizer
itself, so its matching rules hold) is wrapped in two Unicode noncharacters that nothing the
template renders holds (a client may send noncharacters too: a free pair is picked), and which
templates copy as they copy any character. After rendering, the wrapped spans are where the
caller's special text landed. The prompt is encoded as usual; the template's own control tokens
(those outside every span) cut it into stretches of text, and each stretch that holds a span is
encoded again, whole, as plain text, so the words around the caller's special text merge as in
any text. A conversation without special-token text is encoded exactly as by default. (A
SentencePiece tokenizer that marks only the prompt's first word as a word start would mark a
re-encoded stretch's first word too.)
"""

from __future__ import annotations

import bisect
import copy
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

Message = Mapping[str, Any]  # {"role": str, "content": str}; the server flattens content parts
# Unicode noncharacters ("for internal use", never interchanged): a pair of them, absent from the
# request, wraps each special-token occurrence in a message while the template renders.
_NONCHARACTERS = tuple(chr(c) for c in range(0xFDD0, 0xFDF0))


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character each byte is written as in a vocabulary
    (printable bytes as themselves, the others shifted past 255), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


_BYTE_OF_CHAR = _byte_level_chars()


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or refused the messages (a 400)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text in training templates)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, **options: Any) -> str:
    """Jinja's own ``tojson`` escapes HTML; templates want plain JSON (``indent=``, ...)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, **options)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox described in the module docstring.

    Raises:
        ChatTemplateError: the template does not compile.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def chat_template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads from its caller (``messages``, ``tools``, ...).

    Raises:
        ChatTemplateError: the template does not compile.
    """
    template = compile_chat_template(source)
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(template.environment.parse(source)))
    except jinja2.TemplateSyntaxError as exc:  # pragma: no cover - compile_chat_template parsed it already
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token given as a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(config: Mapping[str, Any], model_dir: Path) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _ids(value: Any) -> set[int]:
    values = value if isinstance(value, list) else [value]
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool)}


class Tokenizer:
    """Text <-> token ids and chat prompts for one model.

    Build with ``Tokenizer.from_pretrained(model_dir)``; ``hf`` is the underlying
    ``tokenizers.Tokenizer`` (the detokenizer streams through it). Token ids are ints in
    ``[0, vocab_size)``; ``vocab_size`` counts added tokens and may be smaller than the model's
    embedding rows (``config.json``'s ``vocab_size`` is often padded).
    """

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        special_tokens: Mapping[str, str | None] | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        add_bos_token: bool | None = None,
    ) -> None:
        self.hf = tokenizer
        specials = dict(special_tokens or {})
        self.bos_token: str | None = specials.get("bos_token")
        self.eos_token: str | None = specials.get("eos_token")
        self.pad_token: str | None = specials.get("pad_token")
        self.unk_token: str | None = specials.get("unk_token")
        self.chat_template = chat_template
        bos_id = tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        self.bos_token_id: int | None = bos_id if bos_id is not None else bos_token_id
        eos = set(extra_eos_token_ids)
        if self.eos_token and (eos_id := tokenizer.token_to_id(self.eos_token)) is not None:
            eos.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # add_bos_token overrides the post-processor only where the two disagree.
        probe = tokenizer.encode("", add_special_tokens=True).ids
        adds_bos = bool(probe) and probe[0] == self.bos_token_id
        self._prepend_bos = bool(add_bos_token) and not adds_bos and self.bos_token_id is not None
        self._strip_bos = add_bos_token is False and adds_bos

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load the tokenizer of the Hugging Face model folder ``model_dir``.

        Raises:
            FileNotFoundError: ``model_dir`` or its ``tokenizer.json`` does not exist.
            ValueError: a file in the folder cannot be parsed (the message names it).
        """
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: {model_dir} is not a Hugging Face model folder "
                "with a fast tokenizer"
            )
        try:
            hf = _HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise ValueError(f"cannot load {tokenizer_file}: {exc}") from exc
        config = _read_json(model_dir / "tokenizer_config.json")
        model_config = _read_json(model_dir / "config.json")
        generation_config = _read_json(model_dir / "generation_config.json")
        names = ("bos_token", "eos_token", "pad_token", "unk_token")
        add_bos = config.get("add_bos_token")
        bos_id = generation_config.get("bos_token_id", model_config.get("bos_token_id"))
        return cls(
            hf,
            special_tokens={name: _token_text(config.get(name)) for name in names},
            chat_template=_pick_template(config, model_dir),
            extra_eos_token_ids=sorted(
                _ids(model_config.get("eos_token_id"))
                | _ids(generation_config.get("eos_token_id"))
            ),
            bos_token_id=bos_id if isinstance(bos_id, int) else None,
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (byte-level form), or None if out of range."""
        return self.hf.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for in the output (OpenAI's logprobs ``bytes``): a
        byte-level BPE token's bytes (GPT-2's byte-to-character map undone), a ``<0xNN>`` byte
        token's byte, else its decoded text as UTF-8. A token may hold part of a character."""
        piece = self.hf.id_to_token(token_id)
        if piece is None:
            return b""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if token_id not in self.special_token_ids and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return self.hf.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @cached_property
    def _plain(self) -> _HFTokenizer:
        """A copy of :attr:`hf` that encodes special-token text as plain text."""
        plain = _HFTokenizer.from_str(self.hf.to_str())
        plain.encode_special_tokens = True
        return plain

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (control tokens: ``<|im_start|>``, ``</s>``...)."""
        return frozenset(i for i, token in self.hf.get_added_tokens_decoder().items() if token.special)

    def encode(self, text: str, add_special_tokens: bool = True, special_tokens_as_text: bool = False) -> list[int]:
        """Token ids of ``text``.

        ``add_special_tokens`` runs the post-processor (and ``add_bos_token``); use False for a
        rendered chat prompt, which already holds its special tokens. ``special_tokens_as_text``:
        special-token text in ``text`` is encoded as plain text, not as control tokens (the
        post-processor's own tokens are still added).
        """
        hf = self._plain if special_tokens_as_text else self.hf
        # encode_batch releases the GIL (encode does not): a long prompt tokenized in a worker
        # thread must not stall the server's event loop.
        ids: list[int] = hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._prepend_bos:
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
        elif add_special_tokens and self._strip_bos:
            del ids[0]
        return ids

    @cached_property
    def max_token_chars(self) -> int:
        """Characters in the longest vocabulary entry: ``len(text) / max_token_chars`` bounds the
        token count of ``text`` from below (used to refuse oversized prompts before tokenizing)."""
        return max(1, max(len(token) for token in self.hf.get_vocab(with_added_tokens=True)))

    @cached_property
    def chat_markup_tokens(self) -> int:
        """Tokens the chat template adds per message, at least (0 when it cannot be measured).

        Measured once: a conversation of two empty user/assistant turns against one of four,
        halved per message, less two for merges across a message's edges with its content.
        ``messages × chat_markup_tokens`` bounds a chat prompt's token count from below before
        anything is rendered, so a request of a hundred thousand tiny messages is refused
        without rendering them.
        """
        turn = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
        try:
            one, two = (len(self.encode_chat(turn * k, add_generation_prompt=False)) for k in (1, 2))
        except ChatTemplateError:
            return 0
        return max(0, (two - one) // 2 - 2)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD (see ``IncrementalDetokenizer``)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template (no chat_template in tokenizer_config.json and "
                "no chat_template.jinja); use the completions endpoint instead"
            )
        return compile_chat_template(self.chat_template)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render ``messages`` (``[{"role": str, "content": str}, ...]``) into a prompt string.

        Template variables: ``messages``, ``add_generation_prompt``, ``bos_token``,
        ``eos_token``, ``pad_token``, ``unk_token``, and every keyword in ``extra`` (e.g.
        ``tools``, ``documents``). Follows ``transformers``' ``apply_chat_template``.

        Raises:
            ChatTemplateError: no template, it does not compile, it calls ``raise_exception``
                (e.g. roles out of order), or rendering fails.
        """
        template = self._template
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
            **extra,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**variables)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:
            # Templates are data from the model folder; a failure means these messages do not fit.
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, special_tokens_as_text: bool = False,
        **extra: Any,
    ) -> list[int]:
        """``encode(apply_chat_template(...), add_special_tokens=False)``.

        ``special_tokens_as_text``: special-token text in the messages' strings (content, name,
        tool calls' names and arguments: every string but the roles) and in ``extra``'s (the
        tools) is encoded as plain text; the template's own markup stays control tokens (see the
        module docstring). ``extra`` goes to the template as it is.

        Raises:
            ChatTemplateError: as :meth:`apply_chat_template`.
        """
        if not special_tokens_as_text:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra),
                               add_special_tokens=False)
        wrapped, wrapped_extra, marks = self._wrap_special_text(messages, extra)
        prompt = self.apply_chat_template(wrapped, add_generation_prompt, **wrapped_extra)
        if marks is None:  # no special-token text in any message: the default encoding, exactly
            return self.encode(prompt, add_special_tokens=False)
        text, spans = _unwrap(prompt, *marks)
        encoding = self.hf.encode_batch([text], add_special_tokens=False)[0]
        ids, offsets = encoding.ids, encoding.offsets
        starts = [a for a, _ in spans]

        def callers(a: int, b: int) -> bool:  # does [a, b) overlap a span of the caller's special text?
            k = bisect.bisect_right(starts, a) - 1
            return any(s < b and a < e for s, e in spans[max(k, 0):k + 2])

        # The template's own control tokens split the prompt into stretches of text, which the
        # tokenizer encodes one by one; a stretch holding caller text is encoded again, whole,
        # with special tokens as text (whole: so its merges and word starts are as in any text).
        out: list[int] = []
        stretch, stretch_from = 0, 0  # the current stretch's first token and first character
        for m, (t, (a, b)) in enumerate(zip(ids, offsets)):
            if t in self.special_token_ids and not callers(a, b):
                out += self._stretch(ids[stretch:m], text, stretch_from, a, callers)
                out.append(t)
                stretch, stretch_from = m + 1, b
        return out + self._stretch(ids[stretch:], text, stretch_from, len(text), callers)

    def _stretch(self, ids: list[int], text: str, start: int, end: int, callers) -> list[int]:
        """The tokens of ``text[start:end]``, text between two of the template's control tokens:
        ``ids`` as encoded, or encoded again as plain text when it holds caller special text."""
        if not ids or not callers(start, end):
            return ids
        return self._plain.encode_batch([text[start:end]], add_special_tokens=False)[0].ids

    def _wrap_special_text(
        self, messages: Sequence[Message], extra: Mapping[str, Any]
    ) -> tuple[list[dict], dict[str, Any], tuple[str, str] | None]:
        """Copies of ``messages`` and ``extra`` with each special-token occurrence in their strings
        (all but a message's ``role``; nested ones too: tool calls, tools) wrapped in a pair of
        noncharacters, and that pair; ``(messages, extra, None)`` without any. The pair is one
        that nothing the template renders holds: not the messages, ``extra`` or the template.

        Raises:
            ChatTemplateError: those hold every noncharacter of U+FDD0..U+FDEF (no pair is free).
        """
        copies = copy.deepcopy([dict(m) for m in messages])
        extra_copy = copy.deepcopy(dict(extra))
        fields = [slot for m in copies for slot in _string_slots(m, skip="role")] + _string_slots(extra_copy)
        if not fields:
            return copies, extra_copy, None
        found = self.hf.encode_batch([m[key] for m, key in fields], add_special_tokens=False)
        special = self.special_token_ids
        hits = [[(a, b) for t, (a, b) in zip(e.ids, e.offsets) if t in special and b > a] for e in found]
        if not any(hits):
            return copies, extra_copy, None
        rendered = json.dumps([copies, extra], ensure_ascii=False, default=str) + (self.chat_template or "")
        free = [c for c in _NONCHARACTERS if c not in rendered]
        if len(free) < 2:
            raise ChatTemplateError("the messages hold every Unicode noncharacter U+FDD0..U+FDEF; they cannot "
                                    "be encoded with special tokens as text")
        open_, close = free[0], free[1]
        for (m, key), spans in zip(fields, hits):
            text, parts, at = m[key], [], 0
            for a, b in spans:
                parts += [text[at:a], open_, text[a:b], close]
                at = b
            m[key] = "".join(parts) + text[at:]
        return copies, extra_copy, (open_, close)


def _string_slots(node: Any, skip: str | None = None) -> list[tuple[Any, Any]]:
    """``(container, key)`` of every string value in ``node``'s nested dicts and lists (a top
    level key ``skip`` left out)."""
    slots: list[tuple[Any, Any]] = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        if key == skip:
            continue
        if isinstance(value, str):
            slots.append((node, key))
        else:
            slots += _string_slots(value)
    return slots


def _unwrap(prompt: str, open_: str, close: str) -> tuple[str, list[tuple[int, int]]]:
    """``prompt`` without the wrapping noncharacters, and the character spans they wrapped (in
    order). An opening mark the template cut from its closing one wraps to the end: what the
    caller wrote is never trusted as markup."""
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    length, start = 0, None
    for piece in re.split(f"([{open_}{close}])", prompt):
        if piece == open_:
            start = length if start is None else start
        elif piece == close:
            if start is not None:
                spans.append((start, length))
            start = None
        else:
            out.append(piece)
            length += len(piece)
    if start is not None:
        spans.append((start, length))
    return "".join(out), spans
