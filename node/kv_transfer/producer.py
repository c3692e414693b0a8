"""The prefill side's KV transfer endpoint: a TCP server streaming each request's blocks as written.

The engine **publishes** a request's KV when its prefill starts (:meth:`KVProducer.publish`, with
a reader of the block bytes and a callback that frees them), reports **progress** after each step
that wrote some of its blocks (:meth:`KVProducer.progress`), and may **abort** it. A decode replica
connects, proves it holds the pool's token and shows its fingerprint (:mod:`.handshake`: a peer
without the token is refused and told nothing; fingerprints must match, or it is refused before
any block moves) and pulls requests one at a time per connection; a pull streams the blocks
already written at once and the rest as steps write them, so the transfer overlaps the remaining prefill, and ends with ``done``;
a pull that waits a third of a lease without a frame gets ``pending``.
A pull may come before its request is published (the decode side heard of it first): it waits up
to :data:`PUBLISH_WAIT_S` for it. Frames hold at most :data:`MAX_FRAME_BYTES`.

Every published request is held under a lease (:mod:`.leases`): renewed by each frame the decode
side's socket takes (TCP flow control makes a frame's ``drain`` wait on it), until its prompt is
computed by the engine's steps (:meth:`KVProducer.renew`: a prompt queued on a busy replica is not
lost), and by the decode side's ``renew`` frames while the request waits in its queue (bounded
there: :mod:`cadenza.node.core.remote_kv`), ended by its
``release`` (read at any time, mid-stream too), by the consumer going away mid-stream, by
:meth:`KVProducer.abort`, or by expiry, which a timer checks every :data:`EXPIRY_CHECK_S`; the
blocks are freed on the end, whichever it is. A pull of a request that holds no lease gets
``error unknown_request``; a lease that expires mid-stream, ``error expired``. A connection that
streams nothing for :data:`~.slots.IDLE_TIMEOUT_S` (pulls of requests not held do not count), does
not finish its handshake within :data:`~.slots.HANDSHAKE_TIMEOUT_S`, leaves a header half sent, or
does not drain a frame within a lease is closed; who gets a connection slot, and who is evicted
for a new one, is :mod:`.slots`. A connection that queues more than :data:`MAX_QUEUED_PULLS` pulls
(a consumer waits for each pull's end before the next), or one past :data:`MAX_QUEUED_PULLS_TOTAL`
on the endpoint, is closed: queued pulls cost memory that nothing else bounds.

Runs on one asyncio event loop (the engine's front end loop) and takes no locks. The wire is
:mod:`.protocol`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cadenza.node.kv_transfer import handshake, protocol, slots
from cadenza.node.kv_transfer.handshake import Refusal, TokenSource
from cadenza.node.kv_transfer.leases import DEFAULT_LEASE_S, LeaseTable
from cadenza.node.kv_transfer.protocol import Fingerprint, TransferError
from cadenza.node.kv_transfer.slots import Busy, Slot, Slots
from cadenza.node.kv_transfer.throttled_log import ThrottledLog

log = logging.getLogger(__name__)

MAX_FRAME_BLOCKS = 64  # blocks per data frame: a chunk's worth at most, so frames interleave with steps
MAX_FRAME_BYTES = 4 * 2**20  # and at most this many bytes: the decode side writes a frame between two steps
PUBLISH_WAIT_S = 5.0  # a pull may arrive before its request is published (the engine is mid-step): wait this long
HEADER_TIMEOUT_S = 10.0  # once a header's length arrived, its bytes must follow within this
MAX_QUEUED_PULLS = 4  # pulls waiting on one connection; more close it (a consumer sends one at a time)
MAX_QUEUED_PULLS_TOTAL = 1024  # pulls waiting on every connection together; more close the one that sends it
EXPIRY_CHECK_S = 0.25  # how often leases past their deadline are ended (blocks freed within this)

# Reads ``count`` blocks from ``first`` (all layers, layer-major within each block) as bytes.
BlockReader = Callable[[int, int], bytes | bytearray | memoryview]


@dataclass
class _Published:
    read: BlockReader
    free: Callable[[], None]
    written: int = 0  # blocks whose KV the engine has written
    complete: bool = False  # the prefill is over: ``written`` is every block
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: str = ""  # why the lease ended: released | aborted | expired | failed


@dataclass
class _Connection:
    writer: asyncio.StreamWriter
    slot: Slot
    pulls: asyncio.Queue = field(default_factory=asyncio.Queue)  # pull frames; None: the consumer is gone
    queued: int = 0  # pull frames in ``pulls``
    closed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class ProducerStats:
    """Counters of one producer (monotonic since start)."""

    connections: int = 0
    refused: int = 0  # handshakes refused (each also counted in ``failures`` by kind)
    transfers: int = 0  # pulls that ended with ``done``
    blocks_sent: int = 0
    bytes_sent: int = 0
    expired: int = 0  # leases that ran out (their blocks freed by the timer)
    failures: dict[str, int] = field(default_factory=dict)  # kind -> pulls that failed so

    def failed(self, kind: str) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1


class KVProducer:
    """The prefill replica's KV blocks, served to decode replicas.

    Args:
        fingerprint: this engine's KV layout; a consumer's must equal it.
        token: the pool's token, or a function that reads it at each handshake (None: every
            peer is refused ``unauthorized``).
        lease_s: a published request's lease, renewed by the decode side's progress (seconds).
        clock: seconds, monotonic (injected for tests).
    """

    def __init__(self, fingerprint: Fingerprint, *, token: str | TokenSource | None,
                 lease_s: float = DEFAULT_LEASE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.fingerprint = fingerprint
        self.token = handshake.token_source(token)
        self.boot_id = uuid.uuid4().hex  # new per process: a consumer sees a restart by it
        self.leases: LeaseTable[_Published] = LeaseTable(lease_s)
        self.clock = clock
        self.stats = ProducerStats()
        self._server: asyncio.Server | None = None
        self._timer: asyncio.Task | None = None
        self._connections: dict[asyncio.Task, _Connection | None] = {}
        self.slots = Slots()  # connections by state; ``slots.evicted`` counts those cut for another
        self._queued = 0  # pull frames queued on every connection
        self._refusals = ThrottledLog(log)  # anyone can cause refusals: a flood logs one line a minute
        self._closed = False
        self._awaited: dict[str, asyncio.Event] = {}  # pulls waiting for their request to be published
        self._ended: deque[str] = deque(maxlen=4096)  # recently ended leases: a pull of one is not waited for

    # -- the engine's side --------------------------------------------------------------------

    def publish(self, request_id: str, read: BlockReader, free: Callable[[], None]) -> None:
        """Hold ``request_id``'s blocks under a lease for a decode replica to pull; ``free``
        is called exactly once, when the lease ends. ValueError if it is already published;
        RuntimeError once the producer is closed (nothing would ever end the lease)."""
        if self._closed:
            raise RuntimeError("the KV transfer endpoint is closed")
        self.leases.hold(request_id, _Published(read, free), self.clock())
        if (waiter := self._awaited.pop(request_id, None)) is not None:
            waiter.set()  # a pull that came first

    def progress(self, request_id: str, written: int, complete: bool = False) -> None:
        """``written`` of the request's blocks now hold their KV (``complete``: all of them).
        A request that is not held (released, expired) is ignored."""
        entry = self.leases.get(request_id)
        if entry is None:
            return
        if written < entry.written:
            raise ValueError(f"{request_id}: written blocks went down from {entry.written} to {written}")
        entry.written, entry.complete = written, complete or entry.complete
        entry.changed.set()

    def renew(self, request_ids: list[str]) -> None:
        """The engine still works on these (queued, or part computed): their leases run on. Its
        steps call this, so a prompt queued behind others on a busy prefill replica keeps its
        lease, and one on an engine that stopped stepping expires as if the decode side had gone."""
        now = self.clock()
        for rid in request_ids:
            self.leases.renew(rid, now)

    def abort(self, request_id: str) -> None:
        """End the request's lease now (the client went away): its blocks are freed."""
        self._end(request_id, "aborted")

    def held(self) -> list[str]:
        """Request ids whose blocks are held now."""
        return list(self.leases._leases)

    def _end(self, request_id: str, why: str) -> bool:
        entry = self.leases.release(request_id)
        if entry is None:
            return False
        entry.ended = why
        self._ended.append(request_id)
        entry.changed.set()  # a stream waiting on it sees the lease gone
        try:
            entry.free()
        except Exception:  # the owner's bug must not leave the others' leases running
            log.exception("freeing the KV blocks of %s failed", request_id)
        return True

    def expire(self) -> list[str]:
        """End the leases past their deadline (the timer calls this every second)."""
        gone = []
        for rid, entry in self.leases.expire(self.clock()):
            self.stats.expired += 1
            entry.ended = "expired"
            self._ended.append(rid)
            entry.changed.set()
            try:
                entry.free()
            except Exception:
                log.exception("freeing the KV blocks of %s failed", rid)
            gone.append(rid)
        return gone

    # -- the server ---------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host:port`` (0: a free port); the port bound."""
        self._server = await asyncio.start_server(self._serve, host, port)
        self._timer = asyncio.create_task(self._expire_every_second())
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening, cut every connection and free every held block."""
        if self._server is not None:
            self._server.close()
        for task in (*self._connections, *([self._timer] if self._timer else [])):
            task.cancel()
        await asyncio.gather(*self._connections, *([self._timer] if self._timer else []), return_exceptions=True)
        for rid in self.held():
            self._end(rid, "aborted")
        self._closed = True
        if self._server is not None:
            await self._server.wait_closed()

    async def _expire_every_second(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_CHECK_S)
            self.expire()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections[task] = None
        self.stats.connections += 1
        conn = control = None
        peer = _peer(writer)
        try:
            try:
                conn = _Connection(writer, self.slots.open(peer, task.cancel))
            except Busy as e:
                self._refuse(writer, peer, Refusal("busy", str(e)))
                return
            self._connections[task] = conn
            async with asyncio.timeout(slots.HANDSHAKE_TIMEOUT_S):
                ok = await self._handshake(reader, conn, peer)
            if ok:
                control = asyncio.create_task(self._read_control(reader, conn))
                while True:  # an idle connection is closed: pulls of requests not held do not count
                    msg = await asyncio.wait_for(conn.pulls.get(), max(0.0, conn.slot.idle_s_left()))
                    if msg is None or conn.closed.is_set():
                        return  # the consumer closed the connection (or broke the protocol)
                    conn.queued -= 1
                    self._queued -= 1
                    await self._stream(msg["request_id"], msg["first_block"], msg["num_blocks"], conn)
        except (TransferError, ConnectionError, asyncio.IncompleteReadError, TimeoutError) as e:
            log.debug("KV transfer connection closed: %s", e)
        except asyncio.CancelledError:  # close(), or evicted for another: end quietly
            if conn is not None and conn.slot.evicted and not conn.slot.established:  # say why, unlogged
                writer.write(protocol.encode("refused", code="busy", reason="handshake cut for another"))
        finally:
            if control is not None:
                control.cancel()
            if conn is not None:
                self._queued -= conn.queued
                conn.queued = 0
                self.slots.close(conn.slot)
            del self._connections[task]
            writer.close()

    async def _read_control(self, reader: asyncio.StreamReader, conn: _Connection) -> None:
        """The consumer's frames, read all the time (a release must land mid-stream too): pulls
        queue for the connection's loop, releases act at once; the end of the connection or a
        broken frame wakes the loop with None."""
        try:
            while True:
                n = protocol.header_length(await reader.readexactly(4))
                msg = protocol.decode(await asyncio.wait_for(reader.readexactly(n), HEADER_TIMEOUT_S))
                if msg["kind"] == "pull":
                    if conn.queued >= MAX_QUEUED_PULLS or self._queued >= MAX_QUEUED_PULLS_TOTAL:
                        self.stats.failed("busy")
                        log.warning("KV transfer: closing the connection from %s: more than %d pulls queued on it, "
                                    "or %d on the endpoint", conn.slot.peer, MAX_QUEUED_PULLS, MAX_QUEUED_PULLS_TOTAL)
                        conn.slot.cut()  # ends the connection's task: its queued pulls are dropped
                        return
                    conn.queued += 1
                    self._queued += 1
                    conn.pulls.put_nowait(msg)
                elif msg["kind"] == "release":
                    self._end(msg["request_id"], "released")
                elif msg["kind"] == "renew":
                    self.leases.renew(msg["request_id"], self.clock())
                else:
                    raise TransferError("protocol", f"a {msg['kind']} frame from a consumer")
        except (TransferError, ConnectionError, asyncio.IncompleteReadError, TimeoutError) as e:
            log.debug("KV transfer consumer gone: %s", e)
        finally:
            conn.closed.set()
            conn.pulls.put_nowait(None)

    async def _handshake(self, reader: asyncio.StreamReader, conn: _Connection, peer: str) -> bool:
        """Prove the token, check the consumer's (:mod:`.handshake`), take an established slot."""
        writer = conn.writer
        try:
            nonce_c = handshake.check_hello(await _read_header(reader))
            token = self.token()
            frame, nonce_p = handshake.challenge(token, nonce_c)
            writer.write(frame)
            await writer.drain()
            handshake.check_auth(await _read_header(reader), token, nonce_c, nonce_p, self.fingerprint)
            try:
                self.slots.establish(conn.slot)
            except Busy as e:
                raise Refusal("busy", str(e)) from None
        except Refusal as r:
            self._refuse(writer, peer, r)
            await writer.drain()
            return False
        writer.write(handshake.welcome(token, nonce_c, nonce_p, self.fingerprint, self.boot_id))
        await writer.drain()
        return True

    def _refuse(self, writer: asyncio.StreamWriter, peer: str, refusal: Refusal) -> None:
        """Count and log a refused handshake, and tell the peer only the refusal's reason."""
        self.stats.refused += 1
        self.stats.failed(refusal.kind)
        self._refusals.warning(refusal.kind, "KV transfer: refused %s (%s): %s", peer, refusal.kind, refusal.detail)
        writer.write(protocol.encode("refused", code=refusal.kind, reason=refusal.reason[:1024]))

    async def _stream(self, request_id: str, first_block: int, num_blocks: int, conn: _Connection) -> None:
        entry = self.leases.get(request_id)
        if entry is None and request_id not in self._ended:  # maybe not published yet: wait a little
            waiter = self._awaited.setdefault(request_id, asyncio.Event())
            try:
                await asyncio.wait_for(waiter.wait(), PUBLISH_WAIT_S)
            except TimeoutError:
                pass
            finally:
                if self._awaited.get(request_id) is waiter and not waiter.is_set():
                    del self._awaited[request_id]
            entry = self.leases.get(request_id)
        if entry is None:
            return await self._error(conn, request_id, "unknown_request",
                                     f"no KV held for {request_id} (never published, released or expired)")
        conn.slot.streaming = True  # useful work: never evicted for another, and not idle
        conn.slot.touch()
        try:
            await self._send(request_id, entry, first_block, num_blocks, conn)
        finally:
            conn.slot.streaming = False
            conn.slot.touch()

    async def _send(self, request_id: str, entry: _Published, first_block: int, num_blocks: int,
                    conn: _Connection) -> None:
        sent, end = first_block, first_block + num_blocks if num_blocks else None
        layers, block_bytes = self.fingerprint.num_layers, self.fingerprint.num_layers * self.fingerprint.block_layer_bytes
        while not conn.closed.is_set():
            if self.leases.get(request_id) is not entry:  # released, aborted or expired meanwhile
                code = "expired" if entry.ended == "expired" else "unknown_request"
                return await self._error(conn, request_id, code, f"the lease on {request_id}'s KV ended "
                                         f"({entry.ended}) while streaming")
            limit = entry.written if end is None else min(entry.written, end)
            if sent < limit:
                count = min(limit - sent, frame_blocks(block_bytes))
                try:
                    payload = entry.read(sent, count)
                    if len(payload) != count * block_bytes:
                        raise ValueError(f"read {len(payload)} bytes for {count} blocks of {block_bytes}")
                except Exception as e:  # the owner's bug: this request's KV cannot be served
                    log.exception("reading the KV blocks of %s failed", request_id)
                    self._end(request_id, "failed")
                    return await self._error(conn, request_id, "internal", f"cannot read the KV of {request_id}: {e}")
                conn.writer.write(protocol.blocks_header(request_id, sent, count, 0, layers, payload))
                conn.writer.write(payload)
                # TCP flow control: drain returns once the consumer's socket took the bytes
                await asyncio.wait_for(conn.writer.drain(), self.leases.ttl_s)
                self.leases.renew(request_id, self.clock())
                sent += count
                self.stats.blocks_sent += count
                self.stats.bytes_sent += len(payload)
                continue
            if entry.complete or sent == end:
                conn.writer.write(protocol.encode("done", request_id=request_id, num_blocks=sent))
                await conn.writer.drain()
                self.stats.transfers += 1
                return
            entry.changed.clear()
            waits = [asyncio.ensure_future(entry.changed.wait()), asyncio.ensure_future(conn.closed.wait())]
            done, pending = await asyncio.wait(waits, timeout=self.leases.ttl_s / 3,
                                               return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()
            if not done and self.leases.get(request_id) is entry:  # still computing: tell the pull
                conn.writer.write(protocol.encode("pending", request_id=request_id, num_blocks=sent))
                await asyncio.wait_for(conn.writer.drain(), self.leases.ttl_s)
        # the consumer went away mid-stream: it will not pull this again
        self._end(request_id, "released")

    async def _error(self, conn: _Connection, request_id: str, code: str, message: str) -> None:
        self.stats.failed(code)
        conn.writer.write(protocol.encode("error", request_id=request_id, code=code, message=message[:1024]))
        await conn.writer.drain()


def frame_blocks(block_bytes: int) -> int:
    """Blocks per data frame for blocks of ``block_bytes`` (every layer): :data:`MAX_FRAME_BLOCKS`,
    fewer for large blocks so a frame stays under :data:`MAX_FRAME_BYTES`, at least one."""
    return max(1, min(MAX_FRAME_BLOCKS, MAX_FRAME_BYTES // block_bytes))


async def _read_header(reader: asyncio.StreamReader) -> dict:
    n = protocol.header_length(await reader.readexactly(4))
    return protocol.decode(await reader.readexactly(n))


def _peer(writer: asyncio.StreamWriter) -> str:
    """The peer's IP address (the slots' unit of fairness)."""
    name = writer.get_extra_info("peername")
    return str(name[0]) if isinstance(name, tuple) and name else str(name)
