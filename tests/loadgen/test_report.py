"""Percentiles, TPOT, goodput and SLO attainment on hand-made request records."""

from __future__ import annotations

import pytest

from cadenza.loadgen.client import RequestRecord
from cadenza.loadgen.report import (
    SLO, distribution, format_summary, meets_slo, summarize, tpot_ms)


def _ok(ttft: float, itl: list[float], prompt: int = 100, index: int = 0) -> RequestRecord:
    """A completed request: ``1 + len(itl)`` tokens, e2e = TTFT + all gaps (ms)."""
    return RequestRecord(index=index, arrival_s=0.0, input_len=prompt, output_len=len(itl) + 1,
                         ok=True, ttft_ms=ttft, itl_ms=list(itl), e2e_ms=ttft + sum(itl),
                         prompt_tokens=prompt, completion_tokens=len(itl) + 1)


def _failed(error: str = "HTTP 429: server overloaded") -> RequestRecord:
    return RequestRecord(index=9, arrival_s=0.0, input_len=50, output_len=5, ok=False,
                         error=error, e2e_ms=3.0)


def test_distribution_gives_mean_and_linear_percentiles():
    dist = distribution([10.0, 20.0, 30.0, 40.0])
    assert dist == {"mean": 25.0, "p50": 25.0,
                    "p95": pytest.approx(38.5), "p99": pytest.approx(39.7)}


def test_distribution_of_nothing_is_all_none():
    assert distribution([]) == {"mean": None, "p50": None, "p95": None, "p99": None}


def test_tpot_is_the_mean_gap_after_the_first_token():
    assert tpot_ms(_ok(100.0, [10.0, 20.0, 30.0])) == pytest.approx(20.0)
    assert tpot_ms(_ok(100.0, [])) is None  # one token: no TPOT
    assert tpot_ms(_failed()) is None


def test_slo_needs_ttft_and_the_requests_own_p99_itl_within_bounds():
    slo = SLO(ttft_ms=200.0, itl_ms=50.0)
    assert meets_slo(_ok(150.0, [10.0] * 99), slo)
    assert not meets_slo(_ok(250.0, [10.0] * 99), slo)          # TTFT too slow
    assert not meets_slo(_ok(150.0, [10.0] * 90 + [80.0] * 9), slo)  # 9% of gaps slow: p99 > 50
    assert meets_slo(_ok(150.0, [10.0] * 199 + [500.0]), slo)   # one stall in 200: p99 is 10
    assert meets_slo(_ok(150.0, []), slo)                         # no gaps: ITL SLO holds
    assert not meets_slo(_failed(), SLO())                        # a failure never meets


def test_goodput_counts_completed_requests_meeting_every_slo_per_second():
    records = [_ok(100.0, [10.0, 10.0]), _ok(300.0, [10.0]), _ok(100.0, [90.0]), _failed()]
    summary = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=200.0, itl_ms=50.0))
    assert summary["slo_met"] == 1
    assert summary["goodput"] == pytest.approx(0.5)
    assert summary["slo_attainment"] == pytest.approx(0.25)  # failed requests count as misses


def test_without_slos_goodput_is_the_completed_request_rate():
    summary = summarize([_ok(100.0, [10.0]), _failed()], duration_s=4.0, slo=SLO())
    assert summary["goodput"] == summary["request_throughput"] == pytest.approx(0.25)
    assert summary["slo_attainment"] == pytest.approx(0.5)


def test_summary_counts_tokens_and_pools_itl_over_completed_requests():
    records = [_ok(100.0, [10.0, 30.0], prompt=40), _ok(200.0, [20.0], prompt=60), _failed()]
    summary = summarize(records, duration_s=2.0, slo=SLO())
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["total_prompt_tokens"] == 100
    assert summary["total_output_tokens"] == 5
    assert summary["prompt_tokens_per_s"] == pytest.approx(50.0)
    assert summary["output_tokens_per_s"] == pytest.approx(2.5)
    assert summary["ttft_ms"]["p50"] == pytest.approx(150.0)
    assert summary["itl_ms"]["mean"] == pytest.approx(20.0)  # gaps 10, 30, 20
    assert summary["tpot_ms"]["mean"] == pytest.approx(20.0)  # 20 and 20
    assert summary["errors"] == {"HTTP 429: server overloaded": 1}


def test_report_prints_percentiles_throughput_goodput_and_errors():
    records = [_ok(100.0, [10.0, 30.0]), _failed()]
    text = format_summary(summarize(records, 1.0, SLO(ttft_ms=500.0, itl_ms=40.0)))
    for fact in ("Completed requests", "Failed requests", "Prompt throughput (tok/s)",
                 "Output throughput (tok/s)", "Goodput (req/s)", "TTFT <= 500 ms",
                 "p99 ITL <= 40 ms", "SLO attainment", "50.0%", "TTFT (ms)", "ITL (ms)",
                 "TPOT (ms)", "p95", "p99", "1 x HTTP 429: server overloaded"):
        assert fact in text


def _classed(record: RequestRecord, name: str | None) -> RequestRecord:
    record.traffic_class = name
    return record


def test_per_class_summaries_split_latencies_counts_and_attainment_by_class():
    records = [_classed(_ok(100.0, [10.0, 30.0]), "interactive"),
               _classed(_ok(300.0, [20.0]), "interactive"),
               _classed(_ok(900.0, [50.0, 70.0, 90.0]), "batch"),
               _classed(_failed(), "batch")]
    per = summarize(records, duration_s=1.0, slo=SLO(ttft_ms=500.0))["per_class"]
    assert list(per) == ["interactive", "batch"]  # priority order, not arrival order
    inter, batch = per["interactive"], per["batch"]
    assert (inter["requests"], inter["completed"], inter["failed"]) == (2, 2, 0)
    assert (batch["requests"], batch["completed"], batch["failed"]) == (2, 1, 1)
    assert inter["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert inter["ttft_ms"]["p99"] == pytest.approx(298.0)
    assert inter["itl_ms"]["p50"] == pytest.approx(20.0)  # gaps 10, 30, 20 pooled
    assert inter["tpot_ms"]["p50"] == pytest.approx(20.0)  # 20 and 20
    assert batch["ttft_ms"] == {"mean": 900.0, "p50": 900.0, "p95": 900.0, "p99": 900.0}
    assert batch["itl_ms"]["p95"] == pytest.approx(88.0)
    assert batch["tpot_ms"]["p50"] == pytest.approx(70.0)
    assert (inter["slo_attainment"], batch["slo_attainment"]) == (1.0, 0.0)


def test_without_classes_there_is_no_per_class_breakdown():
    summary = summarize([_ok(100.0, [10.0]), _failed()], duration_s=1.0, slo=SLO())
    assert summary["per_class"] == {}
    assert "Per class" not in format_summary(summary)


def test_requests_sent_without_a_class_are_grouped_apart_when_others_have_one():
    records = [_classed(_ok(100.0, [10.0]), "background"), _ok(50.0, [5.0])]
    assert list(summarize(records, 1.0, SLO())["per_class"]) == ["background", "(no class)"]


def test_report_prints_a_per_class_table_of_percentiles():
    records = [_classed(_ok(100.0, [10.0, 30.0]), "interactive"),
               _classed(_ok(900.0, [50.0]), "batch"), _classed(_failed(), "batch")]
    lines = format_summary(summarize(records, 1.0, SLO())).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Per class"))
    table = lines[start:start + 7]
    assert table[0].split() == ["Per", "class", "done/sent", "p50", "p95", "p99"]
    assert table[1].split()[:4] == ["interactive", "TTFT", "(ms)", "1/1"]
    assert table[4].split()[:5] == ["batch", "TTFT", "(ms)", "1/2", "900.0"]
    assert [line.split()[0] for line in table[5:7]] == ["ITL", "TPOT"]


def _hint_lines(text: str) -> list[str]:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Hint:")), None)
    if start is None:
        return []
    end = next(i for i in range(start, len(lines)) if not lines[i])
    return lines[start:end]


def test_zero_attainment_says_the_server_is_slower_than_the_rate_and_how_to_slow_it():
    records = [_ok(900.0, [10.0]), _ok(800.0, [10.0]), _failed()]
    text = format_summary(summarize(records, 1.0, SLO(ttft_ms=500.0)))
    hint = " ".join(line.strip() for line in _hint_lines(text))
    assert "no request met every SLO" in hint
    assert "the server is slower than the replayed rate" in hint
    assert "the SLOs are too tight for it" in hint
    assert "a larger --time-scale (slower arrivals)" in hint and "--length-scale" in hint
    assert 1 <= len(_hint_lines(text)) <= 2 and all(len(line) <= 100 for line in _hint_lines(text))
    lines = text.splitlines()
    assert lines.index(_hint_lines(text)[0]) == 1 + next(
        i for i, line in enumerate(lines) if line.startswith("SLO attainment"))


def test_low_attainment_gets_a_milder_hint_and_half_or_more_gets_none():
    slo = SLO(ttft_ms=500.0)
    low = format_summary(summarize([_ok(100.0, [10.0])] + [_ok(900.0, [10.0])] * 3, 1.0, slo))
    hint = " ".join(line.strip() for line in _hint_lines(low))
    assert "under 50% of requests met every SLO" in hint and "--time-scale" in hint
    assert "slower than the replayed rate" not in hint
    half = format_summary(summarize([_ok(100.0, [10.0]), _ok(900.0, [10.0])], 1.0, slo))
    assert _hint_lines(half) == []


def test_there_is_no_speed_hint_without_slos_or_without_a_completed_request():
    assert _hint_lines(format_summary(summarize([_ok(100.0, [10.0]), _failed(), _failed()],
                                                1.0, SLO()))) == []
    assert _hint_lines(format_summary(summarize([_failed()], 1.0, SLO(ttft_ms=1.0)))) == []


def test_the_prefix_cache_hit_rate_comes_from_the_server_samples_and_is_printed():
    samples = [{"t": 0.0, "prefix_cache_queried_tokens": 1000, "prefix_cache_hit_tokens": 0},
               {"t": 1.0, "prefix_cache_queried_tokens": 2000, "prefix_cache_hit_tokens": 123}]
    summary = summarize([_ok(100.0, [10.0])], 1.0, SLO(), samples)
    assert summary["prefix_cache_hit_rate"] == pytest.approx(0.123)
    assert (summary["prefix_cache_hit_tokens"], summary["prefix_cache_queried_tokens"]) == (123, 1000)
    assert "Prefix cache hits" in (text := format_summary(summary))
    assert "12.3% of prompt tokens (123 of 1000)" in text


def test_the_prefix_cache_hit_rate_is_na_without_a_cadenza_servers_counters():
    summary = summarize([_ok(100.0, [10.0])], 1.0, SLO(), [{"t": 0.0, "num_steps": 1}])
    assert summary["prefix_cache_hit_rate"] is None and summary["prefix_cache_hit_tokens"] is None
    line = next(x for x in format_summary(summary).splitlines() if x.startswith("Prefix cache"))
    assert line.split()[-1] == "n/a"
    del summary["prefix_cache_hit_rate"]  # a summary from before the prefix cache was reported
    assert "n/a" in format_summary(summary)
