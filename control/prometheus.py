"""Signals from a Prometheus-compatible query API (``spec.controller.prometheus``), and the choice
between it and scraping (:func:`signal_source`).

For pools whose gateways export over OTLP to a metrics backend, or are scraped by one: each
window is a handful of instant queries (``increase`` of the histograms' buckets over the
window, peaks of the engines' gauges by subquery), read through the same
:class:`~.histograms.Histogram` estimate as a scrape. The backend holds the history: nothing is
recorded here. Query language: PromQL (Prometheus HTTP API ``/api/v1/query``).
"""

from __future__ import annotations

import json
import math
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import replace
from http.client import HTTPException

from cadenza.control.exposition import (
    CLASS_LABEL,
    ENGINE_CLASS_LABEL,
    ENGINE_KV_BLOCKS,
    ENGINE_MIN_PROMPT_TOKENS,
    ENGINE_MOVED_TOKENS,
    ENGINE_PREDICTED_STEP,
    ENGINE_PREEMPTED,
    ENGINE_REQUESTS,
    ENGINE_STEP_TOKENS,
    ENGINE_TOKEN_KIND_LABEL,
    ENGINE_TOKEN_TYPE_LABEL,
    ENGINE_TOKEN_USAGE,
    GATEWAY_MIN_PROMPT_TOKENS,
    ITL_METRIC,
    TTFT_METRIC,
)
from cadenza.control.histograms import Histogram
from cadenza.control.scrape import ScrapeSource
from cadenza.control.signals import ClassWindow, prefill_figures, window_of

_QUERY_ERRORS = (OSError, HTTPException, ValueError, KeyError, TypeError, IndexError, AttributeError)


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
    time's p99; pool-wide (:func:`~.signals.prefill_figures`), ``increase`` of the tokens computed
    by kind, of the prompt-length histogram and its sum, and of the KV tokens loaded from prefill
    replicas, and the selective threshold now: the gateways' (``selector``) where they apply one,
    else the largest an engine reports. A failing or empty engine query leaves that figure None.

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
        figures |= self._prefill_figures(sel, window_s, now)
        out = {k: v for k, v in figures.items() if v is not None}
        for key in ("queue_depth", "preemptions"):
            if key in out:
                out[key] = int(round(out[key]))
        if "kv_usage" in out:
            out["kv_usage"] = min(1.0, out["kv_usage"])
        return out

    def _prefill_figures(self, sel: str, window_s: float, now: float) -> dict:
        """Prefill share, selective threshold and long-prompt share over the last ``window_s`` seconds."""
        w = f"{max(1, round(window_s))}s"
        try:
            kinds = {r["metric"].get(ENGINE_TOKEN_KIND_LABEL, ""): float(r["value"][1]) for r in self._query(
                f"sum by ({ENGINE_TOKEN_KIND_LABEL}) (increase({ENGINE_STEP_TOKENS}_sum{{{sel}}}[{w}]))", now)}
        except _QUERY_ERRORS:
            kinds = {}
        kinds = {k: v for k, v in kinds.items() if math.isfinite(v) and v >= 0}
        prompts_sel = f'{ENGINE_TOKEN_TYPE_LABEL}="input", {sel}'
        try:
            prompts = self._histogram(ENGINE_TOKEN_USAGE, prompts_sel, window_s, now)
        except _QUERY_ERRORS:
            prompts = None
        moved = "|".join(f"{name}_total" for name in ENGINE_MOVED_TOKENS)
        gateways = f"{{{self.selector}}}" if self.selector else ""
        threshold = self._scalar(f"max({GATEWAY_MIN_PROMPT_TOKENS}{gateways})", now)
        if threshold is None:
            threshold = self._scalar(f"max({ENGINE_MIN_PROMPT_TOKENS}{{{sel}}})", now)
        return prefill_figures(
            kinds.get("prefill", 0.0) if kinds else None, kinds.get("decode", 0.0) if kinds else None, prompts,
            self._scalar(f"sum(increase({ENGINE_TOKEN_USAGE}_sum{{{prompts_sel}}}[{w}]))", now),
            self._scalar(f'sum(increase({{__name__=~"{moved}", {sel}}}[{w}]))', now), threshold)

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

