"""Requests whose prompt KV comes from another replica: the scheduler's side of a KV transfer.

A request that names a remote source (:class:`~cadenza.node.core.request.RemoteKV`: the prefill
replica that computed its prompt) is admitted like any other, with a running slot and KV blocks
for its whole prompt, after its local prefix-cache hit. What differs is what comes next. The
source's blocks past that hit are handed to the :class:`KVConnector` to load, and the request
waits in ``WAITING_FOR_REMOTE_KV`` without spending any token budget.

When the connector reports the load (:meth:`RemoteLoads.finished`), the verified blocks count
as computed and the full ones enter the prefix cache. The request then runs as a partial
prefill of what is left: the blocks from the first one that failed, and the prompt's last token.

Before its admission such a request may wait in its class's queue behind others, longer than
the source's lease. Meanwhile it is **held** (:attr:`RemoteLoads.held`): the connector renews
the source's lease for it, for at most :attr:`KVConnector.max_hold_s` from its arrival here. Past
that the source is released (its blocks freed there at once) and the prompt is computed here when
the request is admitted: a busy decode replica pins another replica's KV for a bounded time only.

Invariants:
- **Verified KV only.** A token is never produced from unverified KV. Only blocks the
  connector verified count as computed, and a failed block and every block after it are
  computed here.
- **Every prompt token but the last.** The source's blocks, the last one partial when the
  prompt does not end on a block, bring all of the prompt's KV except its last token's, which
  is prefilled here: that one-token row samples the first token, and a decode step barely
  notices it.
- **A loading request holds its slot and its blocks.** It is in neither the running list nor
  a queue, so it is neither scheduled nor preempted.
- **Remote KV only at first admission.** The source is forgotten once the load ends or is not
  made (then the source is told to release it); a request preempted later recomputes locally.
- **A hold is bounded and ends once.** A request is held from its arrival until its admission,
  its end, or ``max_hold_s``, whichever comes first; the source is released when it ends
  without a pull (an end before admission, or the bound), and never renewed after.
- **Cancelling stops writes.** Aborting a loading request cancels its load before its blocks
  are freed. The engine writes received blocks on the scheduler's thread, between steps, and
  only into requests still loading.

No torch here. Reference: vLLM's KV-connector scheduler half (``get_num_new_matched_tokens``, the
``WAITING_FOR_REMOTE_KVS`` status, blocks that failed to load recomputed).
"""

from __future__ import annotations

from typing import Protocol

from cadenza.node.core.block_manager import KVBlockManager
from cadenza.node.core.request import Request, RequestStatus
from cadenza.node.core.stats import SchedulerStats


class KVConnector(Protocol):
    """Moves a request's prompt KV from its source into local blocks (the engine's side), and
    keeps the sources of the requests in :attr:`RemoteLoads.held` leased meanwhile."""

    max_hold_s: float  # seconds a queued request may keep its source leased (from its arrival here)

    def start_load(self, request: Request, first_block: int, block_ids: list[int]) -> None:
        """Begin pulling the request's blocks ``first_block ..`` from ``request.remote_kv`` into
        the local KV blocks ``block_ids`` (one per remote block, in order); report the outcome
        through the scheduler's ``remote_kv_loaded``."""

    def cancel(self, request_id: str) -> None:
        """Stop the request's load: nothing more is written into its blocks after this returns."""

    def release(self, request: Request) -> None:
        """The request will not pull from ``request.remote_kv`` (nothing there it lacks): let the
        source free what it holds now rather than at its lease's end."""


class RemoteLoads:
    """The requests loading their prompt KV, and the rules for who may (see the module docstring).

    Args:
        connector: the engine's connector; None: nothing is ever loaded (every prompt computed here).
        kv: the block manager the loads' blocks come from.
        stats: counters (``remote_kv_*``).
    """

    def __init__(self, connector: KVConnector | None, kv: KVBlockManager, stats: SchedulerStats) -> None:
        self.connector = connector
        self.kv = kv
        self.stats = stats
        # id -> (request, first block, blocks, prompt tokens they hold)
        self.loading: dict[str, tuple[Request, int, int, int]] = {}
        # (id, tokens loaded, tokens left to compute here) of loads ended since the last drain (spans)
        self.ended: list[tuple[str, int, int]] = []
        # id -> (request, when its hold ends) of queued requests with a source, by arrival: the
        # connector renews their sources' leases until then
        self.held: dict[str, tuple[Request, float]] = {}

    def __len__(self) -> int:
        return len(self.loading)

    def hold(self, req: Request, now: float) -> None:
        """``req`` was queued (``now``: seconds, the scheduler's clock): while it waits, keep
        its source leased, for at most the connector's ``max_hold_s``."""
        if req.remote_kv is not None and self.connector is not None and not req.num_preemptions:
            self.held[req.request_id] = (req, now + self.connector.max_hold_s)

    def release_overdue(self, now: float) -> int:
        """End the holds past their bound: release those sources (their blocks are freed there)
        and forget them, so those prompts are computed here. How many were released."""
        held, released = self.held, 0
        while held:
            request_id = next(iter(held))  # arrival order: the oldest hold ends first
            req, until = held[request_id]
            if until > now:
                break
            del held[request_id]
            self.connector.release(req)
            req.remote_kv = None
            released += 1
        self.stats.remote_kv_released_holds += released
        return released

    def blocks_to_load(self, req: Request, cached_blocks: int) -> int:
        """Blocks of ``req``'s prompt to pull from its source, after ``cached_blocks`` hit the
        local prefix cache (0: prefill it here); the last may be partial."""
        source = req.remote_kv
        if source is None or self.connector is None or req.num_preemptions:
            return 0
        return max(0, self.kv.blocks_for(self._usable(req)) - cached_blocks)

    @staticmethod
    def _usable(req: Request) -> int:
        """Prompt tokens whose KV may come from the source: all it holds but the prompt's last."""
        return min(req.remote_kv.num_tokens, req.num_prompt_tokens - 1)

    def admitted(self, req: Request, first_block: int, num_blocks: int) -> bool:
        """``req`` was just admitted with ``first_block`` blocks from the prefix cache: start loading
        ``num_blocks`` (:meth:`blocks_to_load`) and say True, or say False (it is prefilled here)
        after releasing a source it will not pull from."""
        self.held.pop(req.request_id, None)  # loading (its pull keeps the lease) or computed here
        if num_blocks:
            self.start(req, first_block, num_blocks)
            return True
        if req.remote_kv is not None and self.connector is not None and not req.num_preemptions:
            self.connector.release(req)
        req.remote_kv = None  # decided once: a resume after a preemption computes here too
        return False

    def start(self, req: Request, first_block: int, num_blocks: int) -> None:
        """Allocate the blocks ``first_block .. + num_blocks`` of an admitted ``req`` (its prefix
        hit adopted already) and hand them to the connector."""
        bs = self.kv.block_size
        if not self.kv.allocate_slots(req.request_id, (first_block + num_blocks) * bs):
            raise MemoryError(f"request {req.request_id}: no KV blocks to load {num_blocks} remote blocks into")
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[req.request_id] = (req, first_block, num_blocks, self._usable(req))
        self.stats.remote_kv_loads += 1
        table = self.kv.block_table(req.request_id)
        self.connector.start_load(req, first_block, list(table[first_block:first_block + num_blocks]))

    def finished(self, request_id: str, good_blocks: int) -> Request | None:
        """The load of ``request_id`` ended with its first ``good_blocks`` blocks verified: the
        request, ready to run as a partial prefill; None when it is not loading (aborted).

        Raises:
            ValueError: ``good_blocks`` outside ``0 .. blocks asked``.
        """
        entry = self.loading.get(request_id)
        if entry is None:
            return None
        req, first, asked, usable = entry
        if not 0 <= good_blocks <= asked:
            raise ValueError(f"{request_id}: {good_blocks} good blocks of {asked} asked")
        del self.loading[request_id]
        req.remote_kv = None  # its source is done with: a later preemption recomputes here
        start = first * self.kv.block_size  # the local prefix hit
        req.num_computed_tokens = min((first + good_blocks) * self.kv.block_size, usable)
        self.stats.remote_kv_tokens += req.num_computed_tokens - start
        if good_blocks < asked:
            self.stats.remote_kv_failed_loads += 1
            self.stats.remote_kv_recomputed_tokens += usable - req.num_computed_tokens
        req.status = RequestStatus.RUNNING
        self.ended.append((request_id, req.num_computed_tokens - start, req.num_prompt_tokens - req.num_computed_tokens))
        return req

    def drain_ended(self) -> list[tuple[str, int, int]]:
        """The loads ended since the last call: ``(id, tokens loaded, tokens left to compute here)``."""
        ended, self.ended = self.ended, []
        return ended

    def cancel(self, req: Request) -> None:
        """Forget a loading request that is ending (aborted); its blocks are freed by the caller."""
        if self.loading.pop(req.request_id, None) is not None and self.connector is not None:
            self.connector.cancel(req.request_id)

    def dequeued(self, req: Request) -> None:
        """A queued request is ending (aborted, or stopped) before its admission: release the
        source it held, so that replica frees the blocks now rather than at its lease's end."""
        if self.held.pop(req.request_id, None) is not None:
            self.connector.release(req)
