"""Chunked-prefill scheduler: decode tokens first, then prefill chunks in the leftover budget.

Each step spends at most ``token_budget`` tokens:

1. **Decode**: one token for every running request whose prompt is done. Running requests are
   capped at ``min(max_num_seqs, token_budget)``, so this always fits; a decode that needs a KV
   block when none is free preempts the newest running request (by arrival) — by recompute: its
   blocks are freed and it re-enters the front of the waiting queue with nothing computed.
2. **Prefill**: the leftover budget goes to chunks — partial prefills already running first
   (oldest first), then waiting requests admitted FCFS. Each chunk is at most ``chunk_size`` and
   at most what is left of the budget, and only as long as free KV blocks allow.

The unifying rule (vLLM V1): a request only has ``num_computed_tokens`` catching up with
``num_tokens``; a row of ``n`` tokens starting at ``num_computed_tokens`` either leaves the request
mid-prompt or reaches ``num_tokens`` and samples one token. No torch here.

References: Sarathi-Serve (Agrawal et al., OSDI 2024) for stall-free chunked prefill; vLLM's
``vllm/v1/core/sched/scheduler.py`` for the computed-token rule.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from cadenza.node.block_manager import KVBlockManager
from cadenza.node.config import SchedulerConfig
from cadenza.node.request import Request, RequestStatus


def _arrival(req: Request) -> float:
    return req.arrival_time


class ScheduledRow(NamedTuple):
    """One request's slice of a step: tokens ``[start, start + num_tokens)`` are computed.

    ``sample`` is True when the row reaches the end of the request's tokens, so the model runner
    samples the next token from the row's last position.
    """

    request: Request
    start: int
    num_tokens: int
    sample: bool


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes: decode rows first, then prefill rows."""

    rows: list[ScheduledRow]
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        return not self.rows


@dataclass(slots=True)
class SchedulerStats:
    """Monotonic counters since start."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0  # computed tokens whose KV a preemption dropped
    num_finished: int = 0
    num_aborted: int = 0


class TokenUpdate(NamedTuple):
    """A token sampled in a step, and the finished status it caused (None if still running)."""

    request: Request
    token_id: int
    finished: RequestStatus | None


class Scheduler:
    """Builds each step's mixed batch and applies its results.

    Args:
        config: budget, chunk size and request limits.
        block_manager: the KV block pool this scheduler allocates from.
    """

    def __init__(self, config: SchedulerConfig, block_manager: KVBlockManager) -> None:
        if config.max_model_len is None:
            raise ValueError("max_model_len: the scheduler needs a resolved value (see resolve_max_model_len)")
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival time, oldest first
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        # Blocks kept free when admitting new requests, so running decodes do not immediately
        # preempt what was just admitted (vLLM's watermark: 1% of the pool).
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)

    # -- queue management ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request (FCFS).

        Raises:
            ValueError: the id is already live, or it can never fit ``max_model_len``.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already live")
        limit = self.config.max_model_len
        if request.num_prompt_tokens + request.sampling.max_tokens > limit:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({request.sampling.max_tokens}) exceeds max_model_len={limit}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Drop a live request now and free its KV blocks; None if it is not live."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
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
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose the rows of the next step; never more than ``token_budget`` tokens."""
        self.stats.num_steps += 1
        budget = self.config.token_budget
        chunk_cap = self.config.effective_chunk_size
        bm = self.block_manager
        out = SchedulerOutput(rows=[])
        rows = out.rows
        running = self.running
        scheduled: set[str] = set()

        # 1. Decode: every running request with its prompt done advances by one token.
        partials: list[Request] = []
        i = 0
        while i < len(running):
            req = running[i]
            n = len(req.token_ids)
            if req.num_computed_tokens != n - 1:
                partials.append(req)
                i += 1
                continue
            while not bm.append_slot(req.request_id, n):
                victim = running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                rows.append(ScheduledRow(req, n - 1, 1, True))
                scheduled.add(req.request_id)
                i += 1
        out.num_decode_tokens = len(rows)
        budget -= len(rows)

        # 2a. Resume partial prefills, oldest first (skipping any preempted above).
        for req in partials:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue
            n = self._chunk(req, chunk_cap, budget)
            while n <= 0:
                victim = self._newest_unscheduled(scheduled, after=req)
                if victim is None:
                    break
                self._preempt(victim, out)
                n = self._chunk(req, chunk_cap, budget)
            if n > 0:
                budget -= n
                self._add_chunk(req, n, rows, scheduled, out)

        # 2b. Admit waiting requests FCFS (a preempted request sits at the front). Not in a step
        # that had to preempt: memory is short, and re-admitting the victim would only thrash.
        while budget > 0 and self.waiting and not out.preempted and len(running) < self.config.max_running:
            req = self.waiting[0]
            # The watermark protects running decodes; with nothing running it would only block.
            spare_blocks = bm.num_free_blocks - (self.watermark_blocks if running else 0)
            n = min(req.num_tokens, chunk_cap, budget, spare_blocks * bm.block_size)
            if n <= 0:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            bisect.insort(running, req, key=_arrival)
            budget -= n
            self._add_chunk(req, n, rows, scheduled, out)
        return out

    def _chunk(self, req: Request, chunk_cap: int, budget: int) -> int:
        """Tokens of the request's next chunk: bounded by its prompt, the cap, budget and KV."""
        computed = req.num_computed_tokens
        fits = self.block_manager.capacity(req.request_id) - computed
        return min(len(req.token_ids) - computed, chunk_cap, budget, fits)

    def _add_chunk(
        self, req: Request, n: int, rows: list[ScheduledRow], scheduled: set[str], out: SchedulerOutput
    ) -> None:
        start = req.num_computed_tokens
        self.block_manager.allocate(req.request_id, start + n)
        rows.append(ScheduledRow(req, start, n, start + n == req.num_tokens))
        scheduled.add(req.request_id)
        out.num_prefill_tokens += n

    def _newest_unscheduled(self, scheduled: set[str], after: Request) -> Request | None:
        """The newest running request younger than ``after`` and not in this step, if any."""
        for victim in reversed(self.running):
            if victim is after:
                return None
            if victim.request_id not in scheduled:
                return victim
        return None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        self.stats.num_preemptions += 1
        self.stats.num_recomputed_tokens += req.num_computed_tokens
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: Sequence[int]) -> list[TokenUpdate]:
        """Apply a finished step: advance computed tokens, append sampled tokens, finish requests.

        Args:
            output: the step's rows, as returned by :meth:`schedule`.
            sampled_token_ids: one token per row with ``sample`` set, in row order.

        Returns:
            One :class:`TokenUpdate` per sampled token, skipping requests aborted meanwhile.
        """
        updates: list[TokenUpdate] = []
        tokens = iter(sampled_token_ids)
        running = RequestStatus.RUNNING
        for req, _start, n, sample in output.rows:
            token = next(tokens) if sample else None
            if req.status != running:
                continue  # aborted while the step ran
            req.num_computed_tokens += n
            if token is None:
                continue
            finished = req.append_token(token)
            if finished is not None:
                self.running.remove(req)
                self._finish(req, finished)
                self.stats.num_finished += 1
            updates.append(TokenUpdate(req, token, finished))
        return updates

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.block_manager.free(req.request_id)
        del self.requests[req.request_id]
