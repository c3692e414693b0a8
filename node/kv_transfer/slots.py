"""Who holds a connection on a KV transfer endpoint: per-peer caps, a handshake deadline, fair eviction.

A connection is **handshaking** from its accept until the handshake (:mod:`.handshake`) ends, at
most :data:`HANDSHAKE_TIMEOUT_S`; then **established** (its peer proved the pool's token). Each
state has its own slots, so peers that never authenticate cannot take the slots real pulls need:

- handshaking: at most :data:`MAX_HANDSHAKES_PER_PEER` from one address (more are refused
  ``busy`` at once) and :data:`MAX_HANDSHAKES` in all. A new one past that cuts the oldest
  handshake **of the address that has the most under way** (the cut peer is told ``busy``): a
  flood from a few addresses cuts its own handshakes, not a real peer's, which takes two round
  trips and holds one or a few. Only a flood from more addresses than :data:`MAX_HANDSHAKES`,
  each holding as few handshakes as the real peer, can cut a real one (then the oldest goes);
- established: at most :data:`MAX_CONNECTIONS_PER_PEER` from one address and
  :data:`MAX_CONNECTIONS` in all. A new one past either cap **evicts** the longest-idle
  connection (of that address, or of all) that is not streaming a pull; when every one is
  streaming, it is refused ``busy``.

**Idle** means no useful work: a connection's clock restarts when it is established and each time
it streams a frame of a request the producer holds. A pull of a request the producer does not
hold (an unknown id, say) does not restart it, so a peer cannot keep a slot by pulling nonsense;
one idle past :data:`IDLE_TIMEOUT_S` is closed. A consumer whose pooled connection was evicted
reconnects (:mod:`.consumer`).

Peers are told apart by IP address only. Behind a proxy that makes every connection come from
one address (a service-mesh sidecar, a NAT), every peer shares the per-peer caps.

Pure bookkeeping on the endpoint's event loop: :class:`Slots` decides, each slot's ``cut``
callback closes its connection.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_CONNECTIONS = 256  # established connections: each holds a task and buffers
MAX_CONNECTIONS_PER_PEER = 128  # of them from one address
MAX_HANDSHAKES = 64  # connections still in their handshake
MAX_HANDSHAKES_PER_PEER = 16  # of them from one address (a consumer opens at most 4 at once to one producer)
HANDSHAKE_TIMEOUT_S = 5.0  # accept to welcome: a peer that takes longer is cut
IDLE_TIMEOUT_S = 300.0  # an established connection that streams nothing this long is closed


class Busy(Exception):
    """No slot for this connection; the message says why (it is told to the peer)."""


@dataclass(eq=False)
class Slot:
    """One connection's place: its peer's address, how to cut it, and its state (seconds are
    ``time.monotonic``)."""

    peer: str
    cut: Callable[[], None]
    opened: float = field(default_factory=time.monotonic)
    active: float = 0.0  # last useful work: established, or a frame of a held request streamed
    established: bool = False
    streaming: bool = False  # serving a pull of a held request now
    evicted: bool = False

    def touch(self) -> None:
        """Useful work was done: the idle clock restarts."""
        self.active = time.monotonic()

    def idle_s_left(self) -> float:
        """Seconds before this connection counts as idle past :data:`IDLE_TIMEOUT_S` (<= 0: it is)."""
        return max(self.active, self.opened) + IDLE_TIMEOUT_S - time.monotonic()


class Slots:
    """The endpoint's connections by state (see the module docstring); ``evicted`` counts the
    connections cut to make room."""

    def __init__(self) -> None:
        self._slots: set[Slot] = set()
        self.evicted = 0

    def __len__(self) -> int:
        return sum(not s.evicted for s in self._slots)

    def open(self, peer: str, cut: Callable[[], None]) -> Slot:
        """A handshaking slot for a connection from ``peer`` (when all are taken, cutting the
        oldest handshake of the address with the most under way).

        Raises:
            Busy: ``peer`` already has :data:`MAX_HANDSHAKES_PER_PEER` handshakes under way.
        """
        shaking = [s for s in self._slots if not s.established and not s.evicted]
        if sum(s.peer == peer for s in shaking) >= MAX_HANDSHAKES_PER_PEER:
            raise Busy(f"more than {MAX_HANDSHAKES_PER_PEER} handshakes at once from one address")
        if len(shaking) >= MAX_HANDSHAKES:
            held = Counter(s.peer for s in shaking)
            most = max(held.values())
            self._evict(min((s for s in shaking if held[s.peer] == most), key=lambda s: s.opened))
        slot = Slot(peer, cut)
        self._slots.add(slot)
        return slot

    def establish(self, slot: Slot) -> None:
        """Move a slot whose peer authenticated to the established ones, evicting the longest-idle
        connection that streams nothing when its address's or the endpoint's cap is reached.

        Raises:
            Busy: every connection it could take the place of is streaming.
        """
        live = [s for s in self._slots if s.established and not s.evicted]
        mine = [s for s in live if s.peer == slot.peer]
        if len(mine) >= MAX_CONNECTIONS_PER_PEER:
            candidates, cap = mine, f"{MAX_CONNECTIONS_PER_PEER} connections from one address"
        elif len(live) >= MAX_CONNECTIONS:
            candidates, cap = live, f"{MAX_CONNECTIONS} connections"
        else:
            candidates, cap = None, ""
        if candidates is not None:
            idle = [s for s in candidates if not s.streaming]
            if not idle:
                raise Busy(f"{cap}, every one streaming a pull")
            self._evict(min(idle, key=lambda s: max(s.active, s.opened)))
        slot.established = True
        slot.touch()

    def close(self, slot: Slot) -> None:
        """The connection ended (whatever the reason): its slot is free."""
        self._slots.discard(slot)

    def _evict(self, victim: Slot) -> None:
        victim.evicted = True
        self.evicted += 1
        victim.cut()
