"""Grammar matchers of the structured requests, and their token masks for each step.

Each request with a :class:`~cadenza.node.core.request.StructuredOutput` gets an llguidance
matcher (:mod:`cadenza.node.core.structured` says why llguidance). The matcher holds the
grammar's state after the tokens generated so far. The engine core drives it:

- :meth:`Grammars.add`, when the request arrives, compiles its grammar in the compile thread. The
  prompt's prefill runs meanwhile. A compiled grammar is cached by constraint, and each request
  gets a copy of it (llguidance's ``deep_copy``: microseconds).
- :meth:`Grammars.begin`, after the scheduler has chosen the step, hands the mask thread the
  structured rows that sample. The forward pass runs meanwhile, on the engine's thread. The
  runner waits for the masks (:meth:`StepMasks.result`) only once the logits exist, and applies
  them before sampling (:func:`~cadenza.node.runner.sampler.apply_token_bitmask`).
- :meth:`Grammars.accept`, after the step, advances a matcher by the token its request got.

Invariant: a matcher has consumed exactly the request's generated tokens. The engine never takes a
generated token back. Preemption recomputes the KV of tokens already generated; a chunked prefill
samples only at its last chunk; a request pulled from a prefill replica samples its first token
here. So a matcher never needs a rollback. Once a grammar is complete its mask allows only the
end-of-sequence tokens, so the request ends the way every request does (finish reason ``stop``,
the token adding no text); one with ``ignore_eos`` ends there too.

Masks are bitmasks, one bit per vocabulary token (int32 words, llguidance's layout), built on the
host. Only the rows of structured requests are computed and copied to the device.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from cadenza.node.core.request import Request, RequestStatus, StructuredOutput
from cadenza.node.core.step import SchedulerOutput
from cadenza.node.core.structured import GrammarError, grammar_of

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept, least recently used dropped first


@dataclass(frozen=True, slots=True)
class GrammarFailure:
    """A request's grammar failed: it did not compile in the engine, it matches no output at all
    (a ``$ref`` cycle: the server's check, which has no tokenizer, cannot see it), or llguidance
    gave up part way (``lexer error: too many expressions constructed`` for a nested repeat in a
    ``pattern``). ``reason`` is llguidance's message, its first line."""

    reason: str


class StepMasks:
    """The token masks of one step's structured rows, computed in the mask thread.

    Attributes:
        rows: indexes, among the step's sampling rows, of the structured rows (ascending).
    """

    def __init__(self, rows: list[int], future: Future) -> None:
        self.rows = rows
        self._future = future

    def result(self) -> torch.Tensor:
        """``[len(rows), ceil(V / 32)]`` int32 bitmasks on the host: bit ``t % 32`` of word
        ``t // 32`` set when token ``t`` is allowed. Waits for the mask thread."""
        return self._future.result()


class Grammars:
    """The matchers of one engine's structured requests (see the module docstring).

    Args:
        model_dir: the model's folder; its ``tokenizer.json`` gives the token strings the grammar
            is matched against (read at the first structured request).
        vocab_size: the model's vocabulary (logits width); tokens the tokenizer lacks are never allowed.
        eos_token_ids: the tokens that end a request; the grammar allows them where it can end.
    """

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_token_ids = sorted(eos_token_ids)
        self._eos = frozenset(eos_token_ids)
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._matchers: dict[str, Future] = {}
        self._compiler: ThreadPoolExecutor | None = None
        self._masker: ThreadPoolExecutor | None = None

    @property
    def active(self) -> bool:
        """Whether any live request has a grammar (else the step skips every grammar call)."""
        return bool(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    # -- requests -------------------------------------------------------------------------------

    @property
    def can_match(self) -> bool:
        """Whether the model folder has the ``tokenizer.json`` grammars are matched against (a
        model drawn from a seed for a benchmark may have only its ``config.json``)."""
        return (self.model_dir / "tokenizer.json").is_file()

    def add(self, request_id: str, structured: StructuredOutput) -> None:
        """Start compiling ``request_id``'s grammar (in the compile thread); see :attr:`can_match`."""
        self._matchers[request_id] = self._threads().submit(self._matcher, structured)

    def warm(self) -> None:
        """Build llguidance's view of the tokenizer now, in the compile thread (a serving core
        calls it as it starts): about 0.35 s for SmolLM2's 49,152 tokens, which the first
        structured request would otherwise wait for, and its whole batch with it."""
        if self.can_match:
            self._threads().submit(self._llg_tokenizer)

    def _threads(self) -> ThreadPoolExecutor:
        """The compile thread (the mask thread with it), started at the first use."""
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="cadenza-grammar-compile")
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="cadenza-grammar-mask")
        return self._compiler

    def release(self, request_id: str) -> None:
        """Forget ``request_id``'s matcher (finished or aborted); a no-op for other requests."""
        self._matchers.pop(request_id, None)

    def close(self) -> None:
        for pool in (self._compiler, self._masker):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    # -- steps ----------------------------------------------------------------------------------

    def begin(self, step: SchedulerOutput) -> StepMasks | None:
        """Start computing the masks of ``step``'s structured sampling rows; None if it has none.

        The sampling rows are in the runner's order: every decode, then each prefill chunk that
        ends its prompt.
        """
        matchers = self._matchers
        rows, futures = [], []
        for i, req in enumerate(_sampling_requests(step)):
            future = matchers.get(req.request_id)
            if future is not None:
                rows.append(i)
                futures.append(future)
        if not rows:
            return None
        return StepMasks(rows, self._masker.submit(self._masks, futures))

    def accept(self, req: Request) -> RequestStatus | GrammarFailure | None:
        """Advance ``req``'s matcher by its newest token (last in ``token_ids``).

        Returns:
            None while the grammar goes on; ``FINISHED_STOPPED`` once it is complete and the token
            is an end-of-sequence token (which a request with ``ignore_eos`` would go past); a
            :class:`GrammarFailure` when it failed. A failed grammar's mask lets the end-of-sequence
            token through, so the scheduler may already have ended the request as stopped: the
            caller must end it as failed, not as a complete output.
        """
        future = self._matchers.get(req.request_id)
        if future is None:
            return None
        matcher = _matcher_of(future)
        if matcher is None:
            return GrammarFailure(_first_line(str(future.exception())))
        token = req.token_ids[-1]
        if not matcher.consume_token(token) or matcher.is_error():
            reason = _first_line(matcher.get_error()) or f"the grammar refused token {token}"
            logger.warning("request %s: its grammar failed at token %d (%s); ending it", req.request_id, token, reason)
            return GrammarFailure(reason)
        if token in self._eos and matcher.is_stopped():  # complete, and ended (ignore_eos would not end it)
            return RequestStatus.FINISHED_STOPPED
        return None

    # -- the threads' work ----------------------------------------------------------------------

    def _matcher(self, structured: StructuredOutput):
        """A fresh matcher for ``structured`` (compile thread): a copy of the cached compile."""
        import llguidance

        compiled = self._compiled.get(structured)
        if compiled is None:
            compiled = llguidance.LLMatcher(self._llg_tokenizer(), grammar_of(structured), log_level=0)
            if compiled.is_error():
                raise GrammarError(compiled.get_error())
            self._compiled[structured] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(structured)
        return compiled.deep_copy()

    def _llg_tokenizer(self):
        """The model's tokens as llguidance sees them (built once, ~0.35 s for 49k tokens)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance

                text = (self.model_dir / "tokenizer.json").read_text(encoding="utf-8")
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            return self._tokenizer

    def _masks(self, futures: list[Future]) -> torch.Tensor:
        """The bitmasks of one step's structured rows (mask thread). A row whose grammar failed
        to compile allows every token; :meth:`accept` ends that request after the step."""
        bitmask = torch.full((len(futures), self.words), -1, dtype=torch.int32)
        base, row_bytes = bitmask.data_ptr(), self.words * 4
        for i, future in enumerate(futures):
            matcher = _matcher_of(future)  # waits for a compile still running
            if matcher is not None:
                matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)  # releases the GIL
        return bitmask


def _matcher_of(future: Future):
    """The matcher a compile produced, or None if the compile failed (logged once)."""
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - any compile failure ends the request, not the engine
        if not getattr(future, "logged", False):
            future.logged = True
            logger.error("a grammar failed to compile in the engine: %s", exc)
        return None


def _first_line(error: str) -> str:
    """llguidance's error without the parser state it appends (``<state>`` ... on later lines)."""
    return error.strip().split("\n", 1)[0]


def _sampling_requests(step: SchedulerOutput) -> list[Request]:
    """The requests of ``step``'s sampling rows, in the runner's order (decodes, then chunks that
    end a prompt)."""
    return step.decodes + [row.request for row in step.prefill_rows if row.sample]
