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

from cadenza.node.core import siblings
from cadenza.node.core.admission import AdmissionError, DrainRate, canonicalize_class_and_tenant, check_admission
from cadenza.node.core.block_manager import KVBlockManager
from cadenza.node.core.config import SchedulerConfig
from cadenza.node.core.cost_model import StepCostModel
from cadenza.node.core.decode import schedule_decodes
from cadenza.node.core.policy import CLASSES, QUEUE_DEPTH_PER_SLOT
from cadenza.node.core.preemption import Preemption, victim_key
from cadenza.node.core.prefill import PrefillAdder, PrefillContext
from cadenza.node.core.queues import ClassQueue
from cadenza.node.core.remote_kv import KVConnector, RemoteLoads
from cadenza.node.core.request import Request, RequestStatus
from cadenza.node.core.scheduler_interface import SchedulerInterface
from cadenza.node.core.stats import EngineStats, SchedulerStats, snapshot_of
from cadenza.node.core.step import SchedulerOutput, Step


def _arrival(req: Request) -> float:
    return req.arrival_time


class Scheduler(SchedulerInterface):
    """Builds each step's mixed batch and applies its results (the contract:
    :class:`~cadenza.node.core.scheduler_interface.SchedulerInterface`).

    Args:
        config: budget, chunk size, request limits and the class/tenant policy.
        block_manager: the KV block pool this scheduler allocates from.
        clock: seconds, monotonic (tests pass a fake one).
        connector: loads prompt KV prefilled on another replica (None: every prompt is
            computed here; see :mod:`cadenza.node.core.remote_kv`).
    """

    def __init__(self, config: SchedulerConfig, block_manager: KVBlockManager,
                 clock: Callable[[], float] = time.monotonic, connector: KVConnector | None = None) -> None:
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
        self.preemption = Preemption(self.running, block_manager, self.queues, self.stats, clock)
        self.remote = RemoteLoads(connector, block_manager, self.stats)
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
        self.preemption.max_preemptions = config.policy.max_preemptions
        self.watermark_blocks = math.ceil(self.policy.watermark * self.block_manager.num_blocks)

    # -- queue management ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request in its class, or refuse it (:meth:`add_requests` of one)."""
        self.add_requests([request])

    def add_requests(self, requests: list[Request]) -> None:
        """Queue one call's sequences (OpenAI ``n``: :mod:`cadenza.node.core.siblings`), or refuse them all.

        Raises:
            ValueError: an id is already live.
            AdmissionError: refused by admission control counting every sequence (400/413/429).
        """
        if live := [r.request_id for r in requests if r.request_id in self.requests]:
            raise ValueError(f"request id {live[0]!r} is already live")
        try:
            self.check_admission(requests[0], len(requests))
        except AdmissionError as exc:
            self.stats.rejected[exc.reason] += 1
            raise
        siblings.link(requests)  # one group, the leader's canonical class
        for request in requests:
            request.status = RequestStatus.WAITING
            self.requests[request.request_id] = request
            self.tenant_live[request.tenant] += 1
            self.queues[request.traffic_class].push(request)
            self.remote.hold(request, self.clock())  # a source's lease runs on while it waits here

    def check_admission(self, request: Request, count: int = 1) -> None:
        """Would :meth:`add_requests` refuse ``count`` sequences of it now? Reads state only.

        Raises:
            AdmissionError: as :meth:`add_request`.
        """
        canonicalize_class_and_tenant(request)
        queue = self.queues[request.traffic_class]
        drain, now = self.drain[request.traffic_class], self.clock()
        check_admission(request, self.policy, self.config.max_model_len, len(queue),
                        self.tenant_live.get(request.tenant, 0), queue.queued_prompt_tokens.get(request.tenant, 0),
                        lambda queued: drain.retry_after(queued, now), self.queue_limit(request.traffic_class), count)

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
        if request.num_output_tokens == 0:
            self.stats.num_cancelled_before_first_token += 1
        self._end(request, RequestStatus.FINISHED_ABORTED)
        self.stats.num_aborted += 1
        return request

    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """End a live request for a reason found outside the scheduler (a stop string)."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._end(request, status)
        self.stats.num_finished += 1
        return True

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
        self.stats.num_steps += 1
        if self.remote.held:  # queued past the bound: their prompts are computed here
            self.remote.release_overdue(self.clock())
        step = Step(self.config.token_budget)
        failures = self.stats.allocation_failures
        prefilling = schedule_decodes(step, self.running, self.block_manager, self.preemption, self.stats)
        running = RequestStatus.RUNNING  # a decode may have been preempted just now
        interactive = any(r.traffic_class == "interactive" and r.status is running and r.is_decoding
                          for r in self.running)
        PrefillAdder(self._prefill_context(prefilling, interactive), step).run()
        if step.out.is_empty and self.running and self.stats.allocation_failures > failures:
            # Every running request is blocked on KV and none may be preempted (all protected):
            # break the deadlock with the lowest-priority one.
            self.preemption.preempt(max(self.running, key=victim_key), step)
        self.stats.decode_tokens += step.out.num_decode_tokens
        if not step.out.is_empty:
            step.out.predicted_seconds = self.cost_model.predict(step.out.features())
        return step.out

    def _prefill_context(self, prefilling: list[Request], interactive_decoding: bool) -> PrefillContext:
        return PrefillContext(self.config, self.running, prefilling, interactive_decoding, self.queues, self.block_manager, self.preemption,
                              self.cost_model, self.stats, self.clock(), self.step_seconds, self.watermark_blocks,
                              self.cache_salt, self.start_running, self.remote)

    def cache_salt(self, req: Request) -> bytes:
        """``req``'s prefix-cache salt (:meth:`Policy.cache_salt`)."""
        return self.policy.cache_salt(req.tenant, req.cache_salt)

    def start_running(self, req: Request, step: Step, loading: bool = False) -> None:
        """Move a queued request into the running set (the prefill adder admitted it), or, when
        it is ``loading`` remote KV, out of its queue only (it runs once the KV is in)."""
        self.queues[req.traffic_class].pop(req)
        if not loading:
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

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: Sequence[int]) -> list[Request]:
        """Apply a finished step: advance computed tokens, append sampled tokens, finish requests.

        Full blocks whose KV the step wrote are registered in the prefix cache here, never
        earlier.

        Args:
            output: the step's rows, as returned by :meth:`schedule`.
            sampled_token_ids: one token per row with ``sample`` set, in row order.

        Returns:
            The requests that sampled a token (its new token last in ``token_ids``; finished if
            it ended them), skipping requests aborted meanwhile.

        Raises:
            ValueError: not one token per sampling row (a runner bug; nothing is applied).
        """
        decodes = output.decodes
        if len(sampled_token_ids) != output.num_sampled:
            raise ValueError(f"update_from_output: {len(sampled_token_ids)} sampled tokens for a step of "
                             f"{output.num_sampled} sampling rows")
        running = RequestStatus.RUNNING
        bm = self.block_manager
        caching, bs = bm.prefix_caching, bm.block_size
        gone: list[Request] = []
        for req, token in zip(decodes, sampled_token_ids):  # every decode samples, first
            if req.status is not running:
                gone.append(req)  # aborted while the step ran
                continue
            computed = req.num_computed_tokens = req.num_computed_tokens + 1
            if caching and computed % bs == 0:
                bm.commit(req.request_id, req.token_ids, computed, self.cache_salt(req))
            finished = req.append_token(token)
            if finished is not None:
                self._end(req, finished)
                self.stats.num_finished += 1
        # The decodes that sampled: all of them unless some were gone (no list op per row).
        sampled = [r for r in decodes if r not in gone] if gone else decodes[:]
        append = sampled.append
        tokens = iter(sampled_token_ids[len(decodes):])
        for req, _start, n, sample, _table in output.prefill_rows:
            token = next(tokens) if sample else None
            if req.status is not running:
                continue
            req.num_computed_tokens += n
            if caching:
                bm.commit(req.request_id, req.token_ids, req.num_computed_tokens, self.cache_salt(req))
            if req.num_computed_tokens >= req.num_prompt_tokens:
                siblings.prompt_computed(req, bm)  # a leader's prompt: its siblings may start
            if token is not None:
                finished = req.append_token(token)
                if finished is not None:
                    self._end(req, finished)
                    self.stats.num_finished += 1
                append(req)
        return sampled

    def remote_kv_loaded(self, request_id: str, good_blocks: int) -> bool:
        """A remote KV load ended with its first ``good_blocks`` blocks verified and written: the
        request runs from the next step, prefilling the rest here. False if it was not loading.

        Raises:
            ValueError: more good blocks than the load asked for.
        """
        req = self.remote.finished(request_id, good_blocks)
        if req is None:
            return False
        bisect.insort(self.running, req, key=_arrival)
        self.block_manager.commit(request_id, req.token_ids, req.num_computed_tokens, self.cache_salt(req))
        return True

    def _end(self, req: Request, status: RequestStatus) -> None:
        """Take a live request out of the running set, its load or its queue, and finish it."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.remote.cancel(req)
        else:
            self.queues[req.traffic_class].pop(req)
            self.remote.dequeued(req)
        self._finish(req, status)

    def observe_step_time(self, output: SchedulerOutput, seconds: float) -> None:
        """Feed a measured step duration to the cost model and the aging look-ahead."""
        self.cost_model.observe(output.features(), seconds)
        self.step_seconds = seconds if not self.step_seconds else 0.9 * self.step_seconds + 0.1 * seconds

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.block_manager.free(req.request_id)
        siblings.left(req, self.block_manager)
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

    def snapshot(self) -> EngineStats:
        """Counters and gauges: queues per class, KV blocks by state, scheduler counters."""
        return snapshot_of(self)
