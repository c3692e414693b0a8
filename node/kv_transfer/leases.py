"""Leases on a prefill replica's KV blocks: held for a decode replica until it pulls them, no longer.

A prefill replica keeps a request's blocks after the request's prefill ends only under a lease:
taken when the request is published (default :data:`DEFAULT_LEASE_S`), renewed each time
the decode side makes progress (a frame it consumed), while the prefill replica's engine still
works on the prompt (queued or part computed) and while the decode replica holds the request in
its queue (its ``renew`` frames, for at most its maximum hold), and ended by the first of: release (the
decode side has every block, or gave up), abort, or expiry. Whoever owns the blocks frees them on
each end — :meth:`LeaseTable.release` and :meth:`LeaseTable.expire` hand back what was held.

Pure: the clock is passed in (seconds, monotonic), so the prefill replica, the tests and the
simulator share it. Invariant: a request is held at most once; nothing is handed back twice.

Source: NixlConnector's lease on prefill blocks (30 s, ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``); the
failure it avoids: prefill blocks stranded for minutes after the decode side died.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

DEFAULT_LEASE_S = 30.0

T = TypeVar("T")


@dataclass(slots=True)
class Lease(Generic[T]):
    """One request's held blocks (``handle``: whatever the owner frees them by) and when they go."""

    handle: T
    deadline: float


class LeaseTable(Generic[T]):
    """Leases by request id.

    Args:
        ttl_s: a lease's length from its last renewal (seconds, > 0).

    Raises:
        ValueError: a non-positive ``ttl_s``.
    """

    def __init__(self, ttl_s: float = DEFAULT_LEASE_S) -> None:
        if not ttl_s > 0:
            raise ValueError(f"lease ttl_s: must be > 0, got {ttl_s!r}")
        self.ttl_s = float(ttl_s)
        self._leases: dict[str, Lease[T]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def hold(self, request_id: str, handle: T, now: float) -> None:
        """Hold ``handle`` for ``request_id`` until ``now + ttl_s``; ValueError if already held."""
        if request_id in self._leases:
            raise ValueError(f"request {request_id!r} already holds a lease")
        self._leases[request_id] = Lease(handle, now + self.ttl_s)

    def renew(self, request_id: str, now: float) -> bool:
        """Push the deadline to ``now + ttl_s``; False when the request holds no lease (any more)."""
        lease = self._leases.get(request_id)
        if lease is None:
            return False
        lease.deadline = max(lease.deadline, now + self.ttl_s)
        return True

    def get(self, request_id: str) -> T | None:
        lease = self._leases.get(request_id)
        return None if lease is None else lease.handle

    def release(self, request_id: str) -> T | None:
        """End the lease; the handle to free, or None when there was none (already ended)."""
        lease = self._leases.pop(request_id, None)
        return None if lease is None else lease.handle

    def expire(self, now: float) -> list[tuple[str, T]]:
        """End every lease whose deadline has passed; their (request id, handle) to free."""
        gone = [rid for rid, lease in self._leases.items() if lease.deadline <= now]
        return [(rid, self._leases.pop(rid).handle) for rid in gone]

    def next_deadline(self) -> float | None:
        """The earliest deadline held (seconds), None with no lease."""
        return min((lease.deadline for lease in self._leases.values()), default=None)
