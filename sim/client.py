"""A client that holds requests back: at most so many of a class in flight at the gateway, the
rest waiting at the client in arrival order.

This is how a batch job is run against a serving pool: the platform has the work queued and
wants it done as fast as the pool can, so its runner keeps a bounded number of requests in flight
(vLLM's ``--max-concurrency``, a batch API's worker pool) and sends the next when one ends. The
pool's batch throughput is then what its shape can deliver, not what was offered, and nothing is
refused for the backlog: it waits at the client, not in the gateway or an engine queue.

:class:`ConcurrencyLimit` is the client's bookkeeping, which :meth:`cadenza.sim.fleet.Fleet.run`
consults: an arrival of a limited class is sent at once when the class has room (:meth:`offer`),
else queued; each request of the class that ends (finished, or refused) sends the oldest queued
one (:meth:`ended`). From ``until_s`` on nothing more is sent: what still waits then is the
day's unsent backlog (:meth:`unsent`), reported, not failed. Pure bookkeeping: no clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping


class ConcurrencyLimit:
    """At most ``limits[cls]`` requests of each listed class in flight; others are not limited.

    Args:
        limits: class -> most requests in flight (>= 1).
        until_s: nothing is sent from this time on (seconds, the fleet's clock).

    Attributes:
        in_flight: class -> requests sent and not yet ended.
        waited_s: request index -> seconds it waited at the client before it was sent (only
            those that waited).

    Raises:
        ValueError: a limit below 1.
    """

    def __init__(self, limits: Mapping[str, int], until_s: float = math.inf) -> None:
        bad = {cls: n for cls, n in limits.items() if n < 1}
        if bad:
            raise ValueError(f"concurrency limits must be at least 1, got {bad}")
        self.limits, self.until_s = dict(limits), until_s
        self.in_flight = dict.fromkeys(limits, 0)
        self.waited_s: dict[int, float] = {}
        self._queue: dict[str, deque[tuple[int, float]]] = {cls: deque() for cls in limits}
        self._released: set[int] = set()

    def offer(self, index: int, cls: str, now: float) -> bool:
        """Request ``index`` of class ``cls`` arrives (or comes back, released by :meth:`ended`):
        True when it is sent now (counted in flight), False when it waits."""
        if index in self._released:
            self._released.discard(index)
            return True
        if cls not in self.limits:
            return True
        if self.in_flight[cls] < self.limits[cls] and not self._queue[cls] and now < self.until_s:
            self.in_flight[cls] += 1
            return True
        self._queue[cls].append((index, now))
        return False

    def ended(self, cls: str, now: float) -> int | None:
        """A sent request of class ``cls`` ended (finished or refused): the index of the queued
        request to send in its place now (already counted in flight; offer it to get True), or
        None."""
        if cls not in self.limits:
            return None
        self.in_flight[cls] -= 1
        queue = self._queue[cls]
        if not queue or now >= self.until_s:
            return None
        index, arrived = queue.popleft()
        self.waited_s[index] = now - arrived
        self.in_flight[cls] += 1
        self._released.add(index)
        return index

    def unsent(self) -> dict[str, int]:
        """Class -> requests still waiting at the client (none once the run has sent them all)."""
        return {cls: len(q) for cls, q in self._queue.items()}
