"""Signals from scraping a pool's gateways and engines (the default source): snapshots kept
over the slow window, and each window the difference of two of them.

:class:`ScrapeSource` records one :class:`~.exposition.Snapshot` per tick (every gateway's and
engine's ``/metrics``, by pod or process name) into a :class:`SnapshotHistory`; a window of
``window`` seconds is the newest snapshot minus the newest one at least that old (within 10 %).
Per window, from the engines: the peak queue depth of each class (summed over engines, at each
scrape), the peak KV usage of the fullest engine, the class's preemptions and the p99 of the
step time the engines' cost models predicted. They explain a breach (queueing, KV pressure,
long steps) and tell the controller when retuning cannot help; a missing engine series leaves
its figure None, never zero. Pool-wide, for attributing a breach to long prompts
(:func:`~.signals.prefill_figures`): the share of computed tokens that were prefill, and of the
prompt tokens of requests finished in the window, the share in prompts at least the selective
threshold long — the threshold is the newest scrape's, the gateways' where one applies it, else
the largest an engine reports.

Invariants:
- A window not yet covered by snapshots, whose newest snapshot is stale, whose series is
  missing or NaN, or with too few requests is unknown (:class:`~.signals.ClassWindow`).
- Deltas are taken per source (each gateway's and engine's own text, by pod or process name),
  then summed: a source that missed a scrape, or appeared inside the window, counts only from its
  first scrape in the window; one missing from the newest scrape is left out of the window. So a
  scrape that failed for one pod never lets a lifetime of counts into a window.
- A counter that went down (that source restarted) restarts its part of the window at the reset:
  the delta is the newer snapshot alone, never negative.

Pure but for the injected ``scrape``: snapshots carry their own timestamps; no clock is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from cadenza.control.exposition import Snapshot, parse_pool_metrics
from cadenza.control.histograms import Histogram
from cadenza.control.signals import ClassWindow, prefill_figures, window_of

KEEP_MARGIN_S = 120.0  # snapshots kept beyond the slow window: a scrape interval or two, and slack


class SnapshotHistory:
    """Snapshots of one pool, oldest first, kept for as long as the slow window needs.

    Args:
        keep_s: how far back to keep snapshots (the slow window plus a scrape interval or two).
    """

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self.snapshots: list[Snapshot] = []

    def add(self, snapshot: Snapshot) -> None:
        """Append a newer snapshot and forget those no window can need any more."""
        if self.snapshots and snapshot.time <= self.snapshots[-1].time:
            raise ValueError("snapshots must be added in time order")
        self.snapshots.append(snapshot)
        # Keep the newest snapshot at or before the cut: it is the start of the longest window.
        cut = snapshot.time - self.keep_s
        while len(self.snapshots) > 2 and self.snapshots[1].time <= cut:
            self.snapshots.pop(0)

    def window(self, cls: str, window_s: float, now: float, slo: Mapping[str, float], *, min_samples: int,
               stale_s: float) -> ClassWindow:
        """``cls`` over the last ``window_s`` seconds before the newest snapshot.

        Unknown when: no snapshot, the newest older than ``stale_s`` at ``now``, no snapshot old
        enough to start the window (within 10 % of it), the class's series missing, a NaN, or fewer
        than ``min_samples`` requests.
        """
        if not self.snapshots:
            return ClassWindow(False, "no scrape yet")
        newest = self.snapshots[-1]
        if now - newest.time > stale_s:
            return ClassWindow(False, f"last scrape {now - newest.time:.0f} s old")
        start = None
        for snap in reversed(self.snapshots[:-1]):
            if newest.time - snap.time >= 0.9 * window_s:
                start = snap
                break
        if start is None:
            return ClassWindow(False, f"scrapes do not cover {window_s:.0f} s yet")
        span = newest.time - start.time
        window = [snap for snap in self.snapshots if snap.time >= start.time]
        base = _baselines(window)
        try:
            ttft, itl, nan = _latency_delta(cls, window, base)
        except ValueError:
            return ClassWindow(False, "gateways disagree on bucket bounds", window_s=span)
        if nan:
            return ClassWindow(False, "a NaN or negative count in the latency series", window_s=span)
        if ttft is None:
            return ClassWindow(False, f"no {cls} latency series", window_s=span)
        return replace(window_of(ttft, itl, slo, min_samples, span), **_engine_window(cls, window, base))


def _baselines(window: list[Snapshot]) -> dict[str, Snapshot]:
    """Per source of the newest snapshot, its first snapshot in the window before the newest
    (a source not seen before the newest has none, and is left out)."""
    newest = window[-1].sources()
    base: dict[str, Snapshot] = {}
    for snap in window[:-1]:
        for name, part in snap.sources().items():
            if name in newest and name not in base:
                base[name] = part
    return base


def _latency_delta(cls: str, window: list[Snapshot], base: Mapping[str, Snapshot],
                   ) -> tuple[Histogram | None, Histogram | None, bool]:
    """``cls``'s TTFT and ITL observed in the window, summed over sources; and whether a NaN was seen.

    Raises:
        ValueError: two sources with different bucket bounds.
    """
    ttft = itl = None
    for name, first in base.items():
        part = window[-1].sources()[name]
        t_now, i_now = part.ttft.get(cls), part.itl.get(cls)
        if t_now is None:
            continue
        t_base, i_base = first.ttft.get(cls), first.itl.get(cls)
        if any(h is not None and not h.finite for h in (t_now, i_now, t_base, i_base)):
            return None, None, True
        t = t_now.since(t_base)
        ttft = t if ttft is None else ttft + t
        if i_now is not None:
            i = i_now.since(i_base)
            itl = i if itl is None else itl + i
    return ttft, itl, False  # ttft None: no source seen twice in the window has the series


def _engine_window(cls: str, window: list[Snapshot], base: Mapping[str, Snapshot]) -> dict:
    """The engine figures of ``cls`` over the window's snapshots (oldest first): peaks of the
    summed gauges, per-engine deltas of the counters."""
    engines = [snap.engine for snap in window if snap.engine is not None]
    if not engines:
        return {}
    out: dict = {"queue_depth": int(max(e.waiting.get(cls, 0.0) for e in engines))}
    usages = [e.kv_usage for e in engines if e.kv_usage is not None]
    if usages:
        out["kv_usage"] = max(usages)
    preempted, steps = None, None
    for name, snap in base.items():
        last, first = window[-1].sources()[name].engine, snap.engine
        if last is None or first is None:
            continue
        if cls in last.preempted:
            preempted = (preempted or 0.0) + _delta(first.preempted.get(cls, 0.0), last.preempted[cls])
        if last.predicted_step is not None:
            delta = last.predicted_step.since(first.predicted_step)
            if steps is None:
                steps = delta
            elif steps.bounds == delta.bounds:
                steps = steps + delta
    if preempted is not None:
        out["preemptions"] = int(preempted)
    p99 = steps.quantile(0.99) if steps is not None else None
    if p99 is not None:
        out["predicted_step_p99_ms"] = p99 * 1e3
    return out | _prefill_window(window, base)


def _prefill_window(window: list[Snapshot], base: Mapping[str, Snapshot]) -> dict:
    """The pool's prefill-interference figures over the window: per-engine deltas of the token
    counts, summed (a source that restarted counts from its reset), and the newest threshold."""
    kinds: dict[str, float] | None = None
    prompts: Histogram | None = None
    prompt_tokens = moved = None
    for name, snap in base.items():
        last, first = window[-1].sources()[name].engine, snap.engine
        if last is None or first is None:
            continue
        if last.step_tokens is not None:
            kinds = kinds or {}
            for kind, after in last.step_tokens.items():
                kinds[kind] = kinds.get(kind, 0.0) + _delta((first.step_tokens or {}).get(kind, 0.0), after)
        if last.prompts is not None and last.prompt_tokens is not None:
            delta = last.prompts.since(first.prompts)
            reset = delta is last.prompts and first.prompts is not None  # restarted: count from the reset
            if prompts is None or prompts.bounds == delta.bounds:
                prompts = delta if prompts is None else prompts + delta
                before = 0.0 if reset or first.prompt_tokens is None else first.prompt_tokens
                prompt_tokens = (prompt_tokens or 0.0) + _delta(before, last.prompt_tokens)
        if last.moved_tokens is not None:
            moved = (moved or 0.0) + _delta(first.moved_tokens or 0.0, last.moved_tokens)
    newest = window[-1]
    threshold = newest.min_prompt_tokens
    if threshold is None and newest.engine is not None:
        threshold = newest.engine.min_prompt_tokens
    prefill, decode = (None, None) if kinds is None else (kinds.get("prefill", 0.0), kinds.get("decode", 0.0))
    return prefill_figures(prefill, decode, prompts, prompt_tokens, moved, threshold)


def _delta(before: float, after: float) -> float:
    """What a counter counted between two scrapes (after a reset, what it counted since)."""
    return after - before if after >= before else after


class ScrapeSource:
    """Signals from scraping the pool's gateways and engines (the default: no extra dependency).

    Args:
        scrape: returns, per pod or process name, the ``/metrics`` text of every reachable
            gateway and engine, or None.
        keep_s: how long snapshots are kept (the slow window and a margin).
    """

    def __init__(self, scrape: Callable[[], Mapping[str, str] | None], keep_s: float) -> None:
        self.scrape, self.history = scrape, SnapshotHistory(keep_s)

    def record(self, now: float) -> None:
        texts = self.scrape()
        if texts is not None:
            try:
                self.history.add(parse_pool_metrics(texts, now))
            except ValueError:
                pass  # unparseable or out of order: the windows go stale, which holds

    def window(self, cls: str, window_s: float, now: float, slo: Mapping[str, float], *, min_samples: int,
               stale_s: float) -> ClassWindow:
        return self.history.window(cls, window_s, now, slo, min_samples=min_samples, stale_s=stale_s)

