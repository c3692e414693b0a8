"""Structured outputs: the grammar a :class:`~cadenza.node.core.request.StructuredOutput` compiles
to, and the check the server runs before a request is queued.

The grammar engine is llguidance (Microsoft, the engine behind Guidance; vLLM's ``guidance``
structured-output backend). Both candidates, llguidance 1.9.1 and XGrammar 0.2.9, were measured
on this project's CPU machine with SmolLM2's 49,152-token vocabulary (docs/architecture.md,
"Structured outputs", has the table). Why llguidance:

- It refuses a JSON-schema keyword it cannot enforce (``uniqueItems``: "Unimplemented keys"),
  so a request gets a 400 naming it. XGrammar ignored ``uniqueItems``, and a ``minimum`` inside
  ``allOf``, without a word: its output could fail the schema it was given.
- It compiles 7x faster: 2.4 ms against 18.2 ms for a 50-field schema. A compile delays its own
  request, and tool calls bring a new schema with every tool list.
- It has no dependencies. XGrammar brings apache-tvm-ffi (13 MB) and pins torch, transformers
  and triton.

Its per-token masks cost more: 8.5 us median and 220 us p99, against 1.45 and 11.7 us. The
tail comes from strings with a ``maxLength``. The engine computes the masks in a thread while the
forward runs (:mod:`cadenza.node.engine.grammar`), and both engines release the GIL there.

JSON is generated without free whitespace, with ``", "`` and ``": "`` as separators (the shape
``json.dumps`` writes). With free whitespace a weak model can spend its whole token budget on
blanks.
"""

from __future__ import annotations

import functools
import json

from cadenza.node.core.request import StructuredOutput

MAX_SCHEMA_CHARS = 64 * 1024  # a schema's JSON text; larger ones are refused before compiling
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}
_ANY_OBJECT = '{"type": "object"}'  # OpenAI's JSON mode: any JSON object


class GrammarError(ValueError):
    """A constraint the grammar engine cannot enforce; the message names the problem."""


def grammar_of(structured: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) that ``structured`` compiles to.

    Raises:
        GrammarError: a schema that is not a JSON object, or is larger than ``MAX_SCHEMA_CHARS``.
    """
    import llguidance

    spec = _ANY_OBJECT if structured.kind == "json_object" else structured.spec
    if len(spec) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"the schema has {len(spec)} characters; at most {MAX_SCHEMA_CHARS} are accepted")
    try:
        schema = json.loads(spec)
    except ValueError as exc:
        raise GrammarError(f"the schema is not valid JSON ({exc})") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a schema must be a JSON object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


@functools.lru_cache(maxsize=256)
def check(structured: StructuredOutput) -> None:
    """Refuse a constraint the engine would fail to compile. The tokenizer is not needed for this.

    Results are cached by constraint, so a schema that many requests send is checked once. Run it
    off the event loop: llguidance bounds a compile's work (its parser limits), but a large
    schema still takes milliseconds.

    Raises:
        GrammarError: the schema is invalid, or uses a keyword llguidance cannot enforce
            (``Unimplemented keys: ["uniqueItems"]``). The message is llguidance's own.
    """
    import llguidance

    problem = llguidance.LLMatcher.validate_grammar(grammar_of(structured))
    if problem:
        raise GrammarError(problem)
