"""A pool's SLO status from its control loop's last tick: ``status.latency``, the ``SLOMet``
condition and ``status.controller``.

The figures are the signals the tick read (:attr:`~cadenza.control.loop.ControlLoop.signals`),
never a second reading: what the status shows is what the controller decided from. Pure
formatting; the operator writes these fields (``auto`` pools and fixed-mode pools with SLOs
alike) and ``cadenza up`` writes ``status.controller`` to its state file.
"""

from __future__ import annotations

from typing import Any

from cadenza.control.loop import ControlLoop
from cadenza.control.signals import Signals
from cadenza.control.spec import ControllerSpec
from cadenza.node.core.policy import CLASSES


def slo_status(loop: ControlLoop) -> dict[str, Any]:
    """``{"latency", "controller", "sloMet"}`` after a tick of ``loop``: :func:`latency_status`,
    :meth:`~cadenza.control.loop.ControlLoop.status` and :func:`slo_condition`.

    Raises:
        ValueError: the loop has not ticked yet (no signals to report).
    """
    if loop.signals is None:
        raise ValueError("the loop has not ticked yet")
    return {"latency": latency_status(loop.signals, loop.spec), "controller": loop.status(),
            "sloMet": slo_condition(loop.signals, loop.spec)}


def latency_status(signals: Signals, spec: ControllerSpec) -> dict[str, Any]:
    """``status.latency``: interactive's slow-window figures on top (the printer columns; with the
    engines' queue depth, KV usage, preemptions and predicted step time when scraped), every class
    with an SLO or traffic under ``classes``."""
    out: dict[str, Any] = {}
    inter = signals.slow.get("interactive")
    if inter is not None and inter.known:
        doc = inter.to_status()
        out.update({k: v for k, v in doc.items() if k not in ("known", "windowSeconds", "reason")})
    out["windowSeconds"] = int(spec.slow_window_s)
    classes = {cls: w.to_status() for cls, w in signals.slow.items() if cls in spec.slo or (w.known and w.requests)}
    if classes:
        out["classes"] = classes
    return out


def slo_condition(signals: Signals, spec: ControllerSpec) -> tuple[str, str, str]:
    """``SLOMet``: True when every class with an SLO and traffic is within it over the slow window,
    False naming the first that is not (and its figure), Unknown naming why."""
    if not spec.slo:
        return "Unknown", "NoSLO", "spec.slo sets no target"
    missed = []
    unknown = []
    for cls in CLASSES:
        if cls not in spec.slo:
            continue
        window = signals.slow.get(cls)
        if window is None or not window.known:
            unknown.append(f"{cls}: {window.reason if window else 'no signal'}")
        elif over := window.over(spec.slo[cls]):
            missed.append(f"{cls} {over[0]}")
    if missed:
        return "False", "SLOMissed", "; ".join(missed)
    if unknown:
        return "Unknown", "SignalsUnknown", "; ".join(unknown)
    return "True", "SLOMet", f"every class within its SLO over {spec.slow_window_s:.0f} s"
