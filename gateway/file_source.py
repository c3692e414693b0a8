"""Upstreams from a config file, re-read when it changes or on SIGHUP (local mode).

``cadenza up`` rewrites the file when replicas restart on new ports; the gateway notices within
``interval_s`` (it compares the file's mtime, size and inode, so an atomic rename counts too), or
at once when sent SIGHUP (:meth:`FileSource.request_reload`, wired by :mod:`.cli`). Only the
roles are taken from a re-read file; ``default_class`` and ``max_outstanding`` hold from start-up.
A file that has become unreadable or invalid is reported and the last good upstreams are kept.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from cadenza.gateway.config import GatewayConfig, GatewayConfigError, load_config
from cadenza.gateway.upstreams import Upstreams

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 2.0


class FileSource:
    """Keeps an :class:`Upstreams` table equal to the ``roles`` of a config file.

    Args:
        path: the JSON or YAML config file (:mod:`.config`).
        interval_s: seconds between checks of the file's modification stamp.
    """

    def __init__(self, path: str | Path, interval_s: float = POLL_INTERVAL_S) -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self._stamp: tuple[int, int, int] | None = None
        self._wake = asyncio.Event()

    def _current_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def load(self) -> GatewayConfig:
        """Read the file now (the stamp is taken first, so a write while reading is seen next time).

        Raises:
            GatewayConfigError: unreadable or invalid.
        """
        self._stamp = self._current_stamp()
        return load_config(self.path)

    def reload(self, upstreams: Upstreams) -> bool:
        """Apply the file's roles to ``upstreams``; keep them on a bad file. Returns whether they changed."""
        try:
            config = self.load()
        except GatewayConfigError as exc:
            logger.warning("keeping the last upstreams: %s", exc)
            return False
        changed = upstreams.replace(config.roles)
        if changed:
            logger.info("upstreams from %s: %s", self.path, upstreams.urls())
        return changed

    def request_reload(self) -> None:
        """Re-read the file at the next turn of :meth:`watch` (the SIGHUP handler)."""
        self._wake.set()

    async def watch(self, upstreams: Upstreams) -> None:
        """Re-read the file whenever its stamp changes or a reload is requested, until cancelled."""
        if self._stamp is None:
            self.reload(upstreams)
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except TimeoutError:
                pass
            forced = self._wake.is_set()
            self._wake.clear()
            if forced or self._current_stamp() != self._stamp:
                self.reload(upstreams)
