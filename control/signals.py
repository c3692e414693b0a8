"""SLO signals of a pool: per-class latency over a time window, from cumulative histograms, and
the engines' load over the same window.

Gateways record every request's client-side TTFT and every inter-token gap (ITL) in cumulative
histograms per traffic class (:mod:`cadenza.gateway.metrics`). A *window* is the difference of
two snapshots of those histograms taken ``window`` seconds apart; from it this module estimates
the p99 (linear interpolation inside the bucket that holds it, as Prometheus' ``histogram_quantile``
does) and the SLO attainment (the share of observations at or under the target, interpolated the
same way). The estimate is only as fine as the buckets: the gateway's boundaries are dense around
each SLO target, so a p99 near the target is within a few per cent of the truth.

The engines' ``/metrics`` (:mod:`cadenza.node.frontend.telemetry`) add, per window: the peak queue depth
of each class (``cadenza.requests``, state ``waiting``, summed over engines, at each scrape), the
peak KV usage of the fullest engine (``cadenza.kv.blocks``: used and reserved over all blocks),
the class's preemptions (``cadenza.requests.preempted``) and the p99 of the step time the
engines' cost models predicted (``cadenza.step.predicted_duration``). They explain a breach
(queueing, KV pressure, long steps) and tell the controller when retuning cannot help; a
missing engine series leaves its figure None, never zero.

Invariants:
- A window whose data is missing, stale, NaN, not yet covered by snapshots, or holds fewer than
  ``min_samples`` requests (but more than none: a covered window with no request is a known zero,
  the class has no traffic) is **unknown** (``ClassWindow.known`` False, with the reason). Unknown
  means "hold" to the controller, never "no load".
- Deltas are taken per source (each gateway's and engine's own text, by pod or process name),
  then summed: a source that missed a scrape, or appeared inside the window, counts only from its
  first scrape in the window; one missing from the newest scrape is left out of the window. So a
  scrape that failed for one pod never lets a lifetime of counts into a window.
- A counter that went down (that source restarted) restarts its part of the window at the reset:
  the delta is the newer snapshot alone, never negative.

Pure: snapshots carry their own timestamps; nothing here reads a clock or the network.
"""

from __future__ import annotations

import json
import math
import urllib.parse
from http.client import HTTPException
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from prometheus_client.parser import text_string_to_metric_families

from cadenza.node.core.policy import CLASSES  # one home for the traffic classes
import cadenza.node.metric_names as names  # the emitters' names, as Prometheus spells them

TTFT_METRIC = names.GATEWAY_TTFT.prometheus
ITL_METRIC = names.GATEWAY_ITL.prometheus
CLASS_LABEL = names.label(names.TRAFFIC_CLASS)
ENGINE_REQUESTS = names.REQUESTS.prometheus
ENGINE_KV_BLOCKS = names.KV_BLOCKS.prometheus
ENGINE_PREEMPTED = names.REQUESTS_PREEMPTED.prometheus
ENGINE_PREDICTED_STEP = names.STEP_PREDICTED_DURATION.prometheus
ENGINE_CLASS_LABEL = names.label(names.REQUEST_CLASS)


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts of one histogram.

    Attributes:
        bounds: finite upper bounds, ascending (the ``+Inf`` bucket is implied).
        counts: cumulative counts, one per bound, then the total (``len(bounds) + 1`` values).
    """

    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.bounds) + 1:
            raise ValueError(f"{len(self.bounds)} bounds need {len(self.bounds) + 1} counts, got {len(self.counts)}")

    @property
    def total(self) -> float:
        return self.counts[-1]

    @property
    def finite(self) -> bool:
        """Every count a finite, non-negative number (else the series is unusable: unknown)."""
        return all(math.isfinite(c) and c >= 0 for c in self.counts)

    @classmethod
    def from_buckets(cls, per: Mapping[float, float]) -> Histogram:
        """From ``{le: cumulative count}`` as exposed or queried. A missing ``+Inf`` bucket takes the
        last finite one's count; counts that go down from one bound to the next (scrape races,
        ``increase()`` extrapolation) are raised to the running maximum, as Prometheus'
        ``histogram_quantile`` does. NaN and negative counts are kept, for :attr:`finite` to refuse."""
        finite = sorted(b for b in per if math.isfinite(b))
        counts = [per[b] for b in finite] + [per.get(math.inf, per[finite[-1]] if finite else 0.0)]
        if all(math.isfinite(c) and c >= 0 for c in counts):
            for i in range(1, len(counts)):
                counts[i] = max(counts[i], counts[i - 1])
        return cls(tuple(finite), tuple(counts))

    def __add__(self, other: Histogram) -> Histogram:
        """Sum of two histograms with the same bounds (two gateway pods).

        Raises:
            ValueError: different bounds.
        """
        if other.bounds != self.bounds:
            raise ValueError("cannot add histograms with different bucket bounds")
        return Histogram(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts)))

    def since(self, older: Histogram | None) -> Histogram:
        """What was observed after ``older`` (itself when ``older`` is None, has other bounds, or
        is larger anywhere, i.e. the counters were reset in between)."""
        if older is None or older.bounds != self.bounds or any(o > n for o, n in zip(older.counts, self.counts)):
            return self
        return Histogram(self.bounds, tuple(n - o for n, o in zip(self.counts, older.counts)))

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0 < q < 1), interpolated linearly inside its bucket; None when empty.

        A quantile in the ``+Inf`` bucket is reported as the largest finite bound (a lower bound
        of the truth, as Prometheus does).
        """
        total = self.total
        if total <= 0:
            return None
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts):
            if count >= rank:
                width = count - lower_count
                return lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width else 1.0)
            lower_bound, lower_count = bound, count
        return self.bounds[-1] if self.bounds else None

    def share_at_most(self, x: float) -> float | None:
        """Share of observations ``<= x``, interpolated inside the bucket holding ``x``; None when empty."""
        total = self.total
        if total <= 0:
            return None
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts):
            if x <= bound:
                frac = (x - lower_bound) / (bound - lower_bound) if bound > lower_bound else 1.0
                return (lower_count + frac * (count - lower_count)) / total
            lower_bound, lower_count = bound, count
        return lower_count / total  # x is past the last finite bound: the +Inf bucket counts as over


@dataclass(frozen=True)
class EngineSnapshot:
    """The engines' load at one scrape, over every engine that answered.

    Attributes:
        engines: how many engines' texts it sums.
        waiting: per class, requests queued (summed).
        preempted: per class, requests preempted since each engine started (summed, cumulative).
        kv_usage: the fullest engine's (used + reserved) / all KV blocks, 0-1; None without KV series.
        predicted_step: the cost models' predicted step times (seconds, summed); None without it.
    """

    engines: int
    waiting: Mapping[str, float] = field(default_factory=dict)
    preempted: Mapping[str, float] = field(default_factory=dict)
    kv_usage: float | None = None
    predicted_step: Histogram | None = None


@dataclass(frozen=True)
class Snapshot:
    """The pool's cumulative latency histograms at one time, summed over its gateways, and its
    engines' load (None when no engine text was scraped).

    Attributes:
        time: seconds (the injected clock's) when it was scraped.
        ttft: per class, client-side time to first token (seconds).
        itl: per class, gaps between consecutive streamed tokens (seconds).
        engine: the engines' queues, KV, preemptions and predicted step time.
        parts: the same, per source (pod or process name), which windows take their deltas from;
            empty when the snapshot is a single source (itself).
    """

    time: float
    ttft: Mapping[str, Histogram] = field(default_factory=dict)
    itl: Mapping[str, Histogram] = field(default_factory=dict)
    engine: EngineSnapshot | None = None
    parts: Mapping[str, Snapshot] = field(default_factory=dict)

    def sources(self) -> Mapping[str, Snapshot]:
        """Per source name, its own snapshot (``{"": self}`` for a single-source snapshot)."""
        return self.parts or {"": self}


def parse_pool_metrics(texts: Mapping[str, str] | Iterable[str], time: float) -> Snapshot:
    """One snapshot from the Prometheus text of every gateway and engine pod of a pool.

    Gateway histograms are summed per class; a text with KV block series is an engine's, and
    adds to the engine snapshot (queues and preemptions summed, KV usage the highest). Each text
    is also kept as its own part, by name, for per-source deltas. A text that does not parse is
    left out, as if that source had not answered.

    Args:
        texts: per source (pod or process name), the body of its ``GET /metrics`` (gateways and
            engines, any order); a plain list names them by position.
        time: when they were scraped.

    Raises:
        ValueError: no text (of at least one) is in the Prometheus exposition format.
    """
    named = texts if isinstance(texts, Mapping) else {str(i): t for i, t in enumerate(texts)}
    parts = {}
    errors = []
    for name, text in named.items():
        try:
            families = list(text_string_to_metric_families(text))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            errors.append(f"{name or 'a source'}: {exc}")
            continue  # that source is missing from this scrape, as if it had not answered
        hists = _histograms(families, CLASS_LABEL)
        parts[name] = Snapshot(time, hists.get(TTFT_METRIC, {}), hists.get(ITL_METRIC, {}), _engine(families))
    sums: dict[str, dict[str, Histogram]] = {"ttft": {}, "itl": {}}
    for part in parts.values():
        for key in sums:
            for cls, hist in getattr(part, key).items():
                have = sums[key].get(cls)
                sums[key][cls] = hist if have is None else have + hist
    if errors and not parts:
        raise ValueError("no text is in the Prometheus exposition format: " + "; ".join(errors))
    engines = [part.engine for part in parts.values() if part.engine is not None]
    return Snapshot(time, sums["ttft"], sums["itl"], _sum_engines(engines), parts)


def _engine(families) -> EngineSnapshot | None:
    """One engine's load, or None when the text is not an engine's (no KV block series)."""
    waiting: dict[str, float] = {}
    preempted: dict[str, float] = {}
    kv: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            labels = sample.labels
            if not (math.isfinite(sample.value) and sample.value >= 0):
                continue  # a NaN or negative gauge or counter says nothing
            if family.name == ENGINE_REQUESTS and labels.get("cadenza_request_state") == "waiting":
                cls = labels.get(ENGINE_CLASS_LABEL, "")
                waiting[cls] = waiting.get(cls, 0.0) + sample.value
            elif family.name == ENGINE_PREEMPTED and sample.name.endswith("_total"):
                cls = labels.get(ENGINE_CLASS_LABEL, "")
                preempted[cls] = preempted.get(cls, 0.0) + sample.value
            elif family.name == ENGINE_KV_BLOCKS:
                state = labels.get("cadenza_kv_state", "")
                kv[state] = kv.get(state, 0.0) + sample.value
    if not kv:
        return None
    total = kv.get("used", 0.0) + kv.get("cached", 0.0) + kv.get("free", 0.0)
    usage = min(1.0, (kv.get("used", 0.0) + kv.get("reserved", 0.0)) / total) if total > 0 else None
    predicted = _histograms(families, None).get(ENGINE_PREDICTED_STEP, {}).get("")
    return EngineSnapshot(1, waiting, preempted, usage, predicted)


def _sum_engines(engines: list[EngineSnapshot]) -> EngineSnapshot | None:
    if not engines:
        return None

    def summed(key: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in engines:
            for cls, value in getattr(e, key).items():
                out[cls] = out.get(cls, 0.0) + value
        return out

    usages = [e.kv_usage for e in engines if e.kv_usage is not None]
    steps = [e.predicted_step for e in engines if e.predicted_step is not None]
    predicted = None
    if steps and all(h.bounds == steps[0].bounds for h in steps):
        predicted = steps[0]
        for h in steps[1:]:
            predicted = predicted + h
    return EngineSnapshot(len(engines), summed("waiting"), summed("preempted"), max(usages) if usages else None,
                          predicted)


def _histograms(families, class_label: str | None) -> dict[str, dict[str, Histogram]]:
    buckets: dict[tuple[str, str], dict[float, float]] = {}
    for family in families:
        if family.type != "histogram":
            continue
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                continue
            cls = sample.labels.get(class_label, "") if class_label else ""
            try:
                bound = float(sample.labels["le"])
            except (KeyError, ValueError):
                continue  # a bucket without a bound is not a bucket
            per = buckets.setdefault((family.name, cls), {})
            per[bound] = per.get(bound, 0.0) + sample.value  # other label sets (model, ...) are summed
    out: dict[str, dict[str, Histogram]] = {}
    for (name, cls), per in buckets.items():
        out.setdefault(_base_name(name), {})[cls] = Histogram.from_buckets(per)
    return out


def _base_name(name: str) -> str:
    return name[: -len("_bucket")] if name.endswith("_bucket") else name


@dataclass(frozen=True)
class ClassWindow:
    """One class's latency over one window.

    Attributes:
        known: False when the figures below must not be acted on; ``reason`` says why.
        requests: requests that got a first token in the window (TTFT observations).
        ttft_p99_ms / itl_p99_ms: p99 estimates (None when there were no observations).
        attainment: share of observations within target, the lower of TTFT's and ITL's (None
            without a target or without observations).
        queue_depth: the most requests of the class queued at once, over the engines, at the
            window's scrapes.
        kv_usage: the highest KV usage (0-1) of any engine at the window's scrapes (the pool's).
        preemptions: requests of the class preempted in the window.
        predicted_step_p99_ms: p99 of the engines' predicted step time in the window (the pool's).
        The four engine figures are None when the engines' series were not scraped.
    """

    known: bool
    reason: str = ""
    requests: int = 0
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    attainment: float | None = None
    window_s: float = 0.0
    queue_depth: int | None = None
    kv_usage: float | None = None
    preemptions: int | None = None
    predicted_step_p99_ms: float | None = None

    def load(self) -> str:
        """The engine figures as "queue 3, KV 97 %, 2 preempted, predicted step p99 410 ms"
        (empty without them)."""
        parts = []
        if self.queue_depth is not None:
            parts.append(f"queue {self.queue_depth}")
        if self.kv_usage is not None:
            parts.append(f"KV {self.kv_usage:.0%}")
        if self.preemptions:
            parts.append(f"{self.preemptions} preempted")
        if self.predicted_step_p99_ms is not None:
            parts.append(f"predicted step p99 {self.predicted_step_p99_ms:.0f} ms")
        return ", ".join(parts)

    def over(self, slo: Mapping[str, float], factor: float = 1.0) -> list[str]:
        """The figures above ``factor`` x their target, as "TTFT p99 812 ms > 500 ms" strings."""
        out = []
        for key, name, value in (("ttftP99Ms", "TTFT", self.ttft_p99_ms), ("itlP99Ms", "ITL", self.itl_p99_ms)):
            target = slo.get(key)
            if target is not None and value is not None and value > factor * target:
                out.append(f"{name} p99 {value:.0f} ms > {factor * target:.0f} ms")
        return out

    def to_status(self) -> dict:
        doc: dict = {"known": self.known, "requests": self.requests, "windowSeconds": round(self.window_s)}
        for key, value in (("ttftP99Ms", self.ttft_p99_ms), ("itlP99Ms", self.itl_p99_ms),
                           ("attainment", self.attainment), ("queueDepth", self.queue_depth),
                           ("kvUsage", self.kv_usage), ("preemptions", self.preemptions),
                           ("predictedStepP99Ms", self.predicted_step_p99_ms)):
            if value is not None:
                doc[key] = round(value, 4 if key in ("attainment", "kvUsage") else 1) if isinstance(value, float) else value
        if self.reason:
            doc["reason"] = self.reason
        return doc


@dataclass(frozen=True)
class Signals:
    """Per class, the fast and the slow window (what :func:`cadenza.control.decide.decide` reads)."""

    fast: Mapping[str, ClassWindow]
    slow: Mapping[str, ClassWindow]


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
            before, after = first.preempted.get(cls, 0.0), last.preempted[cls]
            preempted = (preempted or 0.0) + (after - before if after >= before else after)  # it restarted
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
    return out


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


class PrometheusSource:
    """Signals from a Prometheus-compatible query API (``spec.controller.prometheus``), for pools
    whose gateways export over OTLP to a metrics backend, or are scraped by one.

    Each window is one instant query per histogram:
    ``sum by (le) (increase(NAME_bucket{cadenza_traffic_class="CLS", SELECTOR}[WINDOWs]))``,
    whose buckets go through the same :class:`Histogram` estimate as a scrape. Unknown when the
    query fails, returns no series or NaN, or counts fewer than ``min_samples`` requests (none at
    all over a window is a known zero only when the series exists).

    With ``engine_selector`` (the label matchers of the pool's engines), the engine figures come
    from the same backend: peak summed queue depth and peak per-engine KV usage over the window
    (subqueries at ``step_s``), ``increase`` of the class's preemptions, and the predicted step
    time's p99. A failing or empty engine query leaves that figure None.

    Args:
        url: the API root (``http://prometheus:9090``; ``/api/v1/query`` is appended).
        selector: extra label matchers that pick this pool's gateways, e.g. ``job="chat-gateway"``.
        engine_selector: label matchers that pick this pool's engines; "" for no engine figures.
        get: ``get(url, params) -> JSON`` (an HTTP GET; injected in tests).
        step_s: resolution of the peak subqueries (seconds).
    """

    def __init__(self, url: str, selector: str = "", get: Callable[[str, dict], dict] | None = None, *,
                 engine_selector: str = "", step_s: float = 5.0) -> None:
        self.url, self.selector = url.rstrip("/"), _matchers(selector)
        self.engine_selector, self.step_s = _matchers(engine_selector), step_s
        self.get = get or _http_get_json

    def record(self, now: float) -> None:
        """Nothing to keep: the backend holds the history."""

    def _query(self, query: str, now: float) -> list[dict]:
        doc = self.get(f"{self.url}/api/v1/query", {"query": query, "time": f"{now:.3f}"})
        if not isinstance(doc, Mapping):
            raise ValueError(f"the answer is not a JSON object: {type(doc).__name__}")
        if doc.get("status") != "success":
            raise ValueError(doc.get("error") or "query failed")
        return doc["data"]["result"]

    def _histogram(self, name: str, matchers: str, window_s: float, now: float) -> Histogram | None:
        query = f"sum by (le) (increase({name}_bucket{{{matchers}}}[{max(1, round(window_s))}s]))"
        per = {float(r["metric"]["le"]): float(r["value"][1]) for r in self._query(query, now) if "le" in r["metric"]}
        return Histogram.from_buckets(per) if per else None

    def _scalar(self, query: str, now: float) -> float | None:
        try:
            result = self._query(query, now)
            value = float(result[0]["value"][1]) if result else None
        except (OSError, HTTPException, ValueError, KeyError, TypeError, IndexError, AttributeError):
            return None
        return value if value is not None and math.isfinite(value) and value >= 0 else None

    def _engine_figures(self, cls: str, window_s: float, now: float) -> dict:
        if not self.engine_selector:
            return {}
        sel, w = self.engine_selector, f"{max(1, round(window_s))}s"
        span = f"[{w}:{max(1, round(self.step_s))}s]"
        kv = (f'sum by (instance) ({ENGINE_KV_BLOCKS}{{cadenza_kv_state=~"used|reserved", {sel}}}) / '
              f'sum by (instance) ({ENGINE_KV_BLOCKS}{{cadenza_kv_state=~"used|cached|free", {sel}}})')
        figures = {
            "queue_depth": self._scalar(f"max_over_time((sum({ENGINE_REQUESTS}{{{ENGINE_CLASS_LABEL}=\"{cls}\", "
                                        f"cadenza_request_state=\"waiting\", {sel}}})){span})", now),
            "kv_usage": self._scalar(f"max_over_time((max({kv})){span})", now),
            "preemptions": self._scalar(f"sum(increase({ENGINE_PREEMPTED}_total{{{ENGINE_CLASS_LABEL}=\"{cls}\", "
                                        f"{sel}}}[{w}]))", now),
        }
        try:
            step = self._histogram(ENGINE_PREDICTED_STEP, sel, window_s, now)
        except (OSError, HTTPException, ValueError, KeyError, TypeError, AttributeError):
            step = None
        p99 = step.quantile(0.99) if step is not None and step.finite else None
        figures["predicted_step_p99_ms"] = None if p99 is None else p99 * 1e3
        out = {k: v for k, v in figures.items() if v is not None}
        for key in ("queue_depth", "preemptions"):
            if key in out:
                out[key] = int(round(out[key]))
        if "kv_usage" in out:
            out["kv_usage"] = min(1.0, out["kv_usage"])
        return out

    def window(self, cls: str, window_s: float, now: float, slo: Mapping[str, float], *, min_samples: int,
               stale_s: float) -> ClassWindow:
        matchers = f'{CLASS_LABEL}="{cls}"' + (f", {self.selector}" if self.selector else "")
        try:
            ttft = self._histogram(TTFT_METRIC, matchers, window_s, now)
            itl = self._histogram(ITL_METRIC, matchers, window_s, now)
        except (OSError, HTTPException, ValueError, KeyError, TypeError, AttributeError) as exc:
            return ClassWindow(False, f"prometheus: {exc}")
        if ttft is None:
            return ClassWindow(False, f"prometheus has no {cls} latency series")
        if not ttft.finite or (itl is not None and not itl.finite):
            return ClassWindow(False, "a NaN or negative count in the latency series")
        return replace(window_of(ttft, itl, slo, min_samples, window_s), **self._engine_figures(cls, window_s, now))


def _matchers(selector: str) -> str:
    return selector.strip().strip("{}").strip()


def window_of(ttft: Histogram, itl: Histogram | None, slo: Mapping[str, float], min_samples: int,
              span: float) -> ClassWindow:
    """The figures of one window's histograms (shared by both sources and the simulator); the
    engine figures are left unset."""
    requests = int(round(ttft.total))
    ttft_p99, itl_p99 = ttft.quantile(0.99), itl.quantile(0.99) if itl is not None else None
    shares = [h.share_at_most(slo[key] / 1e3) for key, h in (("ttftP99Ms", ttft), ("itlP99Ms", itl))
              if h is not None and slo.get(key) is not None]
    shares = [s for s in shares if s is not None]
    # No request at all in a covered window is a known zero (the class has no traffic); a few
    # are too few to estimate a p99 from.
    enough = requests == 0 or requests >= min_samples
    return ClassWindow(
        known=enough,
        reason="" if enough else f"{requests} requests < {min_samples} needed",
        requests=requests,
        ttft_p99_ms=None if ttft_p99 is None else ttft_p99 * 1e3,
        itl_p99_ms=None if itl_p99 is None else itl_p99 * 1e3,
        attainment=min(1.0, max(0.0, min(shares))) if shares else None,
        window_s=span,
    )


def signal_source(spec: Mapping, scrape: Callable[[], Mapping[str, str] | None], keep_s: float):
    """The source ``spec.controller.prometheus`` asks for, else scraping the gateways."""
    prometheus = (spec.get("controller") or {}).get("prometheus") or {}
    if prometheus.get("url"):
        return PrometheusSource(prometheus["url"], prometheus.get("selector", ""),
                                engine_selector=prometheus.get("engineSelector", ""))
    return ScrapeSource(scrape, keep_s)


def _http_get_json(url: str, params: dict) -> dict:
    with urllib.request.urlopen(f"{url}?{urllib.parse.urlencode(params)}", timeout=5) as resp:
        return json.loads(resp.read())


def read_signals(source, now: float, slo: Mapping[str, Mapping[str, float]], fast_s: float, slow_s: float,
                 *, min_samples: int, stale_s: float) -> Signals:
    """Every class's fast and slow window from ``source`` (a :class:`ScrapeSource` or
    :class:`PrometheusSource`) at ``now``."""
    def windows(seconds: float) -> dict[str, ClassWindow]:
        return {cls: source.window(cls, seconds, now, slo.get(cls) or {}, min_samples=min_samples, stale_s=stale_s)
                for cls in CLASSES}

    return Signals(windows(fast_s), windows(slow_s))
