"""What the SLO controller remembers between evaluations, and how it is stored in ``status.controller``.

:class:`History` holds the times of the last action, retune and reshape, the reshapes inside the
flap window, since when interactive has breached with rung 1 at its bound or every class has
been clear, a freeze, and the last decisions worth a record. It is plain data on the injected
clock (epoch seconds in the operator and ``cadenza up``), written to the pool's status as RFC 3339
times (:meth:`History.to_status`) and read back by a restarted process
(:meth:`History.from_status`), which refuses garbage field by field rather than failing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

MAX_LOG = 10  # decisions kept in the history's log
# The reshapes: colocated -> interactive and back (rung 2); colocated -> prefill and back (rung 3).
DEDICATE, MERGE = "dedicate", "merge"
DISAGGREGATE, AGGREGATE = "disaggregate", "aggregate"
MOVES = (DEDICATE, MERGE, DISAGGREGATE, AGGREGATE)
SPLITS = frozenset({DEDICATE, DISAGGREGATE})  # away from colocated; MERGE and AGGREGATE come back


@dataclass(frozen=True)
class History:
    """What the controller remembers between evaluations (stored in ``status.controller``).

    Times are seconds on the injected clock (epoch seconds in the operator).
    """

    last_action: float | None = None
    last_retune: float | None = None
    last_reshape: float | None = None
    reshapes: tuple[tuple[float, str], ...] = ()  # (time, one of MOVES), within the flap window
    bound_since: float | None = None  # interactive breaching with rung 1 at its bound, since
    clear_since: float | None = None  # every class clear (slow window), since
    frozen_until: float | None = None  # reshaping frozen (flapping) until
    log: tuple[Mapping[str, Any], ...] = ()  # the last decisions that changed something or were advised

    def to_status(self) -> dict[str, Any]:
        doc: dict[str, Any] = {}
        for key, value in (("lastAction", self.last_action), ("lastRetune", self.last_retune),
                           ("lastReshape", self.last_reshape), ("boundSince", self.bound_since),
                           ("clearSince", self.clear_since), ("frozenUntil", self.frozen_until)):
            if value is not None:
                doc[key] = rfc3339(value)
        if self.reshapes:
            doc["reshapes"] = [{"time": rfc3339(t), "move": move} for t, move in self.reshapes]
        if self.log:
            doc["decisions"] = [dict(entry) for entry in self.log]
        return doc

    @classmethod
    def from_status(cls, doc: Mapping[str, Any] | None) -> History:
        """The history a previous operator stored (an empty one for None or garbage fields)."""
        doc = doc if isinstance(doc, Mapping) else {}
        t = {key: _parse_time(doc.get(key)) for key in ("lastAction", "lastRetune", "lastReshape", "boundSince",
                                                        "clearSince", "frozenUntil")}
        stored = doc.get("reshapes") if isinstance(doc.get("reshapes"), list) else []
        reshapes = tuple((when, r.get("move")) for r in stored
                         if isinstance(r, Mapping) and (when := _parse_time(r.get("time"))) is not None
                         and r.get("move") in MOVES)
        decisions = doc.get("decisions") if isinstance(doc.get("decisions"), list) else []
        log = tuple(e for e in decisions if isinstance(e, Mapping))[-MAX_LOG:]
        return cls(t["lastAction"], t["lastRetune"], t["lastReshape"], reshapes, t["boundSince"], t["clearSince"],
                   t["frozenUntil"], log)


def rfc3339(t: float) -> str:
    """``t`` (epoch seconds) as an RFC 3339 UTC timestamp, to the second."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


_LATEST = 1e11  # epoch seconds (year 5138): anything later is garbage, not a time


def _parse_time(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value) if math.isfinite(value) and abs(value) < _LATEST else None
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except (ValueError, OverflowError):
        return None
