"""The engine's published counters and gauges, typed: what ``/ready``, ``/metrics`` and the front
end's fast admission checks read.

The core builds an :class:`EngineStats` between steps (at most every few hundred milliseconds,
whenever a request finishes, and when it goes idle) and sends it with the step's outputs, so no
reader ever walks scheduler structures that are changing under it. Counters are monotonic since
start; gauges are the state when the snapshot was taken. No torch here.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler's monotonic counters since start (its gauges are read from its state when
    a snapshot is taken)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_admission_preemptions: int = 0  # of those, to let a waiting request of a higher class in
    num_recomputed_tokens: int = 0  # computed tokens whose KV a preemption dropped
    num_finished: int = 0
    num_aborted: int = 0
    num_cancelled_before_first_token: int = 0
    prefill_tokens_admitted: int = 0  # prefill tokens scheduled into steps
    decode_tokens: int = 0  # decode tokens scheduled into steps
    prefill_tokens_deferred: int = 0  # chunk tokens partial prefills wanted but did not get
    decode_steps_delayed: int = 0  # decodes that could not run in a step
    allocation_failures: int = 0  # KV block allocations that failed (then preempt or wait)
    kv_admission_delays: int = 0  # admissions held back for lack of KV headroom
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    remote_kv_loads: int = 0  # admissions that pulled their prompt's KV from a prefill replica
    remote_kv_tokens: int = 0  # prompt tokens whose KV arrived verified
    remote_kv_failed_loads: int = 0  # loads that failed from some block on (recomputed here)
    remote_kv_recomputed_tokens: int = 0  # tokens of those blocks, computed here instead
    remote_kv_released_holds: int = 0  # queued past the maximum hold: the source released, computed here
    rejected: Counter = field(default_factory=Counter)  # by reason
    prefill_tokens_by_class: Counter = field(default_factory=Counter)
    preemptions_by_class: Counter = field(default_factory=Counter)  # by the victim's class
    prefill_tokens_by_tenant: Counter = field(default_factory=Counter)


@dataclass(slots=True)
class ClassStats:
    """One traffic class.

    Attributes:
        waiting, running: requests queued / running now.
        queue_limit: most requests the class may have waiting (429 beyond).
        oldest_queue_age_s: seconds the oldest waiting request has waited (0 if none).
        prefill_tokens: prefill tokens the class has been given (counter).
        preemptions: requests of the class preempted by recompute (counter, by victim's class).
        drain_per_s: requests leaving the queue per second recently (None: too few to say);
            the front end's ``Retry-After`` comes from it.
    """

    waiting: int = 0
    running: int = 0
    queue_limit: int = 0
    oldest_queue_age_s: float = 0.0
    prefill_tokens: int = 0
    preemptions: int = 0
    drain_per_s: float | None = None

    def retry_after(self, queued: int) -> int:
        """Seconds until ``queued`` requests ahead have drained at the recent rate (1 to 300)."""
        return retry_after(queued, self.drain_per_s)


@dataclass(slots=True)
class TenantLoad:
    """A tenant with a quota and live requests: how many, and its queued prompt tokens (a tenant
    absent from :attr:`EngineStats.tenants` has none of either)."""

    live: int = 0
    queued_prompt_tokens: int = 0


@dataclass(slots=True)
class EngineStats:
    """A snapshot of one engine (see the module docstring); ``to_dict()`` is ``/ready``'s JSON.

    Block counts are KV blocks; ``*_tokens`` are tokens; times are seconds or, where the name
    says so, milliseconds.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_reserved: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_free: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_admission_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_cancelled_before_first_token: int = 0
    prefill_tokens_admitted: int = 0
    decode_tokens: int = 0
    prefill_tokens_deferred: int = 0
    decode_steps_delayed: int = 0
    allocation_failures: int = 0
    kv_admission_delays: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_evictions: int = 0
    remote_kv_loads: int = 0  # prompts whose KV was pulled from a prefill replica
    remote_kv_tokens: int = 0
    remote_kv_failed_loads: int = 0
    remote_kv_recomputed_tokens: int = 0
    remote_kv_released_holds: int = 0  # sources released unpulled: queued here past the maximum hold
    # the replica's KV transfer endpoint (all 0 / None without one): both sides' traffic, failures
    # by kind (pulls made here: TransferError kinds; pulls served: the error codes sent), and the
    # disaggregation rule it computes (:meth:`KVLink.rule`: a header value) and its threshold
    # with an idle prefill replica (the threshold also without an endpoint, over the assumed link:
    # :meth:`EngineCore.min_prompt_tokens`)
    kv_transfer_published: int = 0  # prompts held for a decode replica
    kv_transfer_sent_bytes: int = 0
    kv_transfer_received_bytes: int = 0
    kv_transfer_expired: int = 0  # leases that ran out before the decode side released them
    kv_transfer_pull_failures: dict[str, int] = field(default_factory=dict)
    kv_transfer_serve_failures: dict[str, int] = field(default_factory=dict)
    kv_transfer_bandwidth: float | None = None  # bytes/s the pulls measured
    kv_transfer_min_prompt_tokens: int | None = None
    kv_transfer_rule: str | None = None
    rejected: dict[str, int] = field(default_factory=dict)  # refused requests, by reason
    cost_model_error: float | None = None  # mean relative error of the step-time model
    classes: dict[str, ClassStats] = field(default_factory=dict)
    tenants: dict[str, TenantLoad] = field(default_factory=dict)  # tenants with a quota and live requests
    step_time_ms_mean: float | None = None  # over the last 1,024 steps
    step_time_ms_p99: float | None = None

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0 with no blocks)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def with_rejected(self, extra: dict[str, int]) -> "EngineStats":
        """A copy whose ``rejected`` also counts ``extra`` (refusals the front end made itself)."""
        if not extra:
            return self
        merged = dict(self.rejected)
        for reason, n in extra.items():
            merged[reason] = merged.get(reason, 0) + n
        return dataclasses.replace(self, rejected=merged)

    def to_dict(self) -> dict:
        """The JSON shape of ``/ready`` (step times only once some step has run)."""
        out = {f: getattr(self, f) for f in self.__slots__ if f not in ("classes", "tenants")}
        out["classes"] = {name: {f: getattr(c, f) for f in c.__slots__} for name, c in self.classes.items()}
        out["tenants"] = {name: {f: getattr(t, f) for f in t.__slots__} for name, t in self.tenants.items()}
        for key in ("step_time_ms_mean", "step_time_ms_p99"):
            if out[key] is None:
                del out[key]
        return out


def retry_after(queued: int, per_second: float | None) -> int:
    """Seconds until ``queued`` requests have drained at ``per_second`` (1 to 300; 1 when the
    rate is unknown)."""
    if not per_second:
        return 1
    return int(min(300, max(1, math.ceil(queued / per_second))))


def snapshot_of(sched) -> EngineStats:
    """A :class:`~cadenza.node.core.scheduler.Scheduler`'s counters and gauges now: queues per
    class, KV blocks by state, scheduler counters (its :meth:`snapshot`)."""
    now = sched.clock()
    bm, s = sched.block_manager, sched.stats
    running = Counter(r.traffic_class for r in sched.running)
    classes = {}
    for name, queue in sched.queues.items():
        oldest = queue.oldest()
        classes[name] = ClassStats(
            len(queue), running[name], sched.queue_limit(name),
            round(now - oldest.arrival_time, 6) if oldest else 0.0,
            s.prefill_tokens_by_class[name], s.preemptions_by_class[name], sched.drain[name].per_second(now))
    # Only tenants with live requests cost anything here: a snapshot is O(live tenants), never
    # O(configured tenants) (a tenant with a quota and nothing live has no load to show).
    tenants = {}
    policy = sched.policy
    for name, live in sched.tenant_live.items():
        tenant = policy.tenant(name)
        if tenant.max_concurrent is not None or tenant.max_queued_prompt_tokens is not None:
            tenants[name] = TenantLoad(live, sum(q.queued_prompt_tokens.get(name, 0) for q in sched.queues.values()))
    error = sched.cost_model.mean_relative_error
    return EngineStats(
        num_running=sched.num_running, num_waiting=sched.num_waiting,
        kv_blocks_total=bm.num_blocks, kv_blocks_used=bm.num_used_blocks,
        kv_blocks_reserved=bm.num_reserved_blocks, kv_blocks_cached=bm.num_cached_free_blocks,
        kv_blocks_free=bm.num_plain_free_blocks, num_steps=s.num_steps, num_preemptions=s.num_preemptions,
        num_admission_preemptions=s.num_admission_preemptions, num_recomputed_tokens=s.num_recomputed_tokens,
        num_finished=s.num_finished, num_aborted=s.num_aborted,
        num_cancelled_before_first_token=s.num_cancelled_before_first_token,
        prefill_tokens_admitted=s.prefill_tokens_admitted, decode_tokens=s.decode_tokens,
        prefill_tokens_deferred=s.prefill_tokens_deferred, decode_steps_delayed=s.decode_steps_delayed,
        allocation_failures=s.allocation_failures, kv_admission_delays=s.kv_admission_delays,
        prefix_cache_queried_tokens=s.prefix_cache_queried_tokens,
        prefix_cache_hit_tokens=s.prefix_cache_hit_tokens, prefix_cache_evictions=bm.num_evictions,
        remote_kv_loads=s.remote_kv_loads, remote_kv_tokens=s.remote_kv_tokens,
        remote_kv_failed_loads=s.remote_kv_failed_loads, remote_kv_recomputed_tokens=s.remote_kv_recomputed_tokens,
        remote_kv_released_holds=s.remote_kv_released_holds,
        rejected=dict(s.rejected), cost_model_error=round(error, 4) if error is not None else None,
        classes=classes, tenants=tenants,
    )
