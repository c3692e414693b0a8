"""The decode part of a step: one token for every running request whose prompt is done.

Decodes are the protected part of the token budget: they are scheduled first, and the scheduler
never runs more requests than the budget, so each can advance every step. A decode that crosses a
block boundary needs one more KV block; when none is free, a request is preempted by recompute
(:mod:`cadenza.node.core.preemption`: the lowest class first, the newest within it) — possibly the
decoding request itself, which then waits. If the budget was lowered live below the number of
decodes, the highest classes go first and the rest are counted as delayed. No torch here.
"""

from __future__ import annotations

from cadenza.node.core.block_manager import KVBlockManager
from cadenza.node.core.policy import CLASS_RANK
from cadenza.node.core.preemption import Preemption
from cadenza.node.core.request import Request, RequestStatus, split_by_phase
from cadenza.node.core.stats import SchedulerStats
from cadenza.node.core.step import Step


def schedule_decodes(step: Step, running: list[Request], kv: KVBlockManager, preemption: Preemption,
                     stats: SchedulerStats) -> list[Request]:
    """Add a one-token row to ``step`` for every decoding request of ``running`` (oldest first)
    that fits; return the others, mid-prefill, order kept (:func:`split_by_phase`)."""
    out = step.out
    decoding, prefilling = split_by_phase(running)
    if len(decoding) > step.budget_left:  # the budget was lowered live: highest classes first
        decoding.sort(key=lambda r: (CLASS_RANK[r.traffic_class], r.arrival_time))
    is_running = RequestStatus.RUNNING
    bs, tables = kv.block_size, kv.tables
    decodes, positions, decode_tables = out.decodes, out.decode_positions, out.decode_tables
    budget, context = step.budget_left, 0  # written back to the step before any preemption
    for req in decoding:
        if req.status is not is_running:
            continue  # preempted by a decode before it
        if budget <= 0:
            stats.decode_steps_delayed += 1
            continue
        n = len(req.token_ids)
        table = tables[req.request_id]
        if n > len(table) * bs and not kv.allocate_slots(req.request_id, n):
            step.budget_left, out.num_decode_tokens, out.decode_context_tokens = (
                budget, len(decodes), out.decode_context_tokens + context)
            context = 0
            made_room = _make_room(req, n, step, kv, preemption, stats)  # may refund earlier rows
            budget = step.budget_left
            if not made_room:
                continue
        decodes.append(req)
        positions.append(n - 1)
        decode_tables.append(table)
        budget -= 1
        context += n
    step.budget_left = budget
    out.num_decode_tokens = len(decodes)
    out.decode_context_tokens += context
    return prefilling


def _make_room(req: Request, n: int, step: Step, kv: KVBlockManager, preemption: Preemption,
               stats: SchedulerStats) -> bool:
    """Preempt until ``req`` gets the block its decode needs; False if it must wait instead."""
    while not kv.allocate_slots(req.request_id, n):
        stats.allocation_failures += 1
        victim = preemption.victim_for(req, include_self=True)
        if victim is None:
            stats.decode_steps_delayed += 1
            return False
        preemption.preempt(victim, step)
        if victim is req:
            return False
    return True
