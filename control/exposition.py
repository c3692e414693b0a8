"""Prometheus exposition text -> snapshots of a pool's SLO series.

Each gateway's and engine's ``GET /metrics`` body is parsed (``prometheus_client``'s parser)
into a :class:`Snapshot`: the gateways' client-side TTFT and ITL histograms per traffic class
(:mod:`cadenza.gateway.metrics`), summed over gateways, and the engines' load
(:mod:`cadenza.node.frontend.telemetry`) — requests waiting per class (``cadenza.requests``,
state ``waiting``), KV blocks by state (``cadenza.kv.blocks``), preemptions per class
(``cadenza.requests.preempted``), the cost models' predicted step time
(``cadenza.step.predicted_duration``), and what tells prefill interference apart: tokens computed
by kind (``cadenza.step.tokens``' sums), the prompt lengths of finished requests
(``gen_ai.client.token.usage``, ``input``), the prompt tokens whose KV came from a prefill replica
(``cadenza.kv_transfer.loaded_tokens`` and ``.recomputed_tokens``) and each engine's selective
threshold (``cadenza.kv_transfer.min_prompt_tokens``); from the gateways, the threshold they apply
(``cadenza.gateway.disagg.min_prompt_tokens``). Each source's own snapshot is kept beside the
sums, so windows take their deltas per source (:mod:`.scrape`). :func:`gauge_values` reads one
gauge's samples (the status reads the gateways' disaggregation threshold with it).

A text that does not parse is left out, as if that source had not answered; a NaN or negative
engine gauge or counter says nothing and is skipped. Names and labels come from
:mod:`cadenza.node.metric_names`, the emitters' own. Pure: the caller gives the scrape time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

import cadenza.node.metric_names as names  # the emitters' names, as Prometheus spells them
from cadenza.control.histograms import Histogram

TTFT_METRIC = names.GATEWAY_TTFT.prometheus
ITL_METRIC = names.GATEWAY_ITL.prometheus
CLASS_LABEL = names.label(names.TRAFFIC_CLASS)
ENGINE_REQUESTS = names.REQUESTS.prometheus
ENGINE_KV_BLOCKS = names.KV_BLOCKS.prometheus
ENGINE_PREEMPTED = names.REQUESTS_PREEMPTED.prometheus
ENGINE_PREDICTED_STEP = names.STEP_PREDICTED_DURATION.prometheus
ENGINE_CLASS_LABEL = names.label(names.REQUEST_CLASS)
ENGINE_STEP_TOKENS = names.STEP_TOKENS.prometheus
ENGINE_TOKEN_KIND_LABEL = names.label(names.TOKEN_KIND)
ENGINE_TOKEN_USAGE = names.TOKEN_USAGE.prometheus
ENGINE_TOKEN_TYPE_LABEL = names.label(names.TOKEN_TYPE)
ENGINE_MOVED_TOKENS = (names.KV_TRANSFER_LOADED_TOKENS.prometheus, names.KV_TRANSFER_RECOMPUTED_TOKENS.prometheus)
ENGINE_MIN_PROMPT_TOKENS = names.KV_TRANSFER_MIN_PROMPT_TOKENS.prometheus
GATEWAY_MIN_PROMPT_TOKENS = names.GATEWAY_DISAGG_MIN_PROMPT_TOKENS.prometheus


@dataclass(frozen=True)
class EngineSnapshot:
    """The engines' load at one scrape, over every engine that answered.

    Attributes:
        engines: how many engines' texts it sums.
        waiting: per class, requests queued (summed).
        preempted: per class, requests preempted since each engine started (summed, cumulative).
        kv_usage: the fullest engine's (used + reserved) / all KV blocks, 0-1; None without KV series.
        predicted_step: the cost models' predicted step times (seconds, summed); None without it.
        step_tokens: tokens computed since start, by kind (``prefill``, ``decode``; summed); None
            without the series.
        prompts: prompt lengths (tokens) of the requests finished since start (summed), and
            ``prompt_tokens`` their sum; None without the series.
        moved_tokens: prompt tokens whose KV was loaded from a prefill replica, or recomputed
            after a failed load, since start (summed); None without the series.
        min_prompt_tokens: the selective threshold an engine reports (tokens; the largest).
    """

    engines: int
    waiting: Mapping[str, float] = field(default_factory=dict)
    preempted: Mapping[str, float] = field(default_factory=dict)
    kv_usage: float | None = None
    predicted_step: Histogram | None = None
    step_tokens: Mapping[str, float] | None = None
    prompts: Histogram | None = None
    prompt_tokens: float | None = None
    moved_tokens: float | None = None
    min_prompt_tokens: float | None = None


@dataclass(frozen=True)
class Snapshot:
    """The pool's cumulative latency histograms at one time, summed over its gateways, and its
    engines' load (None when no engine text was scraped).

    Attributes:
        time: seconds (the injected clock's) when it was scraped.
        ttft: per class, client-side time to first token (seconds).
        itl: per class, gaps between consecutive streamed tokens (seconds).
        engine: the engines' queues, KV, preemptions and predicted step time.
        min_prompt_tokens: the selective threshold the gateways apply (tokens; the largest; None
            when no gateway reports one).
        parts: the same, per source (pod or process name), which windows take their deltas from;
            empty when the snapshot is a single source (itself).
    """

    time: float
    ttft: Mapping[str, Histogram] = field(default_factory=dict)
    itl: Mapping[str, Histogram] = field(default_factory=dict)
    engine: EngineSnapshot | None = None
    parts: Mapping[str, Snapshot] = field(default_factory=dict)
    min_prompt_tokens: float | None = None

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
        parts[name] = Snapshot(time, hists.get(TTFT_METRIC, {}), hists.get(ITL_METRIC, {}), _engine(families),
                               min_prompt_tokens=_largest(_gauge(families, GATEWAY_MIN_PROMPT_TOKENS)))
    sums: dict[str, dict[str, Histogram]] = {"ttft": {}, "itl": {}}
    for part in parts.values():
        for key in sums:
            for cls, hist in getattr(part, key).items():
                have = sums[key].get(cls)
                sums[key][cls] = hist if have is None else have + hist
    if errors and not parts:
        raise ValueError("no text is in the Prometheus exposition format: " + "; ".join(errors))
    engines = [part.engine for part in parts.values() if part.engine is not None]
    threshold = _largest([p.min_prompt_tokens for p in parts.values() if p.min_prompt_tokens is not None])
    return Snapshot(time, sums["ttft"], sums["itl"], _sum_engines(engines), parts, threshold)


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
    step_tokens = _sums(families, ENGINE_STEP_TOKENS, ENGINE_TOKEN_KIND_LABEL)
    prompts = _histograms(families, ENGINE_TOKEN_TYPE_LABEL).get(ENGINE_TOKEN_USAGE, {}).get("input")
    prompt_tokens = (_sums(families, ENGINE_TOKEN_USAGE, ENGINE_TOKEN_TYPE_LABEL) or {}).get("input")
    moved = [v for name in ENGINE_MOVED_TOKENS for v in _gauge(families, name + "_total")]
    return EngineSnapshot(1, waiting, preempted, usage, predicted, step_tokens, prompts,
                          prompt_tokens if prompts is not None else None, sum(moved) if moved else None,
                          _largest(_gauge(families, ENGINE_MIN_PROMPT_TOKENS)))


def _sum_engines(engines: list[EngineSnapshot]) -> EngineSnapshot | None:
    if not engines:
        return None

    def summed(key: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for e in engines:
            for cls, value in (getattr(e, key) or {}).items():
                out[cls] = out.get(cls, 0.0) + value
        return out

    usages = [e.kv_usage for e in engines if e.kv_usage is not None]
    steps = [e.predicted_step for e in engines if e.predicted_step is not None]
    predicted = None
    if steps and all(h.bounds == steps[0].bounds for h in steps):
        predicted = steps[0]
        for h in steps[1:]:
            predicted = predicted + h
    kinds = [e.step_tokens for e in engines if e.step_tokens is not None]
    prompts = [e.prompts for e in engines if e.prompts is not None]
    prompt_sum = None
    if prompts and all(h.bounds == prompts[0].bounds for h in prompts):
        prompt_sum = prompts[0]
        for h in prompts[1:]:
            prompt_sum = prompt_sum + h
    return EngineSnapshot(len(engines), summed("waiting"), summed("preempted"), max(usages) if usages else None,
                          predicted, summed("step_tokens") if kinds else None, prompt_sum,
                          _total(e.prompt_tokens for e in engines) if prompt_sum is not None else None,
                          _total(e.moved_tokens for e in engines),
                          _largest([e.min_prompt_tokens for e in engines if e.min_prompt_tokens is not None]))


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


def _sums(families, name: str, label: str) -> dict[str, float] | None:
    """Per value of ``label``, the ``_sum`` of histogram ``name`` (other label sets summed); None
    when the text has no such histogram."""
    out: dict[str, float] | None = None
    for family in families:
        if family.name != name or family.type != "histogram":
            continue
        out = {} if out is None else out
        for sample in family.samples:
            if sample.name == name + "_sum" and math.isfinite(sample.value) and sample.value >= 0:
                key = sample.labels.get(label, "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _gauge(families, sample_name: str) -> list[float]:
    """Every finite, non-negative sample named ``sample_name`` (a gauge, or a counter's ``_total``)."""
    return [s.value for f in families for s in f.samples
            if s.name == sample_name and math.isfinite(s.value) and s.value >= 0]


def _largest(values) -> float | None:
    values = list(values)
    return max(values) if values else None


def _total(values) -> float | None:
    found = [v for v in values if v is not None]
    return sum(found) if found else None


def _base_name(name: str) -> str:
    return name[: -len("_bucket")] if name.endswith("_bucket") else name



def gauge_values(texts: Iterable[str], name: str) -> list[float]:
    """Every finite sample of the gauge ``name`` (its Prometheus spelling) in ``texts``.

    Args:
        texts: ``/metrics`` bodies, any order; one that does not parse is skipped (that source
            says nothing this time).

    Returns:
        One value per sample (per source and label set), in text order; empty when none has it.
    """
    values: list[float] = []
    for text in texts:
        try:
            families = list(text_string_to_metric_families(text))
        except (ValueError, KeyError, TypeError, IndexError):
            continue
        values += [s.value for f in families for s in f.samples if s.name == name and math.isfinite(s.value)]
    return values
