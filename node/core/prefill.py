"""The prefill adder: spends what the decodes left of a step on prefill chunks, by class policy.

Order of work in a step, after the decodes:

1. **Budget.** The prefill budget is what the decodes left of ``token_budget``; with
   ``step_time_target_ms``, a calibrated cost model and an interactive stream decoding, it also
   stops where the predicted step would exceed the target — chunks shrink, the interactive
   decode cadence holds (the decode reservation in time). A floor of a few tokens per step keeps
   prefill from stalling outright.
2. **Aging.** A class whose oldest waiting request has waited ``max_queue_age_s`` (counting the
   step about to run) has that request admitted first, ahead of every class.
3. **Classes, highest first.** Each class may take up to its ``max_prefill_tokens``, but never
   the ``min_share`` of the budget reserved for lower classes that have work; whatever a class
   leaves goes on down. Within a class: partial prefills (requests that already hold KV) first,
   then preempted requests resuming (oldest first), then new admissions; tenants share it all by
   weighted fair queuing (:class:`~cadenza.node.core.queues.ClassQueue`).
4. **KV headroom.** A new admission needs blocks for its whole prompt (less what the prefix cache
   holds), plus a watermark, beyond the blocks already reserved for admitted prompts — otherwise it
   waits (new prefill is delayed before anything is preempted). A partial prefill that cannot grow
   may preempt a lower-priority request; else it waits.
5. **Remote KV.** A request whose prompt was prefilled on another replica is admitted the same
   way but loads that KV instead of a first chunk (:mod:`cadenza.node.core.remote_kv`).
6. **Displacement.** A waiting request that lacks a running slot or KV headroom takes them from
   running requests of a *strictly lower* class: the lowest class first, the newest within it,
   preempted by recompute — only when those victims free enough for it to start in this very step,
   never a protected request (preempted more than ``max_preemptions`` times, so a lower class
   always finishes), never one admitted in this step (aging's admission holds), never an equal
   or higher class. Memory shortness closes admissions for equal and lower classes only.

Each chunk is at most ``chunk_size``. No torch here.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from typing import NamedTuple

from cadenza.node.core import siblings
from cadenza.node.core.block_manager import KVBlockManager
from cadenza.node.core.config import SchedulerConfig
from cadenza.node.core.cost_model import StepCostModel
from cadenza.node.core.policy import CLASS_RANK, CLASSES
from cadenza.node.core.preemption import Preemption
from cadenza.node.core.queues import ClassQueue
from cadenza.node.core.remote_kv import RemoteLoads
from cadenza.node.core.request import Request, RequestStatus
from cadenza.node.core.stats import SchedulerStats
from cadenza.node.core.step import Step

PREFILL_FLOOR = 16  # tokens a step always offers prefill work, whatever the step-time target
MAX_TENANT_STATS = 1024  # tenants counted one by one in stats; the rest are summed under OTHER_TENANTS
OTHER_TENANTS = "_other"


class PrefillContext(NamedTuple):
    """What the prefill adder reads and changes — and nothing else of the scheduler.

    Attributes:
        config: the knobs in force (budget, chunk cap, running cap, the policy).
        running: running requests, oldest first (admissions are inserted by ``start_running``).
        prefilling: those of ``running`` mid-prefill when the step began, oldest first.
        interactive_decoding: an interactive request was decoding when the step began.
        queues: the class queues.
        kv: the KV block manager.
        preemption: victim choice and preemption, shared with the decode part.
        cost_model: the step-time model (time budget, chunk sizing).
        stats: counters.
        now: the clock when the step is built (seconds, monotonic).
        step_seconds: recent mean step time (aging looks one step ahead).
        watermark_blocks: KV blocks kept free when admitting, while anything runs.
        cache_salt: a request's prefix-cache salt.
        start_running: moves a queued request into ``running`` (records its admission).
        remote: the requests loading remote KV (each holds a running slot).
    """

    config: SchedulerConfig
    running: list[Request]
    prefilling: list[Request]
    interactive_decoding: bool
    queues: dict[str, ClassQueue]
    kv: KVBlockManager
    preemption: Preemption
    cost_model: StepCostModel
    stats: SchedulerStats
    now: float
    step_seconds: float
    watermark_blocks: int
    cache_salt: Callable[[Request], bytes]
    start_running: Callable[..., None]
    remote: RemoteLoads


class PrefillAdder:
    """Fills one step's prefill part (see the module docstring)."""

    def __init__(self, ctx: PrefillContext, step: Step) -> None:
        self.ctx = ctx
        self.step = step
        self.kv = ctx.kv
        self.queues = ctx.queues
        self.stats = ctx.stats
        self.policy = ctx.config.policy
        self.chunk_cap = ctx.config.effective_chunk_size
        self.max_running = ctx.config.max_running
        self.used = dict.fromkeys(CLASSES, 0)
        self.partials: dict[str, dict[str, deque[Request]]] = {c: defaultdict(deque) for c in CLASSES}
        self.wanted: dict[str, int] = {}  # partial prefill -> tokens it wanted this step
        self._lowest_rank: int | None = None  # of the classes running when the step began (lazily)
        prefills = step.prefills
        for req in ctx.prefilling:
            if req.status is RequestStatus.RUNNING and req.request_id not in prefills:
                self.partials[req.traffic_class][req.tenant].append(req)
                self.wanted[req.request_id] = min(req.num_new_tokens, self.chunk_cap)
        self.admissions_open = not step.out.preempted  # memory is short: delay new prefill first
        self.seconds_left = self._time_budget()

    def _time_budget(self) -> float | None:
        """Seconds of the step-time target left after the decodes — when the step decodes an
        interactive stream (whose inter-token latency the target protects) and the cost model is
        calibrated; else None (no time limit)."""
        target = self.policy.step_time_target_ms
        model = self.ctx.cost_model
        if target is None or not model.ready:
            return None
        if not self.ctx.interactive_decoding:
            return None
        decode_only = self.step.out.features()._replace(prefill_tokens=0, prefill_attention_tokens=0.0)
        return target / 1000.0 - (model.predict(decode_only) or 0.0)

    @property
    def left(self) -> int:
        """Tokens of the step's budget still unspent."""
        return self.step.budget_left

    # -- the pass -------------------------------------------------------------------------------

    def run(self) -> None:
        if self.left > 0:
            self._admit_aged()
            has_work = {c: bool(self.partials[c]) or len(self.queues[c]) > 0 for c in CLASSES}
            budget = self.left
            reserve = {c: min(int(self.policy.classes[c].min_share * budget), self._cap(c)) if has_work[c] else 0
                       for c in CLASSES}
            for protect_lower in (True, False):  # second round: what lower classes left unused
                for i, c in enumerate(CLASSES):
                    if not has_work[c]:
                        continue
                    held = sum(max(0, reserve[low] - self.used[low]) for low in CLASSES[i + 1:]) if protect_lower else 0
                    room = min(self._cap(c) - self.used[c], self.left - held)
                    if room > 0:
                        self._fill_class(c, room)
        self._count_deferred()

    def _cap(self, cls: str) -> int:
        cap = self.policy.classes[cls].max_prefill_tokens
        return self.ctx.config.token_budget if cap is None else cap

    def _admit_aged(self) -> None:
        now = self.ctx.now + self.ctx.step_seconds  # the age once this step has run
        for cls in CLASSES:
            max_age = self.policy.classes[cls].max_queue_age_s
            oldest = self.queues[cls].oldest()
            if max_age is None or oldest is None or now - oldest.arrival_time < max_age or siblings.waits(oldest):
                continue
            if not self._admit(oldest, self.left):
                self.admissions_open = False  # hold memory and slots for it
                return

    def _fill_class(self, cls: str, room: int) -> None:
        limit = self.used[cls] + room
        queue = self.queues[cls]
        partials = self.partials[cls]
        while partials and self.used[cls] < limit and self.left > 0:  # 1. partial prefills, by WFQ
            tenant = min(partials, key=lambda t: queue.service[t])
            req = partials[tenant].popleft()
            if not partials[tenant]:
                del partials[tenant]
            self._continue(req, limit - self.used[cls])
        while queue.resume and self.used[cls] < limit and self.left > 0:  # 2. preempted, oldest first
            if not self._admit(queue.resume[0], limit - self.used[cls]):
                return
        blocked: set[str] = set()
        while self.used[cls] < limit and self.left > 0:  # 3. new, by WFQ
            tenant = queue.next_tenant(blocked)
            if tenant is None:
                return
            head = queue.tenants[tenant][0]
            if not self.admissions_open and not self._displaceable(head):
                return
            if not self._admit(head, limit - self.used[cls]):
                blocked.add(tenant)  # its head does not fit now; the others may

    # -- chunks -----------------------------------------------------------------------------------

    def _chunk(self, req: Request, start: int, room: int) -> int:
        """Tokens of the request's next chunk from ``start``: prompt, cap, room, budget, time."""
        n = min(len(req.token_ids) - start, self.chunk_cap, room, self.left)
        if self.seconds_left is not None:
            fits = self.ctx.cost_model.max_chunk(self.seconds_left, start)
            floor = PREFILL_FLOOR if self.step.out.num_prefill_tokens == 0 else 0
            n = min(n, max(fits, floor))
        return n

    def _continue(self, req: Request, room: int) -> None:
        """Give a partial prefill its next chunk, preempting a lower-priority request if KV is short."""
        n = self._chunk(req, req.num_computed_tokens, room)
        if n <= 0:
            return
        fits = self.kv.capacity(req.request_id) - req.num_computed_tokens
        while fits <= 0:
            self.stats.allocation_failures += 1
            victim = self.ctx.preemption.victim_for(req, include_self=False)
            if victim is None:
                return
            self._preempt(victim)
            fits = self.kv.capacity(req.request_id) - req.num_computed_tokens
        self._grant(req, min(n, fits))

    def _admit(self, req: Request, room: int) -> bool:
        """Start a waiting request with a first chunk if a slot, budget and KV headroom allow —
        displacing running requests of strictly lower classes when that is what it lacks."""
        if (not self.admissions_open and not self._displaceable(req)) or siblings.waits(req):
            return False  # (a sibling starts once its leader has computed the prompt it shares)
        kv = self.kv
        cached = siblings.shared_prefix(req) or kv.match_prefix(req.request_id, req.token_ids, self.ctx.cache_salt(req))
        need = kv.blocks_for(len(req.token_ids)) - len(cached)
        start = len(cached) * kv.block_size
        slots_short = len(self.ctx.running) + len(self.ctx.remote) + 1 - self.max_running
        kv_short = need - self._headroom(cached)
        if slots_short > 0 or kv_short > 0:
            victims = self._victims_for(self._displaceable(req), cached, slots_short, kv_short)
            if victims is None or self._chunk(req, start, room) <= 0:
                if slots_short > 0:
                    self.admissions_open = False
                else:
                    self.stats.kv_admission_delays += 1
                return False
            for victim in victims:
                self._preempt(victim, close_admissions=False)
            self.stats.num_admission_preemptions += len(victims)
        n, remote = self._chunk(req, start, room), self.ctx.remote.blocks_to_load(req, len(cached))
        if n <= 0 and not remote:
            return False
        self.ctx.start_running(req, self.step, loading=bool(remote))
        kv.admit(req.request_id, cached, len(req.token_ids))  # the prefix hit, and a claim on the rest
        siblings.left(req, kv)  # a sibling has adopted its share of the prompt
        req.num_computed_tokens = req.num_cached_tokens = start
        stats = self.stats
        stats.prefix_cache_queried_tokens += len(req.token_ids)
        stats.prefix_cache_hit_tokens += start
        if not self.ctx.remote.admitted(req, len(cached), remote):  # else its KV arrives instead of a chunk
            self._grant(req, n)
        return True

    def _grant(self, req: Request, n: int) -> None:
        start = req.num_computed_tokens
        if not self.kv.allocate_slots(req.request_id, start + n):  # n was sized to what is free
            raise MemoryError(f"request {req.request_id}: no KV blocks for a chunk of {n} tokens")
        self.step.add_prefill(req, start, n, self.kv.block_table(req.request_id))
        if self.seconds_left is not None:
            self.seconds_left -= self.ctx.cost_model.chunk_cost(n, start)
        self._account(req, n)

    def _account(self, req: Request, n: int) -> None:
        self.used[req.traffic_class] += n
        self.queues[req.traffic_class].charge(req.tenant, n, self.policy.tenant(req.tenant).weight)
        stats = self.stats
        stats.prefill_tokens_admitted += n
        stats.prefill_tokens_by_class[req.traffic_class] += n
        by_tenant = stats.prefill_tokens_by_tenant
        key = req.tenant if req.tenant in by_tenant or len(by_tenant) < MAX_TENANT_STATS else OTHER_TENANTS
        by_tenant[key] += n

    # -- displacement -------------------------------------------------------------------------

    def _headroom(self, cached: list[int]) -> int:
        """Blocks a new admission may take now: free ones, less its own cached prefix (adopted,
        not allocated), the blocks admitted prompts still need, and the watermark."""
        watermark = self.ctx.watermark_blocks if self.ctx.running else 0
        return self.kv.headroom(cached) - watermark

    def _displaceable(self, req: Request) -> list[Request]:
        """Running requests ``req`` may displace, in the order they go: strictly lower classes,
        the lowest and then the newest first; none protected, none admitted in this step."""
        rank = CLASS_RANK[req.traffic_class]
        if self._lowest_rank is None:
            self._lowest_rank = max((CLASS_RANK[c] for c in {r.traffic_class for r in self.ctx.running}), default=-1)
        if rank >= self._lowest_rank:  # nothing of a lower class ran when the step began
            return []
        admitted_now = {r.request_id for r, _phase, _queued in self.step.out.admitted}
        return self.ctx.preemption.displaceable(rank, admitted_now)

    def _victims_for(self, candidates: list[Request], cached: list[int], slots: int, blocks: int) -> list[Request] | None:
        """The shortest prefix of ``candidates`` whose preemption frees ``slots`` running slots and
        ``blocks`` KV blocks for an admission whose cached prefix is ``cached``; None if even all
        of them would not (then nobody is preempted)."""
        keep = set(cached)  # shared with the newcomer: freeing them gains it nothing
        chosen: list[Request] = []
        for victim in candidates:
            if slots <= 0 and blocks <= 0:
                break
            blocks -= self.kv.reclaimable(victim.request_id, keep)  # a partial prefill's reservation too
            slots -= 1
            chosen.append(victim)
        return chosen if slots <= 0 and blocks <= 0 else None

    def _preempt(self, victim: Request, close_admissions: bool = True) -> None:
        """Preempt ``victim``; a prefill chunk it already had in this step is refunded, and the
        blocks it still needed for its prompt are no longer reserved."""
        chunk = self.step.prefills.get(victim.request_id)
        if chunk is not None:
            self._account(victim, -chunk.num_tokens)
        self.ctx.preemption.preempt(victim, self.step)  # unschedules it, refunds the budget, frees its KV
        if close_admissions:
            self.admissions_open = False
        self.wanted.pop(victim.request_id, None)
        tenants = self.partials[victim.traffic_class]
        queue = tenants.get(victim.tenant)
        if queue is not None and victim in queue:
            queue.remove(victim)
            if not queue:
                del tenants[victim.tenant]

    def _count_deferred(self) -> None:
        deferred = 0
        for req_id, wanted in self.wanted.items():
            chunk = self.step.prefills.get(req_id)
            deferred += max(0, wanted - (chunk.num_tokens if chunk else 0))
        self.stats.prefill_tokens_deferred += deferred
