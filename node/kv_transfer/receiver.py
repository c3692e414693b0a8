"""The consumer's side of a connection: frames received straight into their buffers.

``asyncio.StreamReader`` copies every byte about three times: it grows a buffer, slices ``bytes``
out of it, and deletes the slice. For KV payloads of megabytes that cost a third of the
throughput. :class:`Receiver` is an :class:`asyncio.BufferedProtocol` instead. Headers land in a
small staging buffer, and a payload is received into a ``bytearray`` allocated for it once its
header has been checked, with only the bytes already staged copied. The kernel writes the rest of
the payload where it stays.

Invariants: bytes are consumed in order and exactly once; while no payload is being read and the
staging buffer is full, reading pauses, which is TCP flow control back to the producer; the end of
the connection fails the wait in progress.
"""

from __future__ import annotations

import asyncio
import time

STAGE_BYTES = 256 * 2**10  # room for a header (at most 64 KiB) and what follows it


class ConnectionEnded(Exception):
    """The connection ended; ``partial`` says whether it did so inside what was being read."""

    def __init__(self, partial: bool) -> None:
        super().__init__("the connection ended" + (" mid-read" if partial else ""))
        self.partial = partial


class Receiver(asyncio.BufferedProtocol):
    """One connection's incoming bytes (see the module docstring); write with :attr:`transport`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._stage = bytearray(STAGE_BYTES)
        self._start = self._end = 0  # staged, unread bytes: self._stage[start:end]
        self._target: memoryview | None = None  # the payload being received, and how far
        self._filled = 0
        self._paused = False
        self._ended = False
        self._waiter: asyncio.Future | None = None
        # payload bytes that arrived while a read waited for them, and how long it waited: the
        # link's bandwidth (staged bytes had arrived before; they would measure memory)
        self.waited_bytes = 0
        self.waited_s = 0.0

    # -- the protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._filled:]
        if self._start and self._end == len(self._stage):  # make room at the end
            n = self._end - self._start
            self._stage[:n] = self._stage[self._start:self._end]
            self._start, self._end = 0, n
        return memoryview(self._stage)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self._filled += nbytes
        else:
            self._end += nbytes
            if self._end == len(self._stage) and not self._paused and self.transport is not None:
                self._paused = True  # nobody reads: let TCP hold the producer back
                self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._ended = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    # -- reading ----------------------------------------------------------------------------

    async def read_exactly(self, n: int) -> bytes:
        """The next ``n`` bytes (``n`` at most :data:`STAGE_BYTES`, for headers).

        Raises:
            ConnectionEnded: the connection ended first.
        """
        while self._end - self._start < n:
            if self._ended:
                raise ConnectionEnded(partial=self._end > self._start)
            self._resume()
            await self._wait()
        data = bytes(self._stage[self._start:self._start + n])
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        return data

    async def read_payload(self, n: int) -> bytearray:
        """The next ``n`` bytes in a buffer of their own, received in place.

        Raises:
            ConnectionEnded: the connection ended first (``partial``: some were received).
        """
        out = bytearray(n)
        view = memoryview(out)
        take = min(n, self._end - self._start)
        view[:take] = self._stage[self._start:self._start + take]
        self._start += take
        if self._start == self._end:
            self._start = self._end = 0
        if take < n:
            self._target, self._filled = view, take
            started = time.perf_counter()
            try:
                self._resume()
                while self._filled < n:
                    if self._ended:
                        raise ConnectionEnded(partial=True)
                    await self._wait()
            finally:
                self._target = None
            self.waited_bytes += n - take
            self.waited_s += time.perf_counter() - started
        return out
