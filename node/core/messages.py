"""The engine core's messages: what crosses the boundary between the front end and the core.

The core sees token ids only. In: :class:`AddRequest`, :class:`AbortRequests` (with a reason: a
client gone, or a stop string the front end matched), :class:`Reconfigure` (answered by
:class:`ReconfigureResult`), :class:`Shutdown`. Out: :class:`EngineReady` once the model is
loaded, with the replica's :class:`KVEndpoint` if it has one (or :class:`EngineDead` if it cannot
be loaded), then one :class:`StepOutputs` per step — each request's new token ids and finish
reason, the step's record for telemetry, and now and then the typed
:class:`~cadenza.node.core.stats.EngineStats` — and, before the step, :class:`RequestsQueued`
for the requests that asked to hear when the core's admission control let them in.

Every type is a slotted dataclass with a type tag (:mod:`cadenza.node.core.codec` writes them as
msgpack, with each object an extension of its tag: no pickle, a frame can only ever build these
types). The same objects are passed unencoded when the core runs in a thread of the server's
process. The wire form follows vLLM V1's engine-core messages (``vllm/v1/engine/__init__.py``) in
spirit: token ids in, token ids out, one batch of outputs per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cadenza.node.core.request import RemoteKV, SamplingParams
from cadenza.node.core.stats import EngineStats

ABORT_REASONS = ("abort", "stop")  # a client gone or a caller's abort; a stop string matched


class MessageError(ValueError):
    """A frame that does not decode to a known message (unknown tag, bad fields, too large)."""


# -- in: front end -> core -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a request (token ids already checked against the vocabulary and ``max_model_len``).

    ``arrival_time`` is ``time.monotonic()`` seconds in the front end (the same clock in every
    process of a machine); ``traceparent`` is the W3C trace context of the request's span.
    ``remote_kv``: pull the prompt's KV from this prefill replica; ``publish_kv``: hold the
    prompt's KV for a decode replica to pull (:mod:`cadenza.node.engine.kv_link`).
    ``acknowledge``: say when the core has queued it (:class:`RequestsQueued`; a refusal is a
    :class:`RequestFailure` as always), for a caller that must not answer before that.
    ``n``: sequences to generate from the prompt (OpenAI's ``n``, 1 to
    :data:`~cadenza.node.core.request.MAX_N`), prefilled once (:mod:`cadenza.node.core.siblings`);
    choice ``i`` runs as :func:`~cadenza.node.core.request.choice_request_id` ``(request_id, i)``
    with the seed :func:`~cadenza.node.core.request.choice_seed` gives it, and the call is
    admitted or refused (one failure, for ``request_id``) as a whole.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    traffic_class: str = "interactive"
    tenant: str = "default"
    arrival_time: float = 0.0
    cache_salt: str | None = None
    traceparent: str | None = None
    remote_kv: RemoteKV | None = None
    publish_kv: bool = False
    acknowledge: bool = False
    n: int = 1


@dataclass(frozen=True, slots=True)
class AbortRequests:
    """End requests now and free their KV. ``reason``: ``abort`` (counted as aborted) or ``stop``
    (the front end matched a stop string: the request finishes as stopped)."""

    request_ids: list[str]
    reason: str = "abort"

    def __post_init__(self) -> None:
        if self.reason not in ABORT_REASONS:
            raise MessageError(f"reason: must be one of {', '.join(ABORT_REASONS)}, got {self.reason!r}")


@dataclass(frozen=True, slots=True)
class Reconfigure:
    """Change live knobs (the keys of ``PUT /admin/config``); answered by a ReconfigureResult
    with the same ``call_id``."""

    call_id: int
    changes: dict


@dataclass(frozen=True, slots=True)
class StartCore:
    """The first frame to a core process: its configuration (:meth:`EngineConfig.to_dict`), the EOS
    ids only the tokenizer knows, and its torch threads (None: torch's own)."""

    config: dict
    eos_token_ids: list[int] = field(default_factory=list)
    threads: int | None = None
    threads_reason: str = ""


@dataclass(frozen=True, slots=True)
class Shutdown:  # stop after the current step; requests still live end as aborted
    pass


# -- out: core -> front end ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVEndpoint:
    """Where a replica's KV transfer endpoint listens (:mod:`cadenza.node.engine.kv_link`).

    Attributes:
        host, port: the address decode replicas pull published prompts' KV from.
        boot_id: the endpoint's process boot id (a restart loses its KV; a pull names the boot
            it expects).
    """

    host: str
    port: int
    boot_id: str


@dataclass(frozen=True, slots=True)
class EngineReady:
    """The core has loaded its model; what the front end needs to check and serve requests.
    ``config``: the live configuration as ``GET /admin/config`` shows it; ``kv_transfer``: the KV
    transfer endpoint, None without one."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    block_size: int
    config: dict
    kv_transfer: KVEndpoint | None = None


@dataclass(frozen=True, slots=True)
class EngineDead:
    """The core could not load (``loaded`` False) or its loop died; it exits after this."""

    error: str
    loaded: bool = False
    kind: str = "RuntimeError"  # the exception's type: a config error needs no traceback


@dataclass(frozen=True, slots=True)
class ReconfigureResult:
    """The configuration now in force, or why nothing changed (``error_kind``: ``invalid`` —
    the caller's input, a 400 — or ``internal``, a bug: a 500)."""

    call_id: int
    config: dict | None = None
    error: str | None = None
    error_kind: str | None = None


@dataclass(slots=True)
class RequestDelta:
    """What one step produced for one request: its new token ids (at most one today), the finish
    reason once it is finished (``stop`` | ``length`` | ``abort``), and its counts so far.
    (Not frozen: hundreds are built per step, and a frozen dataclass is slower to build.)

    ``logprobs``, for a request that asked (:attr:`SamplingParams.logprobs`): one entry per new
    token, ``[logprob, [[token_id, logprob], ...]]`` — the token's own log-probability and the
    most likely tokens', most likely first; None otherwise."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    logprobs: list | None = None


@dataclass(frozen=True, slots=True)
class RequestsQueued:
    """The core's admission control let these requests (each added with ``acknowledge``) into
    their queues; sent as soon as their AddRequests are applied, before the next step runs."""

    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """A request that ended without a finish reason: refused on arrival (``admission``, with the
    HTTP status, machine-readable reason and ``Retry-After``), bad input (``invalid``), a bug
    inside the core (``internal``), a failed step (``step``), or a structured output's grammar
    that failed while the request ran (``grammar``: a 400, ``reason`` naming the parameter)."""

    request_id: str
    kind: str
    message: str
    status: int = 500
    reason: str = ""
    retry_after: int | None = None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step as telemetry sees it (seconds of model time, tokens by kind, and the events of
    the requests' spans).

    Attributes:
        admitted: ``(request_id, class, phase, seconds queued)``; phase ``admission`` | ``resume``.
        chunks: ``(request_id, start position, tokens)`` of each prefill chunk.
        preempted: ``(request_id, times so far)``; kv_loads: remote KV loads ended, ``(request_id, tokens
            loaded, tokens left)``.
        decode_context_tokens, prefill_attention_tokens, num_rows, num_sampled: the rest of the
            step's composition (see :class:`~cadenza.node.core.step.SchedulerOutput`), for the
            step log a cost-model calibration reads (``cadenza serve --step-log``).
        host_seconds: the scheduler's own time in the step (schedule, update, outputs), beside ``seconds``.
        cuda_graph: the step was the replay of a captured CUDA graph (else it ran op by op).
    """

    seconds: float
    predicted_seconds: float | None
    num_prefill_tokens: int
    num_decode_tokens: int
    admitted: list[tuple[str, str, str, float]] = field(default_factory=list)
    chunks: list[tuple[str, int, int]] = field(default_factory=list)
    preempted: list[tuple[str, int]] = field(default_factory=list)
    kv_loads: list[tuple[str, int, int]] = field(default_factory=list)
    decode_context_tokens: int = 0
    prefill_attention_tokens: float = 0.0
    num_rows: int = 0
    num_sampled: int = 0
    host_seconds: float = 0.0
    cuda_graph: bool = False


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """Everything one pass of the core's loop produced. ``time``: ``time.monotonic()`` when the
    step ended; ``step`` is None when no step ran (only failures or fresh stats to report)."""

    time: float
    outputs: list[RequestDelta] = field(default_factory=list)
    step: StepRecord | None = None
    stats: EngineStats | None = None
    failures: list[RequestFailure] = field(default_factory=list)
