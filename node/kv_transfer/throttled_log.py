"""Log lines that peers can cause, at most one per kind a minute: a flood of refusals or failed
pulls is one line a minute, which says how many it stands for."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

EVERY_S = 60.0  # lines of one kind are logged at most this often


class ThrottledLog:
    """``warning(kind, ...)`` logs at most once per :data:`EVERY_S` per ``kind``; the next line
    logged says how many of that kind were held back since.

    Args:
        logger: where the lines go.
        clock: seconds (``time.monotonic``; injected by tests).
    """

    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.clock = logger, clock
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (last logged, held back since)

    def warning(self, kind: str, message: str, *args: object) -> None:
        last, since = self._last.get(kind, (-EVERY_S, 0))
        now = self.clock()
        if now - last < EVERY_S:
            self._last[kind] = (last, since + 1)
            return
        if since:
            message, args = f"{message} (%d more since the last such line)", (*args, since)
        self.logger.warning(message, *args)
        self._last[kind] = (now, 0)
