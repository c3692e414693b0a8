"""Wait for a condition, never for a length of time.

A test that sleeps and then looks is slow on a quiet machine and flaky on a busy one. These poll a
predicate until it holds; the timeout is generous (it only bounds how long a broken build takes to
fail) and is never what a test measures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

TIMEOUT_S = 30.0


def wait_until(predicate: Callable[[], T], timeout: float = TIMEOUT_S, what: str = "the condition",
               interval: float = 0.02, ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Poll ``predicate`` from this thread until it returns something truthy; return that.

    Exceptions of the types in ``ignore`` count as "not yet" (a file not written yet, a port not open).

    Raises:
        AssertionError: still false after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ignore:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


async def until(predicate: Callable[[], T], timeout: float = TIMEOUT_S, what: str = "the condition",
                interval: float = 0.01) -> T:
    """:func:`wait_until` for the event loop: polls without blocking it (other tasks run meanwhile)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)
    return value
