"""Preemption by recompute: which running request gives way, and what giving way undoes.

Shared by the decode part (a decode needs a KV block and none is free) and the prefill adder (a
chunk needs blocks, or a waiting request of a higher class needs a slot or blocks). The victim
order is one rule: the lowest class first, the newest within a class; a request preempted more
than ``max_preemptions`` times is *protected* and never preempted again, so a lower class always
finishes eventually. Preempting drops the victim's KV (its prefix hashes are kept, so a resume
may hit the cache), refunds any row it had in the step being built, and puts it at the head of
its class's resume list. No torch here.

Reference: vLLM's ``vllm/v1/core/sched/scheduler.py`` (preemption by recompute, priority order).
"""

from __future__ import annotations

from collections.abc import Callable

from cadenza.node.core.block_manager import KVBlockManager
from cadenza.node.core.policy import CLASS_RANK, Policy
from cadenza.node.core.queues import ClassQueue
from cadenza.node.core.request import Request, RequestStatus
from cadenza.node.core.stats import SchedulerStats
from cadenza.node.core.step import Step


def victim_key(req: Request) -> tuple[int, float]:
    """Sort key of victims: larger goes first (lower class, then newer)."""
    return CLASS_RANK[req.traffic_class], req.arrival_time


class Preemption:
    """Chooses victims among ``running`` and preempts them.

    Args:
        running: the scheduler's running list (shared, not copied).
        kv: the block manager the victims' blocks go back to.
        queues: class queues, for the resume lists.
        stats: counters to record preemptions in.
        clock: seconds, monotonic.
    """

    def __init__(self, running: list[Request], kv: KVBlockManager, queues: dict[str, ClassQueue],
                 stats: SchedulerStats, clock: Callable[[], float]) -> None:
        self.running = running
        self.kv = kv
        self.queues = queues
        self.stats = stats
        self.clock = clock
        self.max_preemptions = Policy().max_preemptions

    def protected(self, req: Request) -> bool:
        return req.num_preemptions > self.max_preemptions

    def victim_for(self, requester: Request, include_self: bool) -> Request | None:
        """The request to preempt so ``requester`` can get a KV block, or None.

        Candidates are running requests of a lower class, or of the same class and newer, that
        are not protected; the lowest class and then the newest go first. ``include_self`` lets
        the requester be its own victim when it is the least important (it then waits).
        """
        own = victim_key(requester)
        best, best_key = None, None
        for req in self.running:
            if req is requester:
                if not include_self or self.protected(req):
                    continue
            elif victim_key(req) < own or self.protected(req):
                continue
            key = victim_key(req)
            if best_key is None or key > best_key:
                best, best_key = req, key
        return best

    def displaceable(self, rank: int, exclude: set[str]) -> list[Request]:
        """Running requests of classes ranked below ``rank``, none protected nor in ``exclude``,
        in the order they go."""
        victims = [r for r in self.running
                   if CLASS_RANK[r.traffic_class] > rank and not self.protected(r) and r.request_id not in exclude]
        victims.sort(key=victim_key, reverse=True)
        return victims

    def preempt(self, req: Request, step: Step) -> None:
        """Drop ``req``'s KV and queue it to resume; a row it had in ``step`` is refunded."""
        step.unschedule(req)
        self.running.remove(req)
        self.kv.free(req.request_id, keep_hashes=True)
        stats = self.stats
        stats.num_preemptions += 1
        stats.preemptions_by_class[req.traffic_class] += 1
        stats.num_recomputed_tokens += req.num_computed_tokens
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.preempted_time = self.clock()
        req.status = RequestStatus.PREEMPTED
        self.queues[req.traffic_class].push_resume(req)
        step.out.preempted.append(req)
