"""What the operator reads of a pool's SLOs each resync: its gateways' latency histograms, turned
into ``status.latency``, the ``SLOMet`` condition and the controller's decision.

For a pool that is not ``mode: auto`` (a fixed shape) the decision is advice only: it is recorded
as advisory, whatever ``spec.controller.advisory`` says, and ``status.controller`` says so. An
``auto`` pool is run by :mod:`.actuator` instead; :func:`latency_status` and :func:`slo_condition`
serve both. The history it keeps (``status.controller``) is read back each time,
so a restarted operator continues where the last one stopped; the snapshots of the windows live
in memory and are rebuilt within a slow window after a restart (until then the figures are
unknown, which holds).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import cadenza.node.metric_names as names
from cadenza.control.actuator import spec_knobs
from cadenza.control.decide import Shape, decide
from cadenza.control.history import History
from cadenza.control.spec import ControllerSpec
from cadenza.control.exposition import gauge_values
from cadenza.control.prometheus import signal_source
from cadenza.control.scrape import ScrapeSource
from cadenza.control.signals import Signals, read_signals
from cadenza.node.core.policy import CLASSES

ACTUATION = "advisory only: the pool's mode is fixed (mode auto lets the controller act)"


class PoolObserver:
    """The windows of every pool this operator watches, by pool uid."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._sources: dict[str, tuple[Any, Any]] = {}

    def observe(self, uid: str, spec: Mapping[str, Any], scrape: Callable[[], Mapping[str, str] | None],
                status: Mapping[str, Any]) -> dict[str, Any]:
        """Record one reading (``scrape`` returns the gateways' and engines' ``/metrics`` by pod
        name, None when no gateway answered) and return the status fields: ``latency``,
        ``controller`` and the ``SLOMet`` condition as ``(status, reason, message)`` under the
        key ``sloMet``."""
        now = self.clock()
        cspec = replace(ControllerSpec.from_pool_spec(spec), advisory=True)
        key = repr((spec.get("controller") or {}).get("prometheus"))
        if uid not in self._sources or self._sources[uid][0] != key:
            self._sources[uid] = (key, signal_source(spec, scrape, keep_s=cspec.slow_window_s + 120))
        source = self._sources[uid][1]
        if isinstance(source, ScrapeSource):
            source.scrape = scrape  # the pool's gateways as this resync sees them
        source.record(now)
        signals = read_signals(source, now, cspec.slo, cspec.fast_window_s, cspec.slow_window_s,
                               min_samples=cspec.min_samples, stale_s=cspec.stale_s)
        memory = dict(status.get("controller") or {})
        decision = decide(signals, Shape(int(spec.get("replicas", 1))), spec_knobs(spec), History.from_status(memory),
                          cspec, now)
        return {
            "latency": latency_status(signals, cspec),
            "controller": {**decision.history.to_status(), "actuation": ACTUATION,
                           "lastDecision": {"action": decision.action, "reason": decision.reason, "acted": False}},
            "sloMet": slo_condition(signals, cspec),
        }

    def forget(self, uid: str) -> None:
        self._sources.pop(uid, None)


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


THRESHOLD_METRIC = names.GATEWAY_DISAGG_MIN_PROMPT_TOKENS.prometheus


def disaggregation_status(pinned: int | None, scraped: Mapping[str, str] | None) -> dict[str, Any]:
    """``status.disaggregated`` of a disaggregated pool: the shortest prompt its gateways send
    through a prefill replica, and where that figure comes from.

    Args:
        pinned: ``spec.disaggregated.minPromptTokens``, or None (the engines compute it).
        scraped: ``/metrics`` text by pod (:func:`~cadenza.operator.k8s_roles.scrape_pool`), or
            None; the gateways' ``cadenza.gateway.disagg.min_prompt_tokens`` gauge is read.

    Returns:
        ``{"minPromptTokens", "source": "pinned" | "computed", "message"}``, or ``source:
        unknown`` (no ``minPromptTokens``) while no gateway reports a computed threshold — the
        decode replicas' cost models calibrate on their first steps and their link on the first
        1 MiB pulled; until then nothing is moved.
    """
    if pinned is not None:
        return {"minPromptTokens": pinned, "source": "pinned", "message": "spec.disaggregated.minPromptTokens"}
    values = gauge_values((scraped or {}).values(), THRESHOLD_METRIC)
    if not values:
        return {"source": "unknown", "message": "no gateway reports a computed threshold yet (the decode replicas "
                                                "calibrate their step-time model and measure the link first); "
                                                "until then every prompt is prefilled where it decodes"}
    return {"minPromptTokens": int(max(values)), "source": "computed",
            "message": "from the decode replicas' step-time models and measured KV transfer bandwidth"}
