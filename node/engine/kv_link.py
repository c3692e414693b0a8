"""A replica's KV transfer joined to its engine: endpoint and pulls on their own thread, the KV
cache written only between steps.

Every replica of a disaggregated pool may play either side, so one object does both:

- **Publish (prefill side).** A request added with ``publish_kv`` has each full prompt block
  shared into a holder table of the block manager (``kv-lease:<id>``) as soon as the step that
  computed it has run, and the prompt's partial last block once the prompt is done (a later
  write there, if the request decodes on, is past the prompt: the decode side recomputes it). The block is then offered to the endpoint
  (:class:`~cadenza.node.kv_transfer.producer.KVProducer`), which streams it to the decode
  replica that pulls it, so the transfer overlaps the rest of the prefill. The holder keeps the
  blocks after the request itself has finished (it stops after its first token) until the lease
  ends: the decode side's release, an abort, or expiry. They are freed on the engine's thread.
- **Load (decode side).** This is the scheduler's
  :class:`~cadenza.node.core.remote_kv.KVConnector`. A load starts a pull on the transfer thread,
  whose verified frames are queued. Between steps (:meth:`KVLink.drain`) the engine writes them
  into the request's blocks, then reports the end of the load to the scheduler with the blocks
  good up to the first failure. Before that, while a request waits in a queue here (the
  scheduler's ``remote.held``), its source's lease is renewed (``renew`` frames) every
  :attr:`KVLink.renew_every_s`, for at most ``max_hold_s`` (then the scheduler releases it).

Threads: the engine thread calls every method here; the transfer thread runs the asyncio loop
of the endpoint and the pulls. They meet in a thread-safe queue and ``call_soon_threadsafe``.
The one read of the KV cache off the engine thread is the endpoint's copy of published blocks.
Those blocks are full, computed and held by the lease, so nothing writes them meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from cadenza.node.core import disagg_rule
from cadenza.node.core.block_manager import KVBlockManager
from cadenza.node.core.cost_model import StepCostModel
from cadenza.node.core.request import Request
from cadenza.node.core.step import SchedulerOutput
from cadenza.node.credentials import admin_token
from cadenza.node.kv_transfer.consumer import KVConsumer
from cadenza.node.kv_transfer.producer import KVProducer
from cadenza.node.kv_transfer.protocol import Fingerprint, TransferError
from cadenza.node.kv_transfer.threshold import Rule
from cadenza.node.kv_transfer.throttled_log import ThrottledLog

log = logging.getLogger(__name__)

HOLDER = "kv-lease:"  # the block-manager table holding a published request's blocks
DRAIN_BYTES = 4 * 2**20  # received KV written between two steps at most (more waits for the next gap)
RENEW_EVERY_S = 1.0  # how often leases are renewed (prompts computing here, requests queued here), at most
DEFAULT_MAX_HOLD_S = 120.0  # how long a request queued here keeps its source's KV leased (then computed here)
ASSUMED_LINK_BYTES_PER_S = 1.25e9  # 10 Gbit/s, a common pod network, until pulls have measured the link


@dataclass
class _Load:
    first_block: int
    block_ids: list[int]
    good: int = 0  # blocks written, verified, from the first
    future: object = None


@dataclass
class LinkStats:
    """Counters of one replica's KV transfer (monotonic)."""

    published: int = 0
    loads: int = 0
    loads_done: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    failures: Counter = field(default_factory=Counter)  # by TransferError kind


class KVLink:
    """The engine's KV transfer (see the module docstring).

    Args:
        fingerprint: this engine's KV layout.
        runner: the model runner (``read_kv_blocks`` / ``write_kv_blocks``).
        kv: the engine's block manager.
        host, port: where the endpoint listens (port 0: a free one; :attr:`port` says which).
        lease_s: how long published KV waits for a decode replica's progress (seconds); a pull
            waits as long for the producer's next frame. The pool's replicas share it: leases
            are renewed every :attr:`renew_every_s`, a third of it at most.
        max_hold_s: how long a request queued here keeps its source's lease renewed, from its
            arrival (seconds); past it the source is released and the prompt computed here.
        token: reads the pool's token at each handshake, both ways
            (:func:`cadenza.node.credentials.admin_token`).
    """

    def __init__(self, fingerprint: Fingerprint, runner, kv: KVBlockManager, host: str = "127.0.0.1",
                 port: int = 0, lease_s: float = 30.0, max_hold_s: float = DEFAULT_MAX_HOLD_S,
                 token: Callable[[], str | None] = admin_token) -> None:
        self.fingerprint, self.runner, self.kv, self.host = fingerprint, runner, kv, host
        self.max_hold_s = max_hold_s
        self.renew_every_s = min(RENEW_EVERY_S, lease_s / 3)
        self.stats = LinkStats()
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # (kind, request id, detail) from the loop
        self._published: dict[str, int] = {}  # request id -> blocks shared into its holder so far
        self._computing: set[str] = set()  # published, prompt not computed yet: the engine renews their leases
        self._renewed = time.monotonic()
        self._holding = None  # the last renewal of held sources, while it runs (one at a time)
        self._loads: dict[str, _Load] = {}
        self._failures = ThrottledLog(log)  # failed pulls: a mismatched rollout must not be silent here
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-transfer", daemon=True)
        self._thread.start()
        self.producer = KVProducer(fingerprint, token=token, lease_s=lease_s)
        self.consumer = KVConsumer(fingerprint, token=token, read_timeout_s=lease_s)
        self.boot_id = self.producer.boot_id
        self.port = asyncio.run_coroutine_threadsafe(self.producer.start(host, port), self._loop).result(30)

    def close(self) -> None:
        """Stop the endpoint and every pull; the transfer thread ends."""
        async def stop() -> None:
            await self.producer.close()
            await self.consumer.close()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def rule(self, cost: StepCostModel) -> Rule | None:
        """This replica's selective rule (:mod:`~cadenza.node.kv_transfer.threshold`): its
        step-time model, its KV bytes per token, the bandwidth its pulls measured
        (:data:`ASSUMED_LINK_BYTES_PER_S` before any), and the prompt's last token computed here
        (:mod:`~cadenza.node.core.remote_kv`: it samples the first token). None
        before the cost model is calibrated."""
        return disagg_rule.rule(cost, self.fingerprint.bytes_per_token, self.consumer.bandwidth or ASSUMED_LINK_BYTES_PER_S)

    def min_prompt_tokens(self, cost: StepCostModel) -> int | None:
        """The shortest prompt worth prefilling on an idle prefill replica for this one, None
        before calibration or when none is."""
        found = self.rule(cost)
        return None if found is None else found.min_prompt_tokens()

    @property
    def busy(self) -> bool:
        """Something here waits on the engine thread: a load in flight or KV held for a pull."""
        return bool(self._loads or self._published or not self._events.empty())

    # -- publish (prefill side) -----------------------------------------------------------------

    def publish(self, req: Request) -> None:
        """Hold ``req``'s prompt KV for a decode replica, block by block as steps compute it."""
        rid, holder = req.request_id, HOLDER + req.request_id
        self.kv.share(holder, [])
        table = self.kv.block_table(holder)  # the live list: the endpoint reads what is shared

        def read(first: int, count: int) -> memoryview:  # on the transfer thread
            return self.runner.read_kv_blocks(table[first:first + count])

        def free() -> None:  # on the transfer thread, when the lease ends: freed between steps
            self._events.put(("free", rid, None))

        self._published[rid] = 0
        self._computing.add(rid)
        self.stats.published += 1
        self._loop.call_soon_threadsafe(self.producer.publish, rid, read, free)

    def after_forward(self, out: SchedulerOutput) -> None:
        """The step's KV is written: share and offer the full prompt blocks of published requests
        (before the scheduler applies the step, which may finish and free them).

        Every row counts, decodes too: a prompt whose last chunk is one token (the chunk before
        it ended one short, as a full budget or the chunk size leaves it) computes that token
        as a decode row, and the step that does so completes the prompt and writes its partial
        last block. Only published prompts still computing are looked for among the decodes."""
        published = self._published
        for row in out.prefill_rows:
            if row.request.request_id in published:
                self._written(row.request, row.start + row.num_tokens)
        computing = self._computing
        if computing:
            for req, position in zip(out.decodes, out.decode_positions):
                if req.request_id in computing and position == req.num_prompt_tokens - 1:
                    self._written(req, position + 1)

    def _written(self, req: Request, computed: int) -> None:
        """``req``'s first ``computed`` tokens hold their KV: share its blocks the decode side
        may take now (whole ones; the partial last one once the prompt is complete) and offer
        them to the endpoint."""
        rid, bs = req.request_id, self.kv.block_size
        shared = self._published[rid]
        computed = min(computed, req.num_prompt_tokens)
        complete = computed == req.num_prompt_tokens
        full = -(-computed // bs) if complete else computed // bs  # the prompt's partial last block too, at its end
        if complete:
            self._computing.discard(rid)
        if full > shared:
            self.kv.share(HOLDER + rid, self.kv.block_table(rid)[shared:full])
            self._published[rid] = full
        self._loop.call_soon_threadsafe(self.producer.progress, rid, full, complete)

    def unpublish(self, request_id: str) -> None:
        """The request was aborted: end its lease (its blocks are freed at the next drain)."""
        self._computing.discard(request_id)
        if request_id in self._published:
            self._loop.call_soon_threadsafe(self.producer.abort, request_id)

    # -- load (decode side): the scheduler's KVConnector ------------------------------------------

    def start_load(self, request: Request, first_block: int, block_ids: list[int]) -> None:
        load = self._loads[request.request_id] = _Load(first_block, list(block_ids))
        self.stats.loads += 1
        load.future = asyncio.run_coroutine_threadsafe(
            self._pull(request.request_id, request.remote_kv, first_block, len(block_ids)), self._loop)

    def cancel(self, request_id: str) -> None:
        load = self._loads.pop(request_id, None)
        if load is not None:
            load.future.cancel()  # frames still queued are dropped: the load is gone

    def release(self, request: Request) -> None:
        source = request.remote_kv
        call = self.consumer.release(source.host, source.port, source.boot_id, source.request_id)
        asyncio.run_coroutine_threadsafe(self._logged(call, f"releasing {source.request_id}"), self._loop)

    def _renew_held(self, held) -> None:
        """Renew the sources' leases of the requests queued here (``scheduler.remote.held``),
        one connection per producer, off the engine thread; skipped while the last renewal
        still runs (a producer slow to answer)."""
        if self._holding is not None and not self._holding.done():
            return
        by_producer: dict[tuple[str, int, str], list[str]] = {}
        for req, _until in held:
            source = req.remote_kv
            by_producer.setdefault((source.host, source.port, source.boot_id), []).append(source.request_id)

        async def renew_all() -> None:  # a failure here fails its pull the same way: recomputed
            await asyncio.gather(*(self._logged(self.consumer.renew(*where, ids), f"renewing {len(ids)} leases")
                                   for where, ids in by_producer.items()))

        self._holding = asyncio.run_coroutine_threadsafe(renew_all(), self._loop)

    @staticmethod
    async def _logged(call, what: str) -> None:
        """Await a best-effort consumer ``call`` (a release, renewals): a failure is only logged,
        the lease ends what it would have."""
        try:
            await call
        except TransferError as e:
            log.debug("KV transfer: %s: %s", what, e)

    async def _pull(self, rid: str, source, first_block: int, num_blocks: int) -> None:
        try:
            async for frame in self.consumer.pull(source.host, source.port, source.request_id, source.boot_id,
                                                  first_block, num_blocks):
                self._events.put(("blocks", rid, frame))
            self._events.put(("done", rid, None))
        except TransferError as e:
            self._failures.warning(e.kind, "KV transfer: pulling %s's prompt KV from %s:%s failed (%s), computing it "
                                   "here: %s", rid, source.host, source.port, e.kind, e)
            self._events.put(("failed", rid, e.kind))
        except Exception:  # a bug: fail the load (recomputed), never the engine
            log.exception("pulling the KV of %s failed", rid)
            self._events.put(("failed", rid, "protocol"))

    # -- between steps --------------------------------------------------------------------------

    def drain(self, scheduler) -> None:
        """Apply what the transfer thread produced: free ended leases, write received blocks,
        end finished loads (``scheduler.remote_kv_loaded``). On the engine thread, between steps;
        at most :data:`DRAIN_BYTES` of KV are written per call, so a burst of frames is spread
        over several steps rather than stalling one (the decode streams' ITL)."""
        held = scheduler.remote.held
        if (self._computing or held) and time.monotonic() - self._renewed >= self.renew_every_s:
            self._renewed = time.monotonic()
            if self._computing:
                self._computing &= scheduler.requests.keys()  # one refused or finished early runs out its lease
                self._loop.call_soon_threadsafe(self.producer.renew, list(self._computing))
            if held:
                self._renew_held(list(held.values()))
        written = 0
        while written < DRAIN_BYTES:
            try:
                kind, rid, detail = self._events.get_nowait()
            except queue.Empty:
                return
            if kind == "free":
                self.kv.free(HOLDER + rid)
                self._published.pop(rid, None)
                self._computing.discard(rid)
                continue
            load = self._loads.get(rid)
            if load is None or scheduler.requests.get(rid) is None:
                continue  # cancelled: nothing of it is written
            if kind == "blocks":
                offset = detail.first_block - load.first_block
                if detail.num_layers != self.fingerprint.num_layers or offset + detail.num_blocks > len(load.block_ids):
                    kind, detail = "failed", "protocol"
                else:
                    self.runner.write_kv_blocks(load.block_ids[offset:offset + detail.num_blocks], detail.payload)
                    written += len(detail.payload)
                    load.good = offset + detail.num_blocks
                    self.stats.blocks_received += detail.num_blocks
                    self.stats.bytes_received += len(detail.payload)
                    continue
            del self._loads[rid]
            if kind == "failed":
                self.stats.failures[detail] += 1
                load.future.cancel()
            else:
                self.stats.loads_done += 1
            scheduler.remote_kv_loaded(rid, load.good)
