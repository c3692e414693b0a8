"""A fake clock for asyncio code that reads ``time.perf_counter()`` and awaits ``asyncio.sleep()``.

Installed into one module (``clock.install(monkeypatch, module)``), it replaces that module's
``time`` and ``asyncio`` names only: the event loop, sockets and every other module keep real time.
Seconds pass only when the code under test sleeps (its sleep ends at once, ``oversleep`` late, as
on a loaded machine) or when the test moves ``now``, so schedules are checked exactly.
"""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace


class _Asyncio:
    """The ``asyncio`` module, but with the fake clock's ``sleep``."""

    def __init__(self, sleep) -> None:
        self.sleep = sleep

    def __getattr__(self, name: str):
        return getattr(asyncio, name)


class FakeTime:
    """Args:
        stop_at: the clock never passes this: a sleep that would wake later sets :attr:`stopped`
            and waits until it is cancelled.
        oversleep: seconds each sleep wakes late.
    """

    def __init__(self, stop_at: float = math.inf, oversleep: float = 0.0) -> None:
        self.now = 0.0
        self.stop_at = stop_at
        self.oversleep = oversleep
        self.stopped = asyncio.Event()

    def perf_counter(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        if self.now + seconds > self.stop_at:
            self.stopped.set()
            await asyncio.Event().wait()  # until cancelled
        await asyncio.sleep(0)  # let tasks started before this sleep run first, at the time they started
        self.now += max(seconds, 0.0) + self.oversleep

    def install(self, monkeypatch, module) -> None:
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=self.perf_counter, monotonic=self.perf_counter,
                                                            time=time.time))
        monkeypatch.setattr(module, "asyncio", _Asyncio(self.sleep))
