"""Serving an aiohttp app from a command: listen, run until SIGINT/SIGTERM, clean up.

Shared by ``cadenza serve`` and ``cadenza gateway``. The runner uses
``handler_cancellation=True``: a client that disconnects cancels its handler at once, so an
upstream request or a generation stops even while nothing is being written to the client yet.
Connections are hardened by :mod:`cadenza.node.http.hardening`: OpenAI JSON for malformed requests,
and header, idle and body timeouts.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from cadenza.node.http.hardening import HttpTimeouts, app_runner

logger = logging.getLogger(__name__)


async def run_app(app: web.Application, host: str, port: int, name: str,
                  main: Callable[[asyncio.Event], Awaitable[int]] | None = None,
                  extra_signals: Mapping[int, Callable[[], None]] | None = None,
                  timeouts: HttpTimeouts | None = None) -> int:
    """Serve ``app`` on ``host:port`` until SIGINT or SIGTERM; return the exit code.

    Args:
        name: what is listening, for the log lines.
        main: run once listening, given the stop event (set by SIGINT/SIGTERM); its return value is
            the exit code. Default: wait for the stop event, exit 0.
        extra_signals: more signal handlers while serving (e.g. SIGHUP to reload).
        timeouts: header, idle and body timeouts (default: :class:`HttpTimeouts`'s).

    Returns:
        1 when the address cannot be listened on (in use, bad host or port), else ``main``'s code.
    """
    runner = app_runner(app, timeouts or HttpTimeouts(), handler_cancellation=True, access_log=None)
    await runner.setup()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    handlers = {signal.SIGINT: stop.set, signal.SIGTERM: stop.set, **(extra_signals or {})}
    installed: list[int] = []
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except (OSError, OverflowError) as exc:  # port in use, bad host or port
            logger.error("cannot listen on %s:%s: %s", host, port, exc)
            return 1
        logger.info("%s listening on http://%s:%d", name, host, port)
        for sig, handler in handlers.items():
            loop.add_signal_handler(sig, handler)
            installed.append(sig)
        code = await main(stop) if main is not None else await _until(stop)
        logger.info("%s shutting down", name)
        return code
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await runner.cleanup()


async def _until(stop: asyncio.Event) -> int:
    await stop.wait()
    return 0
