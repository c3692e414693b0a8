"""The engine core in a process of its own: ``python -m cadenza.node.engine.process --fd N``.

The front end (:mod:`cadenza.node.frontend.client`) starts this with one end of a Unix socket
pair as file descriptor ``N`` and sends a :class:`~cadenza.node.core.messages.StartCore` frame
first. The core loads the model, answers ``EngineReady`` (or ``EngineDead`` and exits 1), then
runs :class:`~cadenza.node.engine.loop.CoreLoop`: a reader thread decodes frames into the loop's
inbox, the loop writes each step's outputs back. Here the step loop owns its own interpreter —
tokenizing, detokenizing and HTTP never compete with it for the GIL (vLLM V1's ``EngineCore``
process, for the same reason).

Frames: a 4-byte big-endian length, then one msgpack message (:mod:`cadenza.node.core.messages`).
The core exits when the front end says Shutdown or goes away (its end of the socket closes); it
ignores SIGINT, which a terminal sends the whole process group, once it serves: the front end
decides (it drains the requests in flight first). While the model loads there is nothing to
drain: a Ctrl-C stops the loading (a build of the compiled CPU kernels with it, never to go on
without them), the core says so (``EngineDead``) and exits with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import signal
import socket
import sys
import threading

from cadenza.node.core.config import EngineConfig
from cadenza.node.core.codec import FRAME_HEADER, check_frame_length, decode, frame
from cadenza.node.core.messages import EngineDead, MessageError, StartCore

logger = logging.getLogger("cadenza.core")


def read_frame(sock: socket.socket) -> bytes | None:
    """One frame's payload, or None at the end of the stream.

    Raises:
        MessageError: a header announcing an impossible length, or a stream cut mid-frame.
    """
    header = _read_exactly(sock, FRAME_HEADER.size)
    if header is None:
        return None
    (length,) = FRAME_HEADER.unpack(header)
    body = _read_exactly(sock, check_frame_length(length))
    if body is None:
        raise MessageError("the stream ended inside a frame")
    return body


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None if left == n else b""
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _reader(sock: socket.socket, inbox: queue.SimpleQueue) -> None:
    """Decode frames into ``inbox`` until the front end goes away (then ``None``)."""
    try:
        while (body := read_frame(sock)) is not None:
            try:
                inbox.put(decode(body))
            except MessageError as exc:  # a front end of another version, or a bug: say so, go on
                logger.error("engine core: dropping a bad frame: %s", exc)
    except (OSError, MessageError) as exc:
        logger.info("engine core: the front end's stream ended: %s", exc)
    finally:
        inbox.put(None)


def serve(sock: socket.socket) -> int:
    """Run the core over ``sock``; the process exit code."""
    lock = threading.Lock()

    def emit(message: object) -> None:
        data = frame(message)
        with lock:
            sock.sendall(data)

    body = read_frame(sock)
    if body is None:
        return 0
    # Nothing to drain while the model loads: a Ctrl-C then stops loading (a kernel build with it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        start = decode(body)
        if not isinstance(start, StartCore):
            raise MessageError(f"expected StartCore first, got {type(start).__name__}")
        from cadenza.node.runner.threads import ThreadChoice, apply_threads

        if start.threads:
            apply_threads(ThreadChoice(start.threads, start.threads_reason or "set by the front end"))
        from cadenza.node.engine.engine_core import EngineCore

        core = EngineCore(EngineConfig.from_dict(start.config), start.eos_token_ids)
    except KeyboardInterrupt as exc:  # Ctrl-C while loading (during a kernel build, or not): stop loading
        logger.info("engine core: loading interrupted (%s); exiting", exc or "SIGINT")
        with contextlib.suppress(OSError):
            emit(EngineDead(f"loading interrupted: {exc or 'SIGINT'}", loaded=False, kind="KeyboardInterrupt"))
        return 130
    except Exception as exc:  # reported to the front end, which logs it
        if not isinstance(exc, (ValueError, FileNotFoundError)):
            logger.exception("engine failed to load")
        emit(EngineDead(str(exc), loaded=False, kind=type(exc).__name__))
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # serving: the front end decides when the core stops
    from cadenza.node.engine.loop import CoreLoop, announce

    try:
        announce(core, emit)
    except OSError:
        return 0  # the front end went away while the model loaded: nobody to serve

    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_reader, args=(sock, inbox), name="cadenza-core-reader", daemon=True).start()
    try:
        CoreLoop(core, inbox, emit).run()
    except BrokenPipeError:
        return 0  # the front end is gone: nobody to serve
    except Exception as exc:
        logger.exception("engine core loop died")
        try:
            emit(EngineDead(f"{type(exc).__name__}: {exc}", loaded=True, kind=type(exc).__name__))
        except OSError:
            pass
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cadenza.node.engine.process")
    parser.add_argument("--fd", type=int, required=True, help="this end of the front end's socket pair")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when the core stops
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not os.environ.get("TRITON_INTERPRET"):
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    sock = socket.socket(fileno=args.fd)
    try:
        return serve(sock)
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
