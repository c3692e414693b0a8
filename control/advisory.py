"""Advice only: the SLO controller over a fixed-mode pool with SLOs (``colocated``, ``dedicated``,
``disaggregated``), which reads and decides but acts on nothing.

The pool's shape is fixed (``spec.replicas`` colocated, as far as the decision is concerned) and so
are its knobs (``spec.engine``'s). Every decision is made as ``advisory`` — whatever
``spec.controller.advisory`` says — and recorded as such in ``status.controller``, with
``actuation`` saying why nothing is acted on. A fixed pool's memory is its status: the history is
read back from ``status.controller`` at every evaluation (:func:`advisory_loop`), so a restarted
operator, or one that ran the pool in ``auto`` before, continues from what the status holds. The
windows' snapshots live in memory and are rebuilt within a slow window after a restart (until
then the figures are unknown, which holds).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from cadenza.control.decide import Shape
from cadenza.control.history import History
from cadenza.control.loop import ControlLoop, Evaluation
from cadenza.control.prometheus import signal_source
from cadenza.control.scrape import KEEP_MARGIN_S, ScrapeSource
from cadenza.control.spec import ControllerSpec, spec_knobs

ACTUATION = "advisory only: the pool's mode is fixed (mode auto lets the controller act)"


class Advisory:
    """The :class:`~cadenza.control.loop.Actuation` of a fixed-mode pool: nothing is acted on.

    Args:
        spec: the ServingPool's spec (its replicas and engine knobs are the shape and knobs decided from).
    """

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.spec = spec

    @property
    def prometheus(self) -> Any:
        """``spec.controller.prometheus``: the source the windows come from (None: a scrape)."""
        return (self.spec.get("controller") or {}).get("prometheus")

    def prepare(self, now: float) -> tuple[Shape, dict[str, Any]]:
        return Shape(int(self.spec.get("replicas", 1))), spec_knobs(self.spec)

    def act(self, evaluation: Evaluation) -> None:
        """Nothing: the decision is advice (its ``act`` is never set), kept in the loop's history."""

    def status(self) -> dict[str, Any]:
        return {"actuation": ACTUATION}


def advisory_loop(loop: ControlLoop | None, spec: Mapping[str, Any], scrape: Callable[[], Mapping[str, str] | None],
                  stored: Mapping[str, Any] | None, clock: Callable[[], float] = time.time) -> ControlLoop:
    """The advisory loop of a fixed-mode pool, ready for this evaluation's tick.

    Args:
        loop: the pool's loop from the last evaluation (None: the first, or after a restart).
        spec: the ServingPool's spec as it is now; its settings are taken with ``advisory`` set.
        scrape: the pool's gateways' and engines' ``/metrics`` by pod name (None when no gateway
            answered), as this evaluation sees them.
        stored: ``status.controller`` as the pool's status holds it now: the history decided from.

    Returns:
        ``loop`` with the spec and history of now, or a new loop when there was none or
        ``spec.controller.prometheus`` changed (its windows start over).

    Raises:
        ValueError: controller bounds that are empty or inverted (:meth:`ControllerSpec.from_pool_spec`).
    """
    settings = replace(ControllerSpec.from_pool_spec(spec), advisory=True)
    actuation = Advisory(spec)
    if loop is None or loop.actuation.prometheus != actuation.prometheus:
        loop = ControlLoop(signal_source(spec, scrape, keep_s=settings.slow_window_s + KEEP_MARGIN_S), settings,
                           actuation, clock=clock)
    else:
        loop.update(settings)
        loop.actuation = actuation
        if isinstance(loop.source, ScrapeSource):
            loop.source.scrape = scrape  # the pool's gateways as this evaluation sees them
    loop.history = History.from_status(stored)
    return loop
