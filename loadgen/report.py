"""Summaries of a replay: latency percentiles, throughput, goodput and SLO attainment.

Definitions (the names of DESIGN.md's terms):

- TTFT: send to the first text-carrying chunk, per request (ms).
- ITL: every gap between consecutive text-carrying chunks, pooled over all requests (ms).
- TPOT: per request, ``(e2e − TTFT) / (completion_tokens − 1)`` (ms); none for one-token requests.
- Goodput: completed requests per second of replay that meet **every** SLO given: TTFT ≤
  ``slo.ttft_ms`` and the request's own p99 ITL ≤ ``slo.itl_ms`` (a request with fewer than two
  tokens has no gap and meets the ITL SLO). With no SLO given, every completed request counts.
  This is how vLLM's ``benchmark_serving --goodput`` counts, with the request's p99 ITL where vLLM
  checks its TPOT.
- SLO attainment: the fraction of **all** replayed requests (failed ones count as misses) that
  meet every SLO given.
- Per class: the same TTFT/ITL/TPOT distributions, counts and attainment over the requests sent
  with each ``x-cadenza-class``; requests sent without one are grouped under ``(no class)``.
- Prefix-cache hit rate: of the prompt tokens a cadenza server looked up in its prefix cache
  during the replay, the fraction found there (from its ``/ready`` counters, see
  :func:`cadenza.loadgen.server_samples.prefix_cache_hits`); n/a for other servers.

When attainment is low the report adds a short hint (:func:`attainment_hint`): the offered
load, not the client, is what to change (``--time-scale``, ``--length-scale``).

Percentiles use numpy's default (linear interpolation between closest ranks).
"""

from __future__ import annotations

import textwrap
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cadenza.loadgen.client import RequestRecord
from cadenza.loadgen.server_samples import prefix_cache_hits
from cadenza.node.core.policy import CLASSES

PERCENTILES = (50, 95, 99)
NO_CLASS = "(no class)"
LOW_ATTAINMENT = 0.5  # below this fraction the report hints at a lighter load
HINT_WIDTH = 100  # characters per line of the hint


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency objectives in milliseconds; None means not checked.

    Attributes:
        ttft_ms: the most a request's TTFT may be.
        itl_ms: the most a request's p99 ITL may be.
    """

    ttft_ms: float | None = None
    itl_ms: float | None = None


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """``mean``, ``p50``, ``p95`` and ``p99`` of ``values`` (all None when there are none)."""
    if len(values) == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64)
    out: dict[str, float | None] = {"mean": float(arr.mean())}
    for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES)):
        out[f"p{p}"] = float(v)
    return out


def tpot_ms(record: RequestRecord) -> float | None:
    """Mean time per output token after the first, in ms; None below two tokens or on failure."""
    if not record.ok or record.ttft_ms is None or record.e2e_ms is None:
        return None
    if record.completion_tokens < 2:
        return None
    return (record.e2e_ms - record.ttft_ms) / (record.completion_tokens - 1)


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    """True when ``record`` completed and meets every SLO given (see the module docstring)."""
    if not record.ok:
        return False
    if slo.ttft_ms is not None and (record.ttft_ms is None or record.ttft_ms > slo.ttft_ms):
        return False
    if slo.itl_ms is not None and record.itl_ms:
        if float(np.percentile(record.itl_ms, 99)) > slo.itl_ms:
            return False
    return True


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO,
              server_samples: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The summary dict written to JSON and printed by :func:`format_summary`.

    Args:
        records: every replayed request, completed or failed.
        duration_s: replay wall time in seconds (rates divide by it).
        slo: objectives for goodput and attainment.
        server_samples: the replay's ``/ready`` samples
            (:class:`~cadenza.loadgen.server_samples.ServerSampler`), for the prefix cache.

    Returns:
        ``completed``, ``failed``, ``duration_s``, ``request_throughput`` (req/s),
        ``total_prompt_tokens``, ``total_output_tokens``, ``prompt_tokens_per_s``,
        ``output_tokens_per_s``, ``ttft_ms``/``itl_ms``/``tpot_ms``/``e2e_ms`` (each
        ``mean``/``p50``/``p95``/``p99``), ``slo`` (``ttft_ms``, ``itl_p99_ms``), ``slo_met``,
        ``slo_attainment`` (fraction), ``goodput`` (req/s), ``prefix_cache_hit_tokens``,
        ``prefix_cache_queried_tokens`` and ``prefix_cache_hit_rate`` (fraction; all three None
        when n/a), ``errors`` (message → count) and ``per_class`` (see :func:`per_class`).
        Token totals count completed requests only; a prompt without a usage count is counted
        at its requested length.
    """
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    rate = 1.0 / duration_s if duration_s > 0 else 0.0
    prompt_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len
                        for r in done)
    output_tokens = sum(r.completion_tokens for r in done)
    met = sum(meets_slo(r, slo) for r in records)
    cache = prefix_cache_hits(server_samples)
    return {
        "completed": len(done),
        "failed": len(failed),
        "duration_s": duration_s,
        "request_throughput": len(done) * rate,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "prompt_tokens_per_s": prompt_tokens * rate,
        "output_tokens_per_s": output_tokens * rate,
        "ttft_ms": distribution([r.ttft_ms for r in done if r.ttft_ms is not None]),
        "itl_ms": distribution([gap for r in done for gap in r.itl_ms]),
        "tpot_ms": distribution([t for r in done if (t := tpot_ms(r)) is not None]),
        "e2e_ms": distribution([r.e2e_ms for r in done if r.e2e_ms is not None]),
        "slo": {"ttft_ms": slo.ttft_ms, "itl_p99_ms": slo.itl_ms},
        "slo_met": met,
        "slo_attainment": met / len(records) if records else 0.0,
        "goodput": met * rate,
        "prefix_cache_hit_tokens": cache.hit_tokens if cache else None,
        "prefix_cache_queried_tokens": cache.queried_tokens if cache else None,
        "prefix_cache_hit_rate": cache.rate if cache else None,
        "errors": dict(Counter(r.error or "unknown error" for r in failed).most_common()),
        "per_class": per_class(records, slo),
    }


def _class_order(name: str) -> tuple[int, str]:
    return (CLASSES.index(name) if name in CLASSES else len(CLASSES), name)


def per_class(records: Sequence[RequestRecord], slo: SLO) -> dict[str, dict[str, Any]]:
    """The latency summary of each traffic class, in priority order; ``{}`` when no record has one.

    Returns:
        Class name (or :data:`NO_CLASS`) → ``requests``, ``completed``, ``failed``,
        ``ttft_ms``/``itl_ms``/``tpot_ms`` (each ``mean``/``p50``/``p95``/``p99``, ms; ITL gaps
        pooled over the class's completed requests), ``slo_met`` and ``slo_attainment``.
    """
    if all(r.traffic_class is None for r in records):
        return {}
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(r.traffic_class or NO_CLASS, []).append(r)
    out = {}
    for name in sorted(groups, key=_class_order):
        group = groups[name]
        done = [r for r in group if r.ok]
        met = sum(meets_slo(r, slo) for r in group)
        out[name] = {
            "requests": len(group),
            "completed": len(done),
            "failed": len(group) - len(done),
            "ttft_ms": distribution([r.ttft_ms for r in done if r.ttft_ms is not None]),
            "itl_ms": distribution([gap for r in done for gap in r.itl_ms]),
            "tpot_ms": distribution([t for r in done if (t := tpot_ms(r)) is not None]),
            "slo_met": met,
            "slo_attainment": met / len(group),
        }
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def attainment_hint(summary: dict[str, Any]) -> str | None:
    """A hint (one sentence, wrapped by the report) when SLO attainment is 0 or below
    :data:`LOW_ATTAINMENT`.

    None when no SLO was given or no request completed (then the errors tell why), or when
    attainment is at least :data:`LOW_ATTAINMENT`.
    """
    slo, attainment = summary["slo"], summary["slo_attainment"]
    if (slo["ttft_ms"] is None and slo["itl_p99_ms"] is None) or not summary["completed"]:
        return None
    lighter = "a larger --time-scale (slower arrivals) and/or a smaller --length-scale"
    if summary["slo_met"] == 0:
        return ("Hint: no request met every SLO: the server is slower than the replayed rate, or "
                f"the SLOs are too tight for it. Try {lighter}.")
    if attainment < LOW_ATTAINMENT:
        return (f"Hint: under {LOW_ATTAINMENT:.0%} of requests met every SLO: the server is near "
                f"its limit at this rate. Try {lighter}.")
    return None


def _prefix_cache_text(summary: dict[str, Any]) -> str:
    rate = summary.get("prefix_cache_hit_rate")
    if rate is None:
        return "n/a"
    return (f"{rate * 100:.1f}% of prompt tokens ({summary['prefix_cache_hit_tokens']} of "
            f"{summary['prefix_cache_queried_tokens']})")


def format_summary(summary: dict[str, Any], title: str = "Trace replay") -> str:
    """A plain-text report of :func:`summarize`'s dict, one fact a line, then a latency table."""
    slo = summary["slo"]
    given = [f"TTFT <= {slo['ttft_ms']:g} ms" if slo["ttft_ms"] is not None else "",
             f"p99 ITL <= {slo['itl_p99_ms']:g} ms" if slo["itl_p99_ms"] is not None else ""]
    slo_text = ", ".join(g for g in given if g) or "none given: every completed request counts"
    rows = [
        ("Completed requests", str(summary["completed"])),
        ("Failed requests", str(summary["failed"])),
        ("Duration (s)", _fmt(summary["duration_s"], 2)),
        ("Request throughput (req/s)", _fmt(summary["request_throughput"], 2)),
        ("Prompt throughput (tok/s)", _fmt(summary["prompt_tokens_per_s"], 1)),
        ("Output throughput (tok/s)", _fmt(summary["output_tokens_per_s"], 1)),
        ("Prefix cache hits", _prefix_cache_text(summary)),
        ("SLO", slo_text),
        ("Goodput (req/s)", _fmt(summary["goodput"], 2)),
        ("SLO attainment", f"{summary['slo_attainment'] * 100:.1f}%"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'=' * 16} {title} {'=' * 16}"]
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    if hint := attainment_hint(summary):
        lines += textwrap.wrap(hint, HINT_WIDTH, subsequent_indent="      ",
                               break_long_words=False, break_on_hyphens=False)
    lines.append("")
    header = f"{'':<10}" + "".join(f"{col:>10}" for col in ("mean", "p50", "p95", "p99"))
    lines.append(header)
    for name, key in (("TTFT (ms)", "ttft_ms"), ("ITL (ms)", "itl_ms"),
                      ("TPOT (ms)", "tpot_ms"), ("E2E (ms)", "e2e_ms")):
        dist = summary[key]
        lines.append(f"{name:<10}" + "".join(f"{_fmt(dist[c]):>10}"
                                             for c in ("mean", "p50", "p95", "p99")))
    lines += _format_per_class(summary.get("per_class") or {})
    if summary["errors"]:
        lines.append("")
        lines.append("Errors:")
        lines += [f"  {count} x {message}" for message, count in summary["errors"].items()]
    return "\n".join(lines)


def _format_per_class(classes: dict[str, dict[str, Any]]) -> list[str]:
    """Lines of the per-class table: one row per class and metric, p50/p95/p99 in ms."""
    if not classes:
        return []
    width = max(12, *(len(name) + 2 for name in classes))
    cols = ("p50", "p95", "p99")
    lines = ["", f"{'Per class':<{width}}{'':<10}{'done/sent':>12}" + "".join(f"{c:>10}" for c in cols)]
    for name, stats in classes.items():
        for i, (metric, key) in enumerate((("TTFT (ms)", "ttft_ms"), ("ITL (ms)", "itl_ms"),
                                           ("TPOT (ms)", "tpot_ms"))):
            label = name if i == 0 else ""
            done = f"{stats['completed']}/{stats['requests']}" if i == 0 else ""
            lines.append(f"{label:<{width}}{metric:<10}{done:>12}"
                         + "".join(f"{_fmt(stats[key][c]):>10}" for c in cols))
    return lines
