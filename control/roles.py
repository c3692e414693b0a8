"""The roles of an ``auto`` pool's replicas and the in-place moves between them, as plain data.

A replica of a ``mode: auto`` pool serves in one role at a time; the role says which gateway
routes it is in (:data:`ROUTES`) and which live settings it runs
(:meth:`cadenza.control.in_place.InPlace.settings`):

- ``colocated``: interactive and batch traffic (background goes with batch), mixed batches;
- ``interactive``: interactive traffic only, with ``dedicated.engine``'s settings;
- ``prefill``: no class of its own: the gateway sends it the long prompts it moves (the selective
  rule of disaggregated pools), whose KV the replicas that decode pull from its KV endpoint.

A move takes ONE replica from one role to another (:data:`MOVE`). A move away from colocated
(:data:`~cadenza.control.history.SPLITS`) first takes the replica out of some routes and waits
until it has no request of the classes it will no longer serve (:attr:`Move.drains`); a move
back to colocated needs no drain: the replica only takes more traffic. Pure: no I/O, no clock;
:mod:`cadenza.control.in_place` carries the moves out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from cadenza.control.decide import Shape
from cadenza.control.history import AGGREGATE, DEDICATE, DISAGGREGATE, MERGE
from cadenza.node.core.policy import CLASSES

COLOCATED, INTERACTIVE, PREFILL = "colocated", "interactive", "prefill"
ROLES = (COLOCATED, INTERACTIVE, PREFILL)
# The gateway routes of each role: its interactive and batch class routes, or its prefill route.
ROUTES: Mapping[str, frozenset[str]] = {COLOCATED: frozenset({"interactive", "batch"}),
                                        INTERACTIVE: frozenset({"interactive"}), PREFILL: frozenset({"prefill"})}


@dataclass(frozen=True)
class Move:
    """One move of one replica.

    Attributes:
        name: one of :data:`~cadenza.control.history.MOVES`.
        source, target: the role it leaves and the role it takes.
        drains: the classes the replica must have no request of (running or waiting) before it
            takes ``target``; empty: it takes it at once.
        draining_routes: the routes it stays in while it drains.
    """

    name: str
    source: str
    target: str
    drains: tuple[str, ...] = ()
    draining_routes: frozenset[str] = frozenset()


MOVE: Mapping[str, Move] = {
    # Batch and background leave it; its interactive streams go on under the same settings.
    DEDICATE: Move(DEDICATE, COLOCATED, INTERACTIVE, ("batch", "background"), ROUTES[INTERACTIVE]),
    MERGE: Move(MERGE, INTERACTIVE, COLOCATED),
    # Every class leaves it: a prefill replica decodes nothing, so nothing may still stream there
    # when its chunk grows to the prefill settings'.
    DISAGGREGATE: Move(DISAGGREGATE, COLOCATED, PREFILL, CLASSES, frozenset()),
    # The KV it published stays leased and served by its KV endpoint; it only takes more traffic.
    AGGREGATE: Move(AGGREGATE, PREFILL, COLOCATED),
}


class Drain(NamedTuple):
    """A move in progress: ``replica`` (name) out of some routes since ``since`` (seconds on the
    controller's clock), waiting to take ``move``'s target role."""

    replica: str
    since: float
    move: str = DEDICATE

    def to_status(self) -> dict[str, Any]:
        return {"replica": self.replica, "since": self.since, "move": self.move}


def shape_of(roles: list[str]) -> Shape:
    """Replicas per role of replicas in ``roles`` (a role outside :data:`ROLES` counts as colocated)."""
    return Shape(sum(r not in (INTERACTIVE, PREFILL) for r in roles), roles.count(INTERACTIVE), roles.count(PREFILL))


def shape_after(shape: Shape, move: str) -> Shape:
    """``shape`` once ``move`` is done (one replica from its source role to its target role)."""
    m = MOVE[move]
    counts = shape_doc(shape)
    counts[m.source] -= 1
    counts[m.target] += 1
    return Shape(**counts)


def shape_doc(shape: Shape) -> dict[str, int]:
    """``{"colocated": n, "interactive": m, "prefill": p}`` (``status.shape``, ``lastShift`` from/to)."""
    return {COLOCATED: shape.colocated, INTERACTIVE: shape.interactive, PREFILL: shape.prefill}


def describe(shape: Shape) -> str:
    """``"colocated: n, interactive: m, prefill: p"`` (Events, conditions, spans)."""
    return ", ".join(f"{role}: {count}" for role, count in shape_doc(shape).items())


def busy(classes: Mapping[str, Any], move: str) -> int:
    """Requests running or waiting on a replica in the classes ``move`` drains, from its ``GET
    /ready`` ``classes`` document (``{class: {"running": n, "waiting": m, ...}}``).

    Raises:
        KeyError, TypeError: a document without those counts.
    """
    return sum(int(classes[c]["running"]) + int(classes[c]["waiting"]) for c in MOVE[move].drains)
