"""The SLO controller's settings: ``spec.slo`` and ``spec.controller`` of a ServingPool, defaulted.

:class:`ControllerSpec` is what :func:`~cadenza.control.decide.decide` and the control loop
(:mod:`.loop`) read of a pool: its SLO targets per class, the fast and slow windows, the
hysteresis, cooldown, dwell and flap window, the retune factor and the live knobs' bounds
(:func:`cadenza.pool.live_knobs.knob_bounds`), advisory mode and the staleness limit. The
defaults are the CRD's (``pool/servingpools.crd.yaml``), so a raw spec reads like an applied one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cadenza.node.core.knobs import BY_CRD
from cadenza.pool.live_knobs import KNOBS, knob_bounds


@dataclass(frozen=True)
class ControllerSpec:
    """``spec.slo`` and ``spec.controller`` of a pool, defaulted (seconds, milliseconds, ratios)."""

    slo: Mapping[str, Mapping[str, float]]
    fast_window_s: float = 30.0
    slow_window_s: float = 300.0
    min_samples: int = 200
    hysteresis: float = 0.1
    cooldown_s: float = 600.0
    dwell_s: float = 300.0
    flap_window_s: float = 1800.0
    retune_factor: float = 0.5
    bounds: Mapping[str, tuple[float, float]] = field(default_factory=dict)  # engine knob name -> (min, max)
    advisory: bool = False
    stale_s: float = 60.0
    disaggregate: bool = True  # rung 3 may move replicas into the prefill role

    @classmethod
    def from_pool_spec(cls, spec: Mapping[str, Any]) -> ControllerSpec:
        """Read a (schema-defaulted or raw) ServingPool spec.

        Raises:
            ValueError: bounds that are empty or inverted once defaulted (:func:`knob_bounds`).
        """
        c = spec.get("controller") or {}
        slow = float(c.get("windowSeconds", 300))
        return cls(
            slo={k: dict(v) for k, v in (spec.get("slo") or {}).items() if v},
            fast_window_s=float(c.get("fastWindowSeconds", 30)),
            slow_window_s=slow,
            min_samples=int(c.get("minSamples", 200)),
            hysteresis=float(c.get("hysteresis", 0.1)),
            cooldown_s=float(c.get("cooldownSeconds", 600)),
            dwell_s=float(c.get("dwellSeconds", slow)),
            flap_window_s=float(c.get("flapWindowSeconds", 1800)),
            retune_factor=float(c.get("retuneFactor", 0.5)),
            bounds=knob_bounds(spec),
            advisory=bool(c.get("advisory", False)),
            stale_s=float(c.get("staleSeconds", 60)),
            disaggregate=bool(c.get("disaggregate", True)),
        )


def spec_knobs(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The live knobs a pool's colocated engines start with, by admin API name: its
    ``spec.engine``'s, the engine's defaults (:mod:`cadenza.node.core.knobs`) when unset (None for
    an unset step-time target)."""
    engine = spec.get("engine") or {}
    return {name: engine.get(crd, BY_CRD[crd].default) for crd, name in KNOBS.items()}
