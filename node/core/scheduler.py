"""Chunked-prefill scheduler with traffic classes: decode first, then prefill by class policy.

Each step spends at most ``token_budget`` tokens:

1. **Decode** (the protected part): one token for every running request whose prompt is done.
   Running requests are capped at ``min(max_num_seqs, token_budget)`` so this fits. A decode that
   needs a KV block when none is free preempts by recompute — the lowest class first, the newest
   within a class, never a request already preempted more than ``max_preemptions`` times. A
   victim already scheduled in this step is unscheduled and its tokens refunded.
2. **Prefill** (the flexible part, :mod:`cadenza.node.core.prefill`): what is left, optionally shrunk
   so the cost model's predicted step time stays within ``step_time_target_ms``, shared by class
   policy (priority, minimum shares, caps, aging) and, within a class, by tenant weights. A
   waiting request that lacks a running slot or KV blocks displaces running requests of strictly
   lower classes (preempted by recompute, with the same victim order and protection).

The unifying rule (vLLM V1): a request only has ``num_computed_tokens`` catching up with
``num_tokens``; a row of ``n`` tokens starting at ``num_computed_tokens`` either leaves the request
mid-prompt or reaches ``num_tokens`` and samples one token. No torch here.

References: Sarathi-Serve (Agrawal et al., OSDI 2024) for stall-free chunked prefill; vLLM's
``vllm/v1/core/sched/scheduler.py`` for the computed-token rule and priority preemption.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cadenza.node.core.admission import AdmissionError, DrainRate, check_admission
from cadenza.node.core.block_manager import KVBlockManager
from cadenza.node.core.config import SchedulerConfig
from cadenza.node.core.cost_model import StepCostModel, StepFeatures
from cadenza.node.core.policy import CLASS_RANK, CLASSES, QUEUE_DEPTH_PER_SLOT, PolicyError, check_class, check_tenant
from cadenza.node.core.queues import ClassQueue
from cadenza.node.core.request import Request, RequestStatus


def _arrival(req: Request) -> float:
    return req.arrival_time


class ScheduledRow(NamedTuple):
    """One request's slice of a step: tokens ``[start, start + num_tokens)`` are computed.

    ``sample`` is True when the row reaches the end of the request's tokens, so the model runner
    samples the next token from the row's last position. ``block_table`` is the request's table
    as the block manager holds it (the runner reads it even if the request is aborted mid-step).
    """

    request: Request
    start: int
    num_tokens: int
    sample: bool
    block_table: list[int]


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes: decode rows first, then prefill rows."""

    rows: list[ScheduledRow]
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    decode_context_tokens: int = 0
    prefill_attention_tokens: float = 0.0
    preempted: list[Request] = field(default_factory=list)
    prefill_rows: list[ScheduledRow] = field(default_factory=list)
    admitted: list[tuple[Request, str, float]] = field(default_factory=list)  # (request, phase, seconds queued)
    predicted_seconds: float | None = None  # the cost model's step time for these rows (None uncalibrated)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        return not self.rows

    def features(self) -> StepFeatures:
        """The step's composition, for the cost model."""
        return StepFeatures(self.num_prefill_tokens, self.num_decode_tokens, self.decode_context_tokens,
                            self.prefill_attention_tokens)


_new_row = tuple.__new__  # builds a ScheduledRow without a Python-level __new__ call (hot path)


class Step:
    """A step being built: its rows, what is left of the budget, refunds on preemption.

    Decode rows are only appended to ``out.rows`` (the hot path: hundreds per step); prefill rows
    are also indexed in ``prefills`` by request id.
    """

    def __init__(self, budget: int) -> None:
        self.out = SchedulerOutput(rows=[])
        self.budget_left = budget
        self.prefills: dict[str, ScheduledRow] = {}

    def add_prefill(self, req: Request, start: int, n: int, table: list[int]) -> None:
        row = _new_row(ScheduledRow, (req, start, n, start + n == len(req.token_ids), table))
        self.out.rows.append(row)
        self.prefills[req.request_id] = row
        self.budget_left -= n
        self.out.num_prefill_tokens += n
        self.out.prefill_attention_tokens += n * (start + n / 2)

    def unschedule(self, req: Request) -> tuple[int, bool]:
        """Remove ``req``'s row (a preemption victim): ``(tokens refunded, was a prefill chunk)``."""
        out = self.out
        row = self.prefills.pop(req.request_id, None)
        if row is not None:
            out.rows.remove(row)
            out.num_prefill_tokens -= row.num_tokens
            out.prefill_attention_tokens -= row.num_tokens * (row.start + row.num_tokens / 2)
            self.budget_left += row.num_tokens
            return row.num_tokens, True
        for i, row in enumerate(out.rows):
            if row.request is req:  # a decode row
                del out.rows[i]
                out.num_decode_tokens -= 1
                out.decode_context_tokens -= row.start + 1
                self.budget_left += 1
                return 1, False
        return 0, False


@dataclass(slots=True)
class SchedulerStats:
    """Monotonic counters since start (gauges are computed by :meth:`Scheduler.snapshot`)."""

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
    rejected: Counter = field(default_factory=Counter)  # by reason
    prefill_tokens_by_class: Counter = field(default_factory=Counter)
    preemptions_by_class: Counter = field(default_factory=Counter)  # by the victim's class
    prefill_tokens_by_tenant: Counter = field(default_factory=Counter)


class TokenUpdate(NamedTuple):
    """A token sampled in a step, and the finished status it caused (None if still running)."""

    request: Request
    token_id: int
    finished: RequestStatus | None


class Scheduler:
    """Builds each step's mixed batch and applies its results.

    Args:
        config: budget, chunk size, request limits and the class/tenant policy.
        block_manager: the KV block pool this scheduler allocates from.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, config: SchedulerConfig, block_manager: KVBlockManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if config.max_model_len is None:
            raise ValueError("max_model_len: the scheduler needs a resolved value (see resolve_max_model_len)")
        self.block_manager = block_manager
        self.clock = clock
        self.queues = {c: ClassQueue(c) for c in CLASSES}
        self.running: list[Request] = []  # sorted by arrival time, oldest first
        self.requests: dict[str, Request] = {}
        self.tenant_live: Counter = Counter()
        self.drain = {c: DrainRate() for c in CLASSES}
        self.cost_model = StepCostModel()
        self.step_seconds = 0.0  # moving average of measured step time (aging look-ahead)
        self.stats = SchedulerStats()
        self.reconfigure(config)

    def reconfigure(self, config: SchedulerConfig) -> None:
        """Apply new knobs from the next step (``max_model_len`` cannot change live).

        Raises:
            ValueError: a different ``max_model_len``.
        """
        if getattr(self, "config", None) is not None and config.max_model_len != self.config.max_model_len:
            raise ValueError("max_model_len: cannot change on a running engine")
        self.config = config
        self.policy = config.policy
        self.block_manager.prefix_caching = config.prefix_caching
        self.watermark_blocks = math.ceil(self.policy.watermark * self.block_manager.num_blocks)

    # -- queue management ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request in its class, or refuse it.

        Raises:
            ValueError: the id is already live.
            AdmissionError: refused by admission control (400/413/429, see :mod:`cadenza.node.core.admission`).
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already live")
        try:
            self.check_admission(request)
        except AdmissionError as exc:
            self.stats.rejected[exc.reason] += 1
            raise
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.tenant_live[request.tenant] += 1
        self.queues[request.traffic_class].push(request)

    def check_admission(self, request: Request) -> None:
        """Would :meth:`add_request` refuse this request now? Only reads state, so another thread
        (the HTTP front) may call it to refuse at once; ``add_request`` checks again.

        Raises:
            AdmissionError: as :meth:`add_request`.
        """
        try:
            request.traffic_class = check_class(request.traffic_class)  # canonical: lower-case
            check_tenant(request.tenant)
        except PolicyError as exc:
            raise AdmissionError(400, str(exc), "bad_class_or_tenant") from None
        queue = self.queues[request.traffic_class]
        check_admission(request, self.policy, self.config.max_model_len, len(queue),
                        self.tenant_live.get(request.tenant, 0), queue.queued_prompt_tokens.get(request.tenant, 0),
                        self.drain[request.traffic_class], self.clock(), self.queue_limit(request.traffic_class))

    def queue_limit(self, cls: str) -> int:
        """Most requests class ``cls`` may have waiting: its policy's ``max_queue_depth``, else
        ``QUEUE_DEPTH_PER_SLOT[cls] × max_running`` (overload is a 429, not minutes in a queue)."""
        depth = self.policy.classes[cls].max_queue_depth
        return depth if depth is not None else QUEUE_DEPTH_PER_SLOT[cls] * self.config.max_running

    def abort_request(self, request_id: str) -> Request | None:
        """Drop a live request now and free its KV blocks; None if it is not live."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.queues[request.traffic_class].pop(request)
        if request.num_output_tokens == 0:
            self.stats.num_cancelled_before_first_token += 1
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self.stats.num_aborted += 1
        return request

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a running request for a reason found outside the scheduler (a stop string)."""
        request = self.requests.get(request_id)
        if request is not None and request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.queues.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose the rows of the next step; never more than ``token_budget`` tokens."""
        from cadenza.node.core.prefill import PrefillAdder

        self.stats.num_steps += 1
        step = Step(self.config.token_budget)
        failures = self.stats.allocation_failures
        self._schedule_decodes(step)
        PrefillAdder(self, step).run()
        if not step.out.rows and self.running and self.stats.allocation_failures > failures:
            # Every running request is blocked on KV and none may be preempted (all protected):
            # break the deadlock with the lowest-priority one.
            self._preempt(max(self.running, key=self._victim_key), step)
        self.stats.decode_tokens += step.out.num_decode_tokens
        step.out.prefill_rows = list(step.prefills.values())
        if step.out.rows:
            step.out.predicted_seconds = self.cost_model.predict(step.out.features())
        return step.out

    def _schedule_decodes(self, step: Step) -> None:
        bm = self.block_manager
        tables = bm.block_tables
        out = step.out
        rows = out.rows
        decodes = [r for r in self.running if r.num_computed_tokens == len(r.token_ids) - 1]
        if len(decodes) > step.budget_left:  # the budget was lowered live: highest classes first
            decodes.sort(key=lambda r: (CLASS_RANK[r.traffic_class], r.arrival_time))
        running = RequestStatus.RUNNING
        bs, append, new_row = bm.block_size, rows.append, _new_row
        budget, count, context = step.budget_left, 0, 0  # written back to the step before any preemption
        for req in decodes:
            if req.status is not running:
                continue  # preempted by a decode before it
            if budget <= 0:
                self.stats.decode_steps_delayed += 1
                continue
            n = len(req.token_ids)
            table = tables[req.request_id]
            if n > len(table) * bs and not bm.append_slot(req.request_id, n):
                step.budget_left, out.num_decode_tokens, out.decode_context_tokens = (
                    budget, out.num_decode_tokens + count, out.decode_context_tokens + context)
                count = context = 0
                made_room = self._make_room(req, n, step)  # may unschedule (refund) earlier rows
                budget = step.budget_left
                if not made_room:
                    continue
            append(new_row(ScheduledRow, (req, n - 1, 1, True, table)))
            budget -= 1
            count += 1
            context += n
        step.budget_left = budget
        out.num_decode_tokens += count
        out.decode_context_tokens += context

    def _make_room(self, req: Request, n: int, step: Step) -> bool:
        """Preempt until ``req`` gets the block its decode needs; False if it must wait instead."""
        while not self.block_manager.append_slot(req.request_id, n):
            self.stats.allocation_failures += 1
            victim = self.victim_for(req, include_self=True)
            if victim is None:
                self.stats.decode_steps_delayed += 1
                return False
            self._preempt(victim, step)
            if victim is req:
                return False
        return True

    def cache_salt(self, req: Request) -> bytes:
        """The prefix-cache salt of ``req``: its tenant when the policy isolates tenants, and the
        client's ``cache_salt``; requests share cached blocks only under equal salts."""
        isolate = self.policy.tenant_cache_isolation
        if not isolate and not req.cache_salt:
            return b""
        tenant = f"tenant={req.tenant}" if isolate else ""
        salt = f"salt={req.cache_salt}" if req.cache_salt else ""
        return f"{tenant}\0{salt}".encode()

    # -- preemption ---------------------------------------------------------------------------

    def protected(self, req: Request) -> bool:
        return req.num_preemptions > self.policy.max_preemptions

    @staticmethod
    def _victim_key(req: Request) -> tuple[int, float]:
        return CLASS_RANK[req.traffic_class], req.arrival_time

    def victim_for(self, requester: Request, include_self: bool) -> Request | None:
        """The request to preempt so ``requester`` can get a KV block, or None.

        Candidates are running requests of a lower class, or of the same class and newer, that
        are not protected; the lowest class and then the newest go first. ``include_self`` lets
        the requester be its own victim when it is the least important (it then waits).
        """
        own = self._victim_key(requester)
        best, best_key = None, None
        for req in self.running:
            if req is requester:
                if not include_self or self.protected(req):
                    continue
            elif self._victim_key(req) < own or self.protected(req):
                continue
            key = self._victim_key(req)
            if best_key is None or key > best_key:
                best, best_key = req, key
        return best

    def _preempt(self, req: Request, step: Step) -> None:
        step.unschedule(req)
        self.running.remove(req)
        self.block_manager.free(req.request_id, keep_hashes=True)
        self.stats.num_preemptions += 1
        self.stats.preemptions_by_class[req.traffic_class] += 1
        self.stats.num_recomputed_tokens += req.num_computed_tokens
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.preempted_time = self.clock()
        req.status = RequestStatus.PREEMPTED
        self.queues[req.traffic_class].push_resume(req)
        step.out.preempted.append(req)

    def start_running(self, req: Request, step: Step) -> None:
        """Move a queued request into the running set (the prefill adder admitted it)."""
        self.queues[req.traffic_class].pop(req)
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=_arrival)
        now = self.clock()
        if req.admitted_time is None:
            req.admitted_time = now
            step.out.admitted.append((req, "admission", now - req.arrival_time))
        else:
            step.out.admitted.append((req, "resume", now - (req.preempted_time or now)))
            req.preempted_time = None
        self.drain[req.traffic_class].record(now)

    # -- applying a step ----------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: Sequence[int]) -> list[TokenUpdate]:
        """Apply a finished step: advance computed tokens, append sampled tokens, finish requests.

        Full blocks whose KV the step wrote are registered in the prefix cache here, never
        earlier.

        Args:
            output: the step's rows, as returned by :meth:`schedule`.
            sampled_token_ids: one token per row with ``sample`` set, in row order.

        Returns:
            One :class:`TokenUpdate` per sampled token, skipping requests aborted meanwhile.
        """
        updates: list[TokenUpdate] = []
        append = updates.append
        tokens = iter(sampled_token_ids)
        running = RequestStatus.RUNNING
        bm = self.block_manager
        caching, bs = bm.prefix_caching, bm.block_size
        for req, _start, n, sample, _table in output.rows:
            token = next(tokens) if sample else None
            if req.status is not running:
                continue  # aborted while the step ran
            computed = req.num_computed_tokens = req.num_computed_tokens + n
            if caching and (n > 1 or computed % bs == 0):
                bm.commit(req.request_id, req.token_ids, computed, self.cache_salt(req))
            if token is None:
                continue
            finished = req.append_token(token)
            if finished is not None:
                self.running.remove(req)
                self._finish(req, finished)
                self.stats.num_finished += 1
            append(_new_row(TokenUpdate, (req, token, finished)))
        return updates

    def observe_step_time(self, output: SchedulerOutput, seconds: float) -> None:
        """Feed a measured step duration to the cost model and the aging look-ahead."""
        self.cost_model.observe(output.features(), seconds)
        self.step_seconds = seconds if not self.step_seconds else 0.9 * self.step_seconds + 0.1 * seconds

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.block_manager.free(req.request_id)
        del self.requests[req.request_id]
        self.tenant_live[req.tenant] -= 1
        if not self.tenant_live[req.tenant]:
            # Nothing of this tenant is live: forget its fair-queuing service, so a returning
            # tenant starts level with those waiting (neither credit nor debt) and state stays
            # bounded by the tenants that are active.
            del self.tenant_live[req.tenant]
            for queue in self.queues.values():
                queue.service.pop(req.tenant, None)

    # -- reporting ----------------------------------------------------------------------------

    def reserved_blocks(self) -> int:
        """Blocks that admitted prompts still need to finish their prefill."""
        bm, bs = self.block_manager, self.block_manager.block_size
        total = 0
        for req in self.running:
            if req.num_computed_tokens < len(req.token_ids) - 1:
                total += max(0, -(-len(req.token_ids) // bs) - len(bm.block_tables.get(req.request_id, ())))
        return total

    def snapshot(self) -> dict:
        """Counters and gauges: queues per class, KV blocks by state, scheduler counters."""
        now = self.clock()
        bm, s = self.block_manager, self.stats
        classes = {}
        for name, queue in self.queues.items():
            oldest = queue.oldest()
            classes[name] = {
                "waiting": len(queue),
                "running": sum(1 for r in self.running if r.traffic_class == name),
                "queue_limit": self.queue_limit(name),
                "oldest_queue_age_s": round(now - oldest.arrival_time, 6) if oldest else 0.0,
                "prefill_tokens": s.prefill_tokens_by_class[name],
                "preemptions": s.preemptions_by_class[name],
            }
        error = self.cost_model.mean_relative_error
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_reserved": self.reserved_blocks(),
            "kv_blocks_cached": bm.num_cached_free_blocks,
            "kv_blocks_free": bm.num_plain_free_blocks,
            "num_steps": s.num_steps,
            "num_preemptions": s.num_preemptions,
            "num_admission_preemptions": s.num_admission_preemptions,
            "num_recomputed_tokens": s.num_recomputed_tokens,
            "num_finished": s.num_finished,
            "num_aborted": s.num_aborted,
            "num_cancelled_before_first_token": s.num_cancelled_before_first_token,
            "prefill_tokens_admitted": s.prefill_tokens_admitted,
            "decode_tokens": s.decode_tokens,
            "prefill_tokens_deferred": s.prefill_tokens_deferred,
            "decode_steps_delayed": s.decode_steps_delayed,
            "allocation_failures": s.allocation_failures,
            "kv_admission_delays": s.kv_admission_delays,
            "prefix_cache_queried_tokens": s.prefix_cache_queried_tokens,
            "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
            "prefix_cache_evictions": bm.num_evictions,
            "rejected": dict(s.rejected),
            "cost_model_error": round(error, 4) if error is not None else None,
            "classes": classes,
        }
