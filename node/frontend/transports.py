"""Where the engine core runs: a process of its own (:class:`ProcessCore`, the default) or a
thread of the server's process (:class:`ThreadCore`). Both take the same message objects and hand
every message the core emits to one callback on the event loop; :class:`EngineClient
<cadenza.node.frontend.client.EngineClient>` does not know which it talks to.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from cadenza.node.core.config import EngineConfig
from cadenza.node.core.codec import FRAME_HEADER, check_frame_length, decode, frame
from cadenza.node.core.messages import EngineDead, MessageError, Shutdown, StartCore

if TYPE_CHECKING:
    from cadenza.node.engine.engine_core import EngineCore
    from cadenza.node.runner.threads import ThreadChoice

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30.0  # a core process that does not exit after Shutdown is killed


class ThreadCore:
    """The core's loop in a thread of this process; messages pass as objects.

    Args:
        factory: builds the :class:`EngineCore` (called in the thread, so loading does not block
            the event loop).
    """

    def __init__(self, factory: Callable[[], "EngineCore"]) -> None:
        self._factory = factory
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._abandoned = False
        self.core: EngineCore | None = None  # white-box tests reach in; HTTP code never does

    def start(self, on_message: Callable[[object], None], loop: asyncio.AbstractEventLoop) -> None:
        def emit(message: object) -> None:
            try:
                loop.call_soon_threadsafe(on_message, message)
            except RuntimeError:  # the loop is closed: nobody is listening
                pass

        self._thread = threading.Thread(target=self._run, args=(emit,), name="cadenza-engine", daemon=True)
        self._thread.start()

    def _run(self, emit: Callable[[object], None]) -> None:
        from cadenza.node.engine.loop import CoreLoop, announce

        try:
            self.core = self._factory()
        except BaseException as exc:  # reported through wait_ready
            # config errors and an interrupt (Ctrl-C during a kernel build) need no traceback
            if not isinstance(exc, (ValueError, FileNotFoundError, KeyboardInterrupt)):
                logger.exception("engine failed to load")
            emit(EngineDead(str(exc), loaded=False, kind=type(exc).__name__))
            return
        announce(self.core, emit)
        try:
            CoreLoop(self.core, self._inbox, emit).run()
        except BaseException as exc:  # a bug, not a bad request: fail everyone loudly, never hang
            logger.exception("engine thread died")
            emit(EngineDead(f"{type(exc).__name__}: {exc}", loaded=True, kind=type(exc).__name__))

    def send(self, message: object) -> None:
        self._inbox.put(message)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._abandoned

    def kill(self) -> None:
        """Give up on a stalled loop: a thread cannot be killed, so it is left behind (a daemon:
        it goes with the process, which exits next) and :meth:`stop` no longer waits for it."""
        self._abandoned = True

    async def stop(self) -> None:
        if self._thread is not None and not self._abandoned:
            self._inbox.put(Shutdown())
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, SHUTDOWN_TIMEOUT_S)


class ProcessCore:
    """The core in its own process, over a Unix socket pair (msgpack frames, see
    :mod:`cadenza.node.engine.process`).

    Args:
        config: the engine configuration (sent as the first frame).
        eos_token_ids: end-of-sequence ids the tokenizer adds.
        threads: torch threads of the core process, and why (None: torch's default).
    """

    def __init__(self, config: EngineConfig, eos_token_ids: list[int], threads: "ThreadChoice | None" = None) -> None:
        self._start = StartCore(config.to_dict(), eos_token_ids, threads.threads if threads else None,
                                threads.reason if threads else "")
        self.process: subprocess.Popen | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._closing = False

    def start(self, on_message: Callable[[object], None], loop: asyncio.AbstractEventLoop) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cadenza.node.engine.process", "--fd", str(theirs.fileno()),
             "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())],
            pass_fds=(theirs.fileno(),), env=env,
        )
        theirs.close()
        self._reader_task = loop.create_task(self._read(ours, on_message))

    async def _read(self, sock: socket.socket, on_message: Callable[[object], None]) -> None:
        reason = "the engine core closed its connection"
        try:
            reader, self._writer = await asyncio.open_unix_connection(sock=sock)
            self._writer.write(frame(self._start))
            while True:
                header = await reader.readexactly(FRAME_HEADER.size)
                (length,) = FRAME_HEADER.unpack(header)
                body = await reader.readexactly(check_frame_length(length))
                try:
                    message = decode(body)
                except MessageError as exc:
                    logger.error("front end: dropping a bad frame from the engine core: %s", exc)
                    continue
                on_message(message)
        except asyncio.IncompleteReadError:
            pass
        except (OSError, MessageError, TypeError) as exc:  # TypeError: a start frame that cannot be encoded
            reason = f"the engine core's connection failed: {exc}"
        if self._closing:
            return
        code = await asyncio.get_running_loop().run_in_executor(None, self._exit_code)
        on_message(EngineDead(f"{reason} (process exit code {code})", loaded=True, kind="EngineDeadError"))

    def _exit_code(self) -> int | None:
        try:
            return self.process.wait(timeout=1.0) if self.process else None
        except subprocess.TimeoutExpired:
            return None

    def send(self, message: object) -> None:
        """Queue ``message`` for the core.

        Raises:
            TypeError: it holds a value msgpack cannot carry (an integer of 64 bits or more).
        """
        data = frame(message)  # encode first: a message that cannot be sent raises here, not later
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(data)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the core process (a stalled one: stopped or stuck in a step); its connection
        then closes, and :meth:`stop` does not wait for it to finish a step."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    async def stop(self) -> None:
        self._closing = True
        if self.process is None:
            return
        self.send(Shutdown())
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.process.wait, SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("the engine core did not exit %.0f s after shutdown; killing it", SHUTDOWN_TIMEOUT_S)
            self.process.kill()
            await loop.run_in_executor(None, self.process.wait)
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
