"""The live knobs the SLO controller moves (rung 1, retune), and the range a pool lets it move them in.

Part of the pool model: :mod:`cadenza.pool.validate` refuses bounds that are empty or inverted
before a pool is applied, and the controller (:mod:`cadenza.control.decide`) moves each knob
inside them. Names and defaults come from the engine's knob registry
(:mod:`cadenza.node.core.knobs`), so an engine default changes in one place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from cadenza.node.core.knobs import BY_CRD

# The live knobs rung 1 may move: spec (camelCase) name -> engine (admin API) name.
KNOBS: dict[str, str] = {crd: BY_CRD[crd].name for crd in ("chunkSize", "tokenBudget", "stepTimeTargetMs")}


def knob_bounds(spec: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """The range rung 1 may move each live knob in, from ``spec.controller.bounds`` and ``spec.engine``.

    ``chunkSize`` always moves: by default from 32 (or the engine's, if smaller) up to the
    engine's ``chunkSize`` (256); a bound given alone keeps the other default. ``tokenBudget`` and
    ``stepTimeTargetMs`` move only when named; a missing side is the engine's value, or the
    other side when neither the engine nor its default sets one. Integer knobs round inwards (min up, max down).

    Raises:
        ValueError: a range whose min exceeds its max once defaulted, or a named knob with neither
            side given nor an engine value to start from — naming the field.
    """
    given = (spec.get("controller") or {}).get("bounds") or {}
    engine = spec.get("engine") or {}
    chunk = engine.get("chunkSize") or BY_CRD["chunkSize"].default
    out: dict[str, tuple[float, float]] = {}
    for camel, name in KNOBS.items():
        b = given.get(camel) or {}
        if camel == "chunkSize":
            high = b.get("max", chunk)
            low = b.get("min", min(32, high))
        elif camel not in given:
            continue
        else:
            current = engine.get(camel, BY_CRD[camel].default)
            low, high = b.get("min", current if current is not None else b.get("max")), b.get("max")
            high = high if high is not None else (current if current is not None else low)
            if low is None or high is None:
                raise ValueError(f"spec.controller.bounds.{camel}: give min or max (spec.engine.{camel} is unset)")
        if name != "step_time_target_ms":
            low, high = math.ceil(low), math.floor(high)
        if low > high:
            raise ValueError(f"spec.controller.bounds.{camel}: min {low:g} exceeds max {high:g} "
                             f"(a side not given defaults to spec.engine.{camel} or 32)")
        out[name] = (float(low), float(high))
    return out
