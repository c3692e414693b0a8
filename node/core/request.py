"""A request's state inside the engine, and its sampling parameters.

There are no prefill/decode phases in the data model: a request's only progress state is
``num_computed_tokens`` catching up with ``num_tokens`` (prompt + generated so far). A scheduled
row that reaches ``num_tokens`` samples the next token; a row of one token is what is usually
called a decode. This is the rule vLLM's V1 scheduler is built on.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cadenza.node.core.siblings import SiblingGroup


class RequestStatus(enum.IntEnum):
    """Ordered: everything at or above ``FINISHED_STOPPED`` is finished."""

    WAITING = 0
    PREEMPTED = 1  # waiting again: its KV was dropped and will be recomputed
    WAITING_FOR_REMOTE_KV = 2  # admitted; its prompt's KV is arriving from another replica
    RUNNING = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI ``finish_reason`` (``stop`` | ``length`` | ``abort``), None while live."""
        return _FINISH_REASONS.get(self)


_GREEDY_BELOW = 1e-5

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


MAX_LOGPROBS = 20  # most likely tokens reported per generated token (OpenAI's top_logprobs bound)

STRUCTURED_KINDS = ("json_schema", "json_object")

MAX_N = 16  # most sequences (OpenAI's ``n`` choices) one call may ask for

# splitmix64 (Steele, Lea and Flood, 2014), for deriving each choice's seed from the call's
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MASK64 = 2**64 - 1


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on a request's output: it must be JSON, or JSON valid against a schema.

    Attributes:
        kind: ``json_object`` (any JSON object; OpenAI's JSON mode) or ``json_schema``.
        spec: for ``json_schema``, the schema as JSON text (compiled grammars are cached by it);
            empty for ``json_object``.

    Raises:
        ValueError: an unknown kind, or a ``json_schema`` without a schema.
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output: kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if self.kind == "json_schema" and not self.spec:
            raise ValueError("structured output: a json_schema constraint needs its schema")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request decoding parameters (OpenAI semantics plus vLLM's ``top_k``/``ignore_eos``).

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        seed: seeds this request's sampling noise; None draws one from the engine's seed.
        stop: strings that end generation; the match is not included in the output.
        stop_token_ids: token ids that end generation (the token is not included in the text);
            kept as a frozenset, so checking a token costs the same however many there are.
        ignore_eos: keep generating past EOS (benchmarks use it to get the trace's lengths).
        logprobs: None, or how many of the most likely tokens (0 to ``MAX_LOGPROBS``) to report
            with each generated token's own log-probability (OpenAI's ``top_logprobs``; vLLM's
            ``logprobs``). Taken from the model's distribution before temperature, top-k and top-p
            (vLLM's default, ``raw_logprobs``).
        structured: None, or the grammar the output must follow (:class:`StructuredOutput`).

    Raises:
        ValueError: on any out-of-range value, naming the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] | tuple[int, ...] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not 0 <= self.temperature < float("inf"):  # NaN too
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 disables it), got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed: must be a 64-bit signed integer, got {self.seed}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs: must be an integer from 0 to {MAX_LOGPROBS}, got {self.logprobs!r}")
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature below 1e-5 (vLLM's threshold) or ``top_k`` of 1."""
        return self.temperature < _GREEDY_BELOW or self.top_k == 1


def choice_request_id(request_id: str, index: int) -> str:
    """The engine's id of choice ``index`` of the call ``request_id``: the call's own id for choice
    0 (so a call of one choice is unchanged), ``{request_id}#{index}`` for the others."""
    return request_id if index == 0 else f"{request_id}#{index}"


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a call seeded ``seed``: ``seed`` itself for choice 0 (a
    call of one choice samples as before), else splitmix64's output for ``(seed, index)`` as a
    signed 64-bit integer. So the choices of a seeded call draw distinct noise, and the whole
    response repeats for the same seed."""
    if index == 0:
        return seed
    z = (seed + index * _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z - 2**64 if z >= 2**63 else z


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """``sampling`` for choice ``index``: its seed derived by :func:`choice_seed` (an unseeded
    call's choices each get their own seed from the engine, as separate requests do)."""
    if index == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=choice_seed(sampling.seed, index))


@dataclass(frozen=True, slots=True)
class RemoteKV:
    """Where a request's prompt was prefilled, so its KV can be pulled instead of computed.

    Attributes:
        host, port: the prefill replica's KV transfer endpoint.
        request_id: the request's id on that replica.
        boot_id: that replica's process boot id when it prefilled (a restart loses its KV).
        num_tokens: prompt tokens, from the first, whose KV it holds.
    """

    host: str
    port: int
    request_id: str
    boot_id: str
    num_tokens: int


@dataclass(slots=True, eq=False)
class Request:
    """One generation request as the scheduler and model runner see it.

    Attributes:
        request_id: unique id.
        token_ids: prompt followed by every generated token.
        num_prompt_tokens: length of the prompt part of ``token_ids``.
        num_computed_tokens: tokens whose KV is in the cache; catches up with ``num_tokens``.
        arrival_time: ``time.monotonic()`` seconds at arrival (FCFS order, queue time).
        traffic_class: ``interactive`` | ``batch`` | ``background`` (see :mod:`cadenza.node.core.policy`).
        tenant: who sent it; tenants of a class share prefill by weighted fair queuing.
        num_preemptions: times its KV was dropped for recompute.
        num_cached_tokens: prompt tokens served from the prefix cache at its (last) admission.
        admitted_time: when it was first admitted to run (queue time = this - arrival).
        preempted_time: when it was last preempted (None once it runs again).
        cache_salt: the client's prefix-cache salt: only requests with the same salt (and, when
            the policy isolates tenants, the same tenant) share cached KV blocks.
        remote_kv: where its prompt's KV may be pulled from (disaggregated pools); None: computed here.
        group: the call's sequences when it asked for more than one (OpenAI ``n``; see
            :mod:`cadenza.node.core.siblings`); None for a call of one.
    """

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    traffic_class: str = "interactive"
    tenant: str = "default"
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    admitted_time: float | None = None
    preempted_time: float | None = None
    cache_salt: str | None = None
    remote_kv: RemoteKV | None = None
    group: SiblingGroup | None = None
    stop_ids: frozenset[int] = field(init=False, repr=False)  # token ids that end it (EOS unless ignored)
    max_num_tokens: int = field(init=False, repr=False)  # prompt + max_tokens: it ends with length there

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("prompt: must contain at least one token")
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        sp = self.sampling
        self.stop_ids = sp.stop_token_ids if sp.ignore_eos else sp.stop_token_ids | self.eos_token_ids
        self.max_num_tokens = self.num_prompt_tokens + sp.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_new_tokens(self) -> int:
        """Tokens whose KV is not computed yet: the whole prompt when it arrives, 1 once decoding."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Every token but the last sampled one is computed, so its next row is one token (a
        decode); otherwise a running request is mid-prefill (see :func:`split_by_phase`)."""
        return self.num_computed_tokens == len(self.token_ids) - 1

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def append_token(self, token_id: int) -> RequestStatus | None:
        """Append a sampled token; return the finished status it causes, if any.

        Stop strings are not checked here (they need text): the engine's detokenizer does it.
        """
        tokens = self.token_ids
        tokens.append(token_id)
        if token_id in self.stop_ids:
            return RequestStatus.FINISHED_STOPPED
        if len(tokens) >= self.max_num_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None


def split_by_phase(requests: list[Request]) -> tuple[list[Request], list[Request]]:
    """``(decoding, mid-prefill)`` of running ``requests``, order kept: :attr:`Request.is_decoding`
    applied to a whole list at once (the scheduler's hot path; the same rule, written inline)."""
    decoding: list[Request] = []
    prefilling: list[Request] = []
    to_decode, to_prefill = decoding.append, prefilling.append
    for r in requests:
        if r.num_computed_tokens == len(r.token_ids) - 1:
            to_decode(r)
        else:
            to_prefill(r)
    return decoding, prefilling
