"""One simulated engine: cadenza's real scheduler and KV block manager, stepping on a virtual clock.

Only the forward pass is replaced: each step's rows go to the roofline
(:mod:`cadenza.sim.roofline`), the virtual clock advances by its predicted seconds, and every row
that samples gets a synthetic token. Everything else — token budget, chunking, decode first,
traffic classes, fair queuing, admission control, prefix caching, preemption, the online cost
model — is the engine's own code (:class:`cadenza.node.core.scheduler.Scheduler`), unchanged.
Requests end at their trace's output length (``max_tokens``, EOS ignored).

Synthetic token ids are a pure function of the request and position, so runs are deterministic,
and a prompt shares cached KV with another only where the simulation gave them the same ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cadenza.node.core.block_manager import KVBlockManager
from cadenza.node.core.config import SchedulerConfig
from cadenza.node.core.remote_kv import KVConnector
from cadenza.node.core.request import RemoteKV, Request, SamplingParams
from cadenza.node.core.scheduler import Scheduler
from cadenza.node.core.step import SchedulerOutput
from cadenza.sim.roofline import Roofline, StepComposition


class VirtualClock:
    """Seconds since the simulation began; callable, as the scheduler's injected clock."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def composition(out: SchedulerOutput) -> StepComposition:
    """What the roofline needs of a scheduled step."""
    return StepComposition(out.num_prefill_tokens, out.num_decode_tokens, out.decode_context_tokens,
                           out.prefill_attention_tokens, out.num_rows, out.num_sampled)


def synthetic_token(request_index: int, position: int, vocab_size: int) -> int:
    """A deterministic token id for ``position`` of request ``request_index`` (a multiplicative
    hash: distinct requests rarely share a block, as distinct real prompts rarely do)."""
    return (request_index * 2654435761 + position * 40503 + 17) % vocab_size


@dataclass
class RequestTimes:
    """A simulated request's timeline (virtual seconds).

    Attributes:
        arrival_s: when it reached the replica.
        token_s: when each output token was produced (the end of the step that sampled it).
        finished_s: when its last token was produced (None while live).
    """

    arrival_s: float
    token_s: list[float] = field(default_factory=list)
    finished_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.token_s[0] - self.arrival_s if self.token_s else None

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        return [b - a for a, b in zip(self.token_s, self.token_s[1:])]


class SimReplica:
    """A replica whose steps take the roofline's time.

    Args:
        config: the engine's scheduler knobs (as ``cadenza serve`` takes them); ``max_model_len``
            must be resolved.
        roofline: the model on its hardware; the KV pool is what it says fits.
        clock: the shared virtual clock.
        block_size: tokens per KV block.
        memory_utilization: share of device memory the engine may use.
        scheduler_cls: the scheduler (cadenza's, or a baseline of :mod:`cadenza.sim.baselines`).
        num_blocks: KV blocks of the pool (as ``--num-kv-blocks`` / ``--kv-cache-gib`` fix them);
            None: what the roofline says fits at ``memory_utilization``.
        connector: the scheduler's KV connector (a disaggregated fleet's decode replicas).

    Raises:
        ValueError: the model does not fit, or ``max_model_len`` is unresolved.
    """

    def __init__(self, config: SchedulerConfig, roofline: Roofline, clock: VirtualClock, block_size: int = 16,
                 memory_utilization: float = 0.9, scheduler_cls: type[Scheduler] = Scheduler,
                 num_blocks: int | None = None, connector: KVConnector | None = None) -> None:
        if num_blocks is None:
            num_blocks = roofline.kv_capacity_tokens(memory_utilization) // block_size
        self.block_manager = KVBlockManager(num_blocks, block_size, prefix_caching=config.prefix_caching)
        self.scheduler = scheduler_cls(config, self.block_manager, clock=clock, connector=connector)
        self.roofline, self.clock = roofline, clock
        self.vocab_size = roofline.dims.vocab_size
        self.times: dict[str, RequestTimes] = {}
        self._index: dict[str, int] = {}
        self.busy_until = clock.now  # the end of the step in flight
        self.steps = 0
        self.kv_usage_s = 0.0  # KV share in use, integrated over busy seconds (at each step's end)
        self.kv_peak = 0.0
        self._started = clock.now
        self._in_flight: SchedulerOutput | None = None
        self.last_step: SchedulerOutput | None = None

    def add_request(self, request_id: str, index: int, prompt_len: int, output_len: int, arrival_s: float,
                    traffic_class: str = "interactive", tenant: str = "default",
                    remote_kv: RemoteKV | None = None) -> Request:
        """Queue a request of the trace that arrived at ``arrival_s`` (at most ``clock.now``: one
        that came during a step is queued when the step ends); its ``index`` seeds its tokens;
        ``remote_kv``: its prompt is prefilled elsewhere (loaded through the connector).

        Raises:
            AdmissionError: refused as the engine would (429 under overload, 400 too long).
        """
        prompt = [synthetic_token(index, p, self.vocab_size) for p in range(prompt_len)]
        req = Request(request_id, prompt, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True),
                      arrival_time=arrival_s, traffic_class=traffic_class, tenant=tenant, remote_kv=remote_kv)
        self.scheduler.add_request(req)
        self.times[request_id] = RequestTimes(arrival_s)
        self._index[request_id] = index
        return req

    def begin_step(self) -> float | None:
        """Schedule a step at ``clock.now``; return the virtual time it ends (None: nothing can
        run). Requests may be added while it is in flight; they wait for the next step, as in the
        engine. :meth:`end_step` applies it."""
        if self._in_flight is not None:
            raise RuntimeError("a step is already in flight")
        out = self.scheduler.schedule()
        if out.is_empty:
            return None
        seconds = self.roofline.step_time(composition(out)).total_s
        self.scheduler.observe_step_time(out, seconds)
        self._in_flight = out
        self._started = self.clock.now
        self.busy_until = self.clock.now + seconds
        return self.busy_until

    def end_step(self) -> list[Request]:
        """Apply the step in flight at its end time: synthetic tokens for its sampling rows.
        Returns the requests that sampled a token in it (finished ones among them)."""
        out, self._in_flight = self._in_flight, None
        if out is None:
            raise RuntimeError("no step in flight")
        index, vocab, end = self._index, self.vocab_size, self.busy_until
        tokens = [synthetic_token(index[r.request_id], len(r.token_ids), vocab) for r in out.decodes]
        tokens += [synthetic_token(index[row.request.request_id], len(row.request.token_ids), vocab)
                   for row in out.prefill_rows if row.sample]
        sampled = self.scheduler.update_from_output(out, tokens)
        for req in sampled:
            times = self.times[req.request_id]
            times.token_s.append(end)
            if req.is_finished:
                times.finished_s = end
        self.steps += 1
        self.last_step = out
        bm = self.block_manager
        usage = bm.num_used_blocks / bm.num_blocks
        self.kv_usage_s += usage * (end - self._started)
        self.kv_peak = max(self.kv_peak, usage)
        return sampled

    def step(self) -> SchedulerOutput | None:
        """One whole step from ``clock.now`` (begin and end; the caller moves the clock to
        ``busy_until``). None when nothing can run."""
        if self.begin_step() is None:
            return None
        self.end_step()
        return self.last_step

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()
