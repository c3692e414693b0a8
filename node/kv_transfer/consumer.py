"""The decode side's KV transfer client: pulls a request's blocks from a prefill replica, verified.

:meth:`KVConsumer.pull` connects (or reuses an idle connection to the same producer), runs the
handshake (:mod:`.handshake`: the producer must prove the pool's token before this replica says
anything about itself, and its fingerprint must equal ours) and checks the producer's boot id
against the one the request was prefilled under (else the producer restarted and holds nothing
of it), then yields the request's
blocks frame by frame as :class:`ReceivedBlocks`, each checked against its CRC32C before it is
yielded, and releases the producer's lease once the last one is in (or on any failure, when the
connection still works). Every failure is one :class:`~.protocol.TransferError` with its kind; the
caller drops what it got from the first bad block on and recomputes it.

Idle connections are kept per producer address (at most :data:`MAX_IDLE_PER_PRODUCER`); one
that saw a new boot id replaces them all (a connection to a restarted producer is never reused:
llm-d's stale-connection crash). A connection that failed in any way is closed, never returned.
A pooled connection the producer closed before answering (it evicts idle ones for new peers:
:mod:`.slots`) is replaced by a new one once, so the pull goes on. At most
:data:`MAX_HANDSHAKES_PER_PRODUCER` handshakes run at once to one producer (it refuses a burst
from one address).
A producer that stops sending for ``read_timeout_s`` fails the pull (``connection``): a decode
replica never waits forever on remote KV. Everything the producer says is checked before it is
believed: its welcome's version and fingerprint, each frame's request, range and size (before
its payload is read), and each payload's CRC32C. The pulls also measure the link
(:attr:`KVConsumer.bandwidth`): payload bytes over the time a read waited for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from cadenza.node.kv_transfer import handshake, protocol
from cadenza.node.kv_transfer.handshake import TokenSource
from cadenza.node.kv_transfer.protocol import Fingerprint, TransferError
from cadenza.node.kv_transfer.receiver import ConnectionEnded, Receiver

MAX_IDLE_PER_PRODUCER = 8  # pooled connections kept per producer; more are closed when returned
MAX_HANDSHAKES_PER_PRODUCER = 4  # handshakes under way at once to one producer (the others wait)
MIN_MEASURED_BYTES = 2**20  # the link's bandwidth is reported once this much was timed


@dataclass(frozen=True, slots=True)
class ReceivedBlocks:
    """One verified frame: ``num_blocks`` blocks from ``first_block`` of the request, all
    ``num_layers`` layers from ``first_layer``, as raw bytes laid out layer-major per block."""

    first_block: int
    num_blocks: int
    first_layer: int
    num_layers: int
    payload: bytearray


@dataclass(slots=True)
class _Connection:
    receiver: Receiver
    boot_id: str
    reused: bool = False  # taken from the idle pool (the producer may have closed it meanwhile)

    def write(self, frame: bytes) -> None:
        self.receiver.transport.write(frame)

    @property
    def usable(self) -> bool:
        t = self.receiver.transport
        return t is not None and not t.is_closing() and not self.receiver._ended

    async def read(self, timeout_s: float) -> dict:
        """The next header; the connection ending between frames is ``connection``, inside one
        ``truncated``."""
        try:
            prefix = await asyncio.wait_for(self.receiver.read_exactly(4), timeout_s)
        except ConnectionEnded as e:
            raise TransferError("truncated" if e.partial else "connection",
                                "the producer closed the connection") from None
        try:
            body = await asyncio.wait_for(self.receiver.read_exactly(protocol.header_length(prefix)), timeout_s)
        except ConnectionEnded:
            raise TransferError("truncated", "the connection ended inside a header") from None
        return protocol.decode(body)

    async def payload(self, n: int, timeout_s: float) -> bytearray:
        try:
            return await asyncio.wait_for(self.receiver.read_payload(n), timeout_s)
        except ConnectionEnded:
            raise TransferError("truncated", f"the connection ended inside a {n}-byte payload") from None

    def close(self) -> None:
        if self.receiver.transport is not None:
            self.receiver.transport.close()


class KVConsumer:
    """Pulls KV blocks from prefill replicas.

    Args:
        fingerprint: this engine's KV layout (the producer must match it).
        token: the pool's token, or a function that reads it at each handshake (None: every
            pull fails ``unauthorized``).
        connect_timeout_s: seconds to connect and finish the handshake.
        read_timeout_s: seconds a pull waits for the producer's next frame.
    """

    def __init__(self, fingerprint: Fingerprint, *, token: str | TokenSource | None, connect_timeout_s: float = 5.0,
                 read_timeout_s: float = 30.0) -> None:
        self.fingerprint = fingerprint
        self.token = handshake.token_source(token)
        self._handshakes: dict[tuple[str, int], asyncio.Semaphore] = {}
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._boot: dict[tuple[str, int], str] = {}  # the last boot id seen per producer
        self.link_bytes = 0  # payload bytes received while a pull waited on the link, and its wait
        self.link_s = 0.0

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second the link delivered payloads at, over every pull so far (None before
        :data:`MIN_MEASURED_BYTES` were measured)."""
        if self.link_bytes < MIN_MEASURED_BYTES or self.link_s <= 0:
            return None
        return self.link_bytes / self.link_s

    async def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()

    async def pull(self, host: str, port: int, request_id: str, boot_id: str | None = None,
                   first_block: int = 0, num_blocks: int = 0) -> AsyncIterator[ReceivedBlocks]:
        """The request's blocks from ``first_block``, verified, in order.

        Args:
            host, port: the producer's KV transfer endpoint.
            request_id: the request as the producer published it.
            boot_id: the producer's boot id the request was prefilled under (None: any).
            first_block: blocks before it are not sent (already held locally).
            num_blocks: blocks wanted from ``first_block`` (0: every block the producer holds);
                fewer come when the producer holds fewer.

        Raises:
            TransferError: the pull failed; ``kind`` says how. Blocks yielded before it are good.
        """
        for name, value in (("first_block", first_block), ("num_blocks", num_blocks)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
                raise ValueError(f"{name}: must be a non-negative integer, got {value!r}")
        conn = await self._connection(host, port)
        ok = released = False
        try:
            while True:  # twice at most: a pooled connection the producer closed meanwhile is replaced once
                if boot_id is not None and conn.boot_id != boot_id:
                    released = True  # never release this id there: that process may hold another request's KV under it
                    ok = True  # the connection itself is good
                    raise TransferError("restarted", f"the producer at {host}:{port} restarted (boot id "
                                        f"{conn.boot_id}, the request was prefilled under {boot_id})")
                conn.write(protocol.encode("pull", request_id=request_id, first_block=first_block,
                                           num_blocks=num_blocks))
                try:
                    msg = await conn.read(self.read_timeout_s)
                    break
                except TransferError as e:
                    if e.kind != "connection" or not conn.reused:
                        raise
                    conn.close()
                    conn = await self._connection(host, port, fresh=True)
            expected, end = first_block, first_block + num_blocks if num_blocks else None
            while True:
                if msg.get("request_id") != request_id:
                    raise TransferError("protocol", f"a {msg['kind']} frame of {msg.get('request_id')!r} while pulling "
                                        f"{request_id!r}")
                if msg["kind"] == "blocks":
                    if msg["first_block"] != expected or (end is not None and expected + msg["num_blocks"] > end):
                        raise TransferError("protocol", f"blocks {msg['first_block']}+{msg['num_blocks']} while "
                                            f"pulling block {expected} (to {end})")
                    protocol.check_blocks_header(msg, self.fingerprint)
                    before = conn.receiver.waited_bytes, conn.receiver.waited_s
                    payload = await conn.payload(msg["nbytes"], self.read_timeout_s)
                    self.link_bytes += conn.receiver.waited_bytes - before[0]
                    self.link_s += conn.receiver.waited_s - before[1]
                    protocol.check_payload(msg, payload)
                    expected += msg["num_blocks"]
                    yield ReceivedBlocks(msg["first_block"], msg["num_blocks"], msg["first_layer"], msg["num_layers"],
                                         payload)
                elif msg["kind"] == "pending":
                    pass  # the producer is alive and still computing: the read timeout restarts
                elif msg["kind"] == "done":
                    if msg["num_blocks"] != expected:
                        raise TransferError("protocol", f"done after {expected} blocks, the producer says "
                                            f"{msg['num_blocks']}")
                    conn.write(protocol.encode("release", request_id=request_id))
                    ok = released = True
                    return
                elif msg["kind"] == "error":
                    ok = released = True  # the producer said so cleanly: it holds nothing; the connection is good
                    raise TransferError(msg["code"], msg["message"])
                else:
                    raise TransferError("protocol", f"a {msg['kind']} frame in a pull")
                msg = await conn.read(self.read_timeout_s)
        except (ConnectionError, OSError) as e:
            raise TransferError("connection", f"{host}:{port}: {e}") from None
        except TimeoutError:
            raise TransferError("connection", f"{host}:{port} sent nothing for {self.read_timeout_s:.0f} s") from None
        finally:
            if not released:  # a failed or abandoned pull: hand the lease back if the socket still works
                try:
                    conn.write(protocol.encode("release", request_id=request_id))
                except Exception:
                    pass
            if ok:
                self._return(host, port, conn)
            else:
                conn.close()

    async def release(self, host: str, port: int, boot_id: str, request_id: str) -> bool:
        """Tell the producer to free ``request_id``'s KV without pulling it (best effort: a
        producer that cannot be reached frees it when its lease ends). False, with nothing sent,
        when the producer is no longer the process ``boot_id`` names (it holds nothing of it).

        Raises:
            TransferError: the producer could not be reached or refused the handshake.
        """
        return await self._control(host, port, boot_id, "release", [request_id])

    async def renew(self, host: str, port: int, boot_id: str, request_ids: list[str]) -> bool:
        """Tell the producer that this side still holds ``request_ids`` queued, so their leases
        run on (best effort, like :meth:`release`). False, with nothing sent, when the producer
        is no longer the process ``boot_id`` names (it holds none of them, and an id there may
        be another request's).

        Raises:
            TransferError: the producer could not be reached or refused the handshake.
        """
        return await self._control(host, port, boot_id, "renew", request_ids)

    async def _control(self, host: str, port: int, boot_id: str, kind: str, request_ids: list[str]) -> bool:
        """Send one ``kind`` frame per request id over a pooled connection to the producer
        ``boot_id`` names; False, with nothing sent, when it has restarted since."""
        conn = await self._connection(host, port)
        if conn.boot_id != boot_id:
            self._return(host, port, conn)
            return False
        try:
            for request_id in request_ids:
                conn.write(protocol.encode(kind, request_id=request_id))
        except (ConnectionError, OSError) as e:
            conn.close()
            raise TransferError("connection", f"{host}:{port}: {e}") from None
        self._return(host, port, conn)
        return True

    def _return(self, host: str, port: int, conn: _Connection) -> None:
        idle = self._idle.setdefault((host, port), [])
        if len(idle) < MAX_IDLE_PER_PRODUCER and conn.boot_id == self._boot.get((host, port)):
            idle.append(conn)
        else:
            conn.close()

    async def _connection(self, host: str, port: int, fresh: bool = False) -> _Connection:
        idle = [] if fresh else self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if conn.usable:
                conn.reused = True
                return conn
            conn.close()
        gate = self._handshakes.setdefault((host, port), asyncio.Semaphore(MAX_HANDSHAKES_PER_PRODUCER))
        async with gate:
            return await self._connect(host, port)

    async def _connect(self, host: str, port: int) -> _Connection:
        where = f"{host}:{port}"
        token = self.token()
        if token is None:
            raise TransferError("unauthorized", "this replica has no pool token: it cannot pull KV")
        loop = asyncio.get_running_loop()
        try:
            _transport, receiver = await asyncio.wait_for(loop.create_connection(Receiver, host, port),
                                                          self.connect_timeout_s)
        except (OSError, TimeoutError) as e:
            raise TransferError("connection", f"cannot connect to {host}:{port}: {e or 'timed out'}") from None
        conn = _Connection(receiver, "")
        try:
            hello, nonce_c = handshake.hello()
            conn.write(hello)
            auth, nonce_p = handshake.answer(await conn.read(self.connect_timeout_s), token, nonce_c,
                                             self.fingerprint, where)
            conn.write(auth)
            boot_id = handshake.check_welcome(await conn.read(self.connect_timeout_s), token, nonce_c, nonce_p,
                                              self.fingerprint, where)
        except BaseException as e:
            conn.close()
            if isinstance(e, (OSError, TimeoutError)):
                raise TransferError("connection", f"{host}:{port}: handshake failed: {e or 'timed out'}") from None
            raise
        conn.boot_id = boot_id
        if self._boot.get((host, port), conn.boot_id) != conn.boot_id:
            for old in self._idle.pop((host, port), []):  # connections to the old process are stale
                old.close()
        self._boot[(host, port)] = conn.boot_id
        return conn
