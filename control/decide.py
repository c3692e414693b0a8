"""The SLO controller's decision: one pure function, ``decide()``, on an injected clock.

The operator, ``cadenza up`` and the simulator call the same :func:`decide` with the pool's
:class:`~cadenza.control.signals.Signals`, its current :class:`Shape` and live knobs, the
:class:`~cadenza.control.history.History` kept in the pool's status, the
:class:`~cadenza.control.spec.ControllerSpec` and ``now``; it returns a
:class:`Decision` (what to do, why, and the history to store). No I/O, no clock.

The ladder, cheapest first:

1. **Retune** the colocated engines live, within ``spec.controller.bounds``: when interactive
   breaches, shrink prefill per step (``chunkSize``, and ``tokenBudget`` / ``stepTimeTargetMs``
   when bounded) by ``retuneFactor``; when interactive is well inside its SLO (below
   ``(1 - hysteresis)`` x target) and batch or background TTFT breaches, grow them back.
   When the breach is KV-bound (an engine's KV at least :data:`KV_FULL` full while interactive
   queues or is preempted, from the engines' signals), smaller chunks free no memory: rung 1
   counts as exhausted.
2. **Dedicate** and 3. **disaggregate**: when interactive breaches and rung 1 has been exhausted
   for a slow window, move ONE colocated replica, in place: to ``interactive`` when the
   interference is from load (rung 2), to ``prefill`` when it is from long prompts (rung 3,
   ``spec.controller.disaggregate``); :mod:`.moves` attributes it from the pool's prefill share,
   long-prompt share and selective threshold, and the reason says which and why, with the
   figures. Unknown figures attribute nothing: rung 2, as the reason says. Still breaching with
   replicas already moved, the same choice is made again — except that a breach from load that
   no split may answer gives an idle prefill replica (its long prompts gone) back to colocated
   (:func:`~.moves.idle_prefill`). When every class has been clear
   (below ``(1 - hysteresis)`` x target in the slow window, and not over it in the fast one)
   for ``dwellSeconds``, one replica comes back to colocated (``aggregate`` or ``merge``, in
   :func:`~.moves.give_back`'s order: a prefill replica first once long prompts are gone; one
   whose long prompts are still there is kept).
   The replica count is not the controller's (``spec.replicas`` / an HPA own it).

Invariants:
- A breach needs both the fast and the slow window over target. An unknown window (too few
  samples, stale, NaN, missing) holds: nothing is decided from it.
- One action at a time: after any action, nothing more until a whole fast window has been
  observed after it. A breach within ``hysteresis`` of the target retunes at most once per slow
  window, so noise around the target yields at most one action per slow window.
- No class is left without a replica (:func:`~.moves.blocked`): a colocated replica stays while
  batch or background has (or may have) traffic, and interactive keeps one that decodes.
- After a reshape (any rung), no other for ``cooldownSeconds`` (the time is in the history, so
  a restarted operator honours it). A reversal is a change between a split (``dedicate``,
  ``disaggregate``) and a give-back (``merge``, ``aggregate``), whichever rungs: a reshape that
  would be the second reversal inside ``flapWindowSeconds`` is not made; reshaping freezes for
  that long (``Flapping``) and the controller continues in advisory.
- ``advisory: true`` computes and records every decision and acts on none.

Sources: SLO-driven chunk sizing after Niyama (QoS-aware dynamic chunking on one shared pool);
splitting prefill from decode after DistServe and Splitwise, at run time after Arrow, TokenScale
and HyGen (:mod:`.moves`); hysteresis, dwell, cooldown as in the Kubernetes HPA's stabilization
window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cadenza.control.history import AGGREGATE, DEDICATE, DISAGGREGATE, MAX_LOG, MERGE, SPLITS, History, rfc3339
from cadenza.control.moves import blocked, give_back, idle_prefill, split
from cadenza.control.signals import ClassWindow, Signals
from cadenza.control.spec import ControllerSpec
from cadenza.node.core.policy import CLASSES

KV_FULL = 0.95  # KV usage (0-1) at which an engine is memory-bound


@dataclass(frozen=True)
class Shape:
    """How many replicas serve in each role of an ``auto`` pool: ``colocated`` (every class),
    ``interactive`` (interactive only), ``prefill`` (prefills long prompts for the others)."""

    colocated: int
    interactive: int = 0
    prefill: int = 0

    def after(self, move: str) -> Shape:
        """The shape once ``move`` (one of :data:`~cadenza.control.history.MOVES`) is made: one
        replica from colocated to interactive (``dedicate``) or prefill (``disaggregate``), or back
        (``merge``, ``aggregate``). Raises KeyError for another name; counts are not checked."""
        to = {DEDICATE: "interactive", MERGE: "interactive", DISAGGREGATE: "prefill", AGGREGATE: "prefill"}[move]
        step = 1 if move in SPLITS else -1
        return replace(self, colocated=self.colocated - step, **{to: getattr(self, to) + step})


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` chose.

    Attributes:
        action: ``hold`` | ``retune`` | ``reshape``.
        reason: one sentence naming the class and the figures that decided.
        act: carry it out (False for ``hold``, in advisory, and while reshaping is frozen).
        knobs: for ``retune``, the engine knobs to apply (admin API names).
        move: for ``reshape``, one of :data:`~cadenza.control.history.MOVES`: ``dedicate``
            (colocated -> interactive) or ``merge`` (back); ``disaggregate`` (colocated ->
            prefill) or ``aggregate`` (back).
        slo_met: per class with a target, True / False / None (unknown), from the slow window.
        flapping: reshaping is frozen.
        history: to store for the next evaluation.
    """

    action: str
    reason: str
    act: bool
    history: History
    slo_met: Mapping[str, bool | None] = field(default_factory=dict)
    knobs: Mapping[str, float] | None = None
    move: str | None = None
    flapping: bool = False


def decide(signals: Signals, shape: Shape, knobs: Mapping[str, float | None], history: History,
           spec: ControllerSpec, now: float) -> Decision:
    """The next step of the ladder for one pool (see the module docstring for the rules).

    Args:
        signals: per class, the fast and slow windows.
        shape: replicas per role now.
        knobs: the colocated engines' live knobs now (``chunk_size``, ``token_budget``,
            ``step_time_target_ms``; None for one that is unset).
        history: what the last evaluation returned (or :meth:`~cadenza.control.history.History.from_status`).
        spec: the pool's SLOs and controller settings.
        now: seconds, same clock as ``history``.
    """
    h = spec.hysteresis
    slo_met = {cls: _met(signals.slow.get(cls), spec.slo[cls]) for cls in CLASSES if cls in spec.slo}
    history = _expire(history, spec, now)
    hold = _Holder(spec, history, slo_met, now)
    target = spec.slo.get("interactive")
    if not target:
        return hold("no interactive SLO to keep", bound_since=None, clear_since=None)
    fast, slow = signals.fast.get("interactive"), signals.slow.get("interactive")
    if not _known(fast) or not _known(slow):
        why = next((w.reason for w in (fast, slow) if w is not None and not w.known), "no signal")
        return hold(f"interactive latency unknown ({why}): holding", clear_since=None)
    if history.last_action is not None and now - history.last_action < spec.fast_window_s:
        return hold(f"observing the last action ({now - history.last_action:.0f} s of a "
                    f"{spec.fast_window_s:.0f} s fast window)")

    breach = fast.over(target) and slow.over(target)
    if breach:
        figures = "; ".join(slow.over(target)) + (f" ({load})" if (load := fast.load()) else "")
        # KV-bound: interactive queues or is preempted while the fullest engine's KV is full —
        # smaller chunks free no memory, so rung 1 counts as exhausted.
        kv_bound = _kv_bound(fast)
        shrunk = None if kv_bound else _retuned(knobs, spec, shrink=True)
        if shrunk:
            severe = bool(fast.over(target, 1 + h))
            if not severe and history.last_retune is not None and now - history.last_retune < spec.slow_window_s:
                return hold(f"interactive {figures}, within {h:.0%} of target: retuned "
                            f"{now - history.last_retune:.0f} s ago, waiting a slow window", clear_since=None)
            return _retune(hold, shrunk, f"interactive {figures}: shrinking prefill per step", clear_since=None,
                           bound_since=None)
        where = "KV full (retuning frees no memory)" if kv_bound else "prefill at its bounds"
        since = history.bound_since if history.bound_since is not None else now
        if now - since < spec.slow_window_s:
            return hold(f"interactive {figures} with {where} for {now - since:.0f} s: "
                        f"reshaping after {spec.slow_window_s:.0f} s", bound_since=since, clear_since=None)
        move, why = split(slow, kv_bound, spec.disaggregate)
        if (stop := blocked(shape, move, signals)) is not None:
            if move == DEDICATE and (idle := idle_prefill(shape, slow, h)) is not None:
                return _reshape(hold, AGGREGATE, f"interactive {figures}; {why}, but {stop}; {idle}",
                                bound_since=since, clear_since=None)
            return hold(f"interactive {figures}; {why}, but {stop}", bound_since=since, clear_since=None)
        return _reshape(hold, move, f"interactive {figures}; {where} for {now - since:.0f} s; {why}",
                        bound_since=since, clear_since=None)

    # Interactive is not breaching: maybe give back, maybe grow prefill again.
    windows = {cls: signals.slow.get(cls) for cls in spec.slo}
    if shape.interactive > 0 or shape.prefill > 0:
        # Clear in the slow window, and not already breaching again in the fast one.
        unclear = [cls for cls, w in windows.items() if not _known(w) or w.over(spec.slo[cls], 1 - h)
                   or (_known(f := signals.fast.get(cls)) and f.over(spec.slo[cls], 1 - h))]
        if unclear:
            return _grow_or_hold(hold, signals, knobs, spec, f"not giving back: {', '.join(unclear)} not clear "
                                 f"(under {1 - h:.0%} of target)", clear_since=None)
        since = history.clear_since if history.clear_since is not None else now
        if now - since < spec.dwell_s:
            return hold(f"every class clear for {now - since:.0f} s: giving back after {spec.dwell_s:.0f} s",
                        bound_since=None, clear_since=since)
        move, why = give_back(shape, slow, h)
        if move is None:
            return hold(f"every class clear for {now - since:.0f} s; {why}", bound_since=None, clear_since=since)
        return _reshape(hold, move, f"every class clear for {now - since:.0f} s; {why}", bound_since=None,
                        clear_since=since)
    return _grow_or_hold(hold, signals, knobs, spec, "interactive within its SLO", clear_since=None)


# -- the rungs -------------------------------------------------------------------------------


class _Holder:
    """Builds decisions that share the evaluation's spec, history, SLO view and time."""

    def __init__(self, spec: ControllerSpec, history: History, slo_met: dict, now: float) -> None:
        self.spec, self.history, self.slo_met, self.now = spec, history, slo_met, now

    def __call__(self, reason: str, **changes: Any) -> Decision:
        return Decision("hold", reason, False, replace(self.history, **changes), self.slo_met,
                        flapping=self._frozen())

    def _frozen(self) -> bool:
        return self.history.frozen_until is not None and self.now < self.history.frozen_until

    def log(self, history: History, entry: dict) -> History:
        entry = {"time": rfc3339(self.now), **entry}
        return replace(history, log=(*history.log, entry)[-MAX_LOG:])


def _retune(hold: _Holder, new_knobs: dict, reason: str, **changes: Any) -> Decision:
    act = not hold.spec.advisory
    history = replace(hold.history, **changes)
    if act:
        history = replace(history, last_action=hold.now, last_retune=hold.now)
    history = hold.log(history, {"action": "retune", "knobs": new_knobs, "reason": reason, "acted": act})
    return Decision("retune", reason, act, history, hold.slo_met, knobs=new_knobs, flapping=hold._frozen())


def _reshape(hold: _Holder, move: str, reason: str, **changes: Any) -> Decision:
    spec, now, history = hold.spec, hold.now, replace(hold.history, **changes)
    if history.last_reshape is not None and now - history.last_reshape < spec.cooldown_s:
        return hold(f"{reason} — in cooldown for {spec.cooldown_s - (now - history.last_reshape):.0f} s more",
                    **changes)
    frozen = hold._frozen()
    if not frozen and _reversals(history.reshapes, move) >= 2:
        history = replace(history, frozen_until=now + spec.flap_window_s)
        frozen = True
        reason = f"{reason} — would be the second reversal in {spec.flap_window_s / 60:.0f} min: reshaping frozen"
    act = not spec.advisory and not frozen
    if act:
        history = replace(history, last_action=now, last_reshape=now, reshapes=(*history.reshapes, (now, move)),
                          bound_since=None, clear_since=None)
    history = hold.log(history, {"action": "reshape", "move": move, "reason": reason, "acted": act})
    return Decision("reshape", reason, act, history, hold.slo_met, move=move, flapping=frozen)


def _grow_or_hold(hold: _Holder, signals: Signals, knobs: Mapping, spec: ControllerSpec, reason: str,
                  **changes: Any) -> Decision:
    """Rung 1 upward: interactive well inside its SLO (both windows) while batch/background TTFT breaches."""
    h, target = spec.hysteresis, spec.slo["interactive"]
    fast, slow = signals.fast["interactive"], signals.slow["interactive"]
    roomy = not fast.over(target, 1 - h) and not slow.over(target, 1 - h)
    suffering = []
    for cls in ("batch", "background"):
        slo = {k: v for k, v in (spec.slo.get(cls) or {}).items() if k == "ttftP99Ms"}
        f, s = signals.fast.get(cls), signals.slow.get(cls)
        if slo and _known(f) and _known(s) and f.over(slo) and s.over(slo):
            suffering.append(f"{cls} {'; '.join(s.over(slo))}")
    grown = _retuned(knobs, spec, shrink=False) if roomy and suffering else None
    if grown:
        return _retune(hold, grown, f"interactive under {1 - h:.0%} of target and {', '.join(suffering)}: "
                       "growing prefill per step", bound_since=None, **changes)
    return hold(reason, bound_since=None, **changes)


def _retuned(knobs: Mapping[str, float | None], spec: ControllerSpec, shrink: bool) -> dict | None:
    """The knobs one rung-1 step away (smaller or larger, within bounds), or None at the bound."""
    out: dict = {}
    for name, (low, high) in spec.bounds.items():
        value = knobs.get(name)
        if value is None:
            value = high  # an unset knob (no step-time target) starts from its loosest bound
            if shrink:
                out[name] = _as_knob(name, max(low, value * spec.retune_factor))
            continue
        new = max(low, value * spec.retune_factor) if shrink else min(high, value / spec.retune_factor)
        new = _as_knob(name, new)
        if new != value:
            out[name] = new
    if "token_budget" in out or "chunk_size" in out:  # a chunk never exceeds the budget
        budget = out.get("token_budget", knobs.get("token_budget"))
        chunk = out.get("chunk_size", knobs.get("chunk_size"))
        if budget is not None and chunk is not None and chunk > budget:
            out["chunk_size"] = budget
    return {k: v for k, v in out.items() if v != knobs.get(k)} or None


def _as_knob(name: str, value: float) -> float:
    return float(round(value, 1)) if name == "step_time_target_ms" else int(math.floor(value))


# -- helpers ---------------------------------------------------------------------------------


def _kv_bound(window: ClassWindow) -> bool:
    """The fullest engine's KV at or over :data:`KV_FULL` while the class queued or was preempted."""
    return (window.kv_usage is not None and window.kv_usage >= KV_FULL
            and bool(window.queue_depth or window.preemptions))


def _known(window: ClassWindow | None) -> bool:
    return window is not None and window.known


def _met(window: ClassWindow | None, slo: Mapping[str, float]) -> bool | None:
    if not _known(window) or not window.requests:
        return None
    return not window.over(slo)


def _reversals(reshapes: tuple[tuple[float, str], ...], move: str) -> int:
    """Changes of direction in ``reshapes`` followed by ``move``: from a split (``dedicate``,
    ``disaggregate``) to a give-back (``merge``, ``aggregate``) or back, whichever rungs."""
    splits = [m in SPLITS for _, m in reshapes] + [move in SPLITS]
    return sum(1 for a, b in zip(splits, splits[1:]) if a != b)


def _expire(history: History, spec: ControllerSpec, now: float) -> History:
    """Forget reshapes older than the flap window and a freeze that has run out; bring times from
    the future (a skewed clock, a hand-edited status) back to ``now``, so no wait outlasts its
    window."""
    def past(t: float | None) -> float | None:
        return None if t is None else min(t, now)

    reshapes = tuple((min(t, now), m) for t, m in history.reshapes if now - t < spec.flap_window_s)
    frozen = history.frozen_until if history.frozen_until is not None and now < history.frozen_until else None
    if frozen is not None:
        frozen = min(frozen, now + spec.flap_window_s)
    return replace(history, reshapes=reshapes, frozen_until=frozen, last_action=past(history.last_action),
                   last_retune=past(history.last_retune), last_reshape=past(history.last_reshape),
                   bound_since=past(history.bound_since), clear_since=past(history.clear_since))
