"""The signals that tell prefill interference from long prompts apart from load: the share of
computed tokens that were prefill, the selective threshold, and the share of prompt tokens in
prompts past it — parsed from the real engines' and gateway's Prometheus text, differenced over a
window, and queried from a Prometheus API."""

from __future__ import annotations

import pytest

from cadenza.control.exposition import parse_pool_metrics
from cadenza.control.histograms import Histogram
from cadenza.control.prometheus import PrometheusSource
from cadenza.control.scrape import SnapshotHistory
from cadenza.control.signals import prefill_figures
from cadenza.gateway.metrics import GatewayMetrics
from metrics_server import FakeEngine

SLO = {"ttftP99Ms": 500, "itlP99Ms": 100}


def gateway_text(threshold: int | None = None) -> str:
    metrics = GatewayMetrics([0.1, 0.5], otlp=False)
    metrics.disagg_threshold = lambda: threshold
    try:
        for _ in range(20):
            metrics.ttft.record(0.05, {"cadenza.traffic_class": "interactive"})
        return metrics.prometheus_text().decode()
    finally:
        metrics.shutdown()


def window_over(before: dict[str, str], after: dict[str, str]):
    history = SnapshotHistory(keep_s=100)
    history.add(parse_pool_metrics(before, 0.0))
    history.add(parse_pool_metrics(after, 30.0))
    return history.window("interactive", 30, 30.0, SLO, min_samples=1, stale_s=60)


def test_an_engine_text_carries_its_token_counts_prompt_lengths_and_threshold():
    engine = FakeEngine()
    engine.serve(prefill=3000, decode=1000, prompts=(3000, 500), loaded=700, threshold=2048)
    snap = parse_pool_metrics({"engine-0": engine.text(), "gw": gateway_text(4096)}, 1.0)
    e = snap.engine
    assert e.step_tokens == {"prefill": 3000, "decode": 1000}
    assert e.prompts.total == 2 and e.prompt_tokens == 3500
    assert e.moved_tokens == 700 and e.min_prompt_tokens == 2048
    assert snap.min_prompt_tokens == 4096  # the gateway's, which it applies
    bare = parse_pool_metrics({"engine-0": FakeEngine().text()}, 1.0)
    assert bare.engine.step_tokens is None and bare.engine.prompts is None and bare.engine.min_prompt_tokens is None
    assert bare.min_prompt_tokens is None


def test_a_window_differences_the_token_counts_per_engine_and_takes_the_largest_engine_threshold():
    a, b = FakeEngine(), FakeEngine()
    a.serve(prefill=5000, decode=100, prompts=(9000,), threshold=2048)  # before the window: not counted
    b.serve(threshold=1500)
    before = {"gw": gateway_text(), "a": a.text(), "b": b.text()}
    a.serve(prefill=3000, decode=1000, prompts=(3000, 3000), threshold=2048)
    b.serve(prefill=1000, decode=1000, prompts=(500,) * 4, threshold=1500)
    w = window_over(before, {"gw": gateway_text(), "a": a.text(), "b": b.text()})
    assert w.prefill_share == pytest.approx(4000 / 6000)
    assert w.min_prompt_tokens == 2048  # the largest an engine reports, as the gateway takes it
    # Two 3,000-token prompts in the (1024, 4096] bucket and four of 500 in (256, 1024]: spread
    # evenly over their buckets, 2 x 2/3 x 3072 of 2 x 2560 + 4 x 640 tokens are past 2,048
    # (the truth is 6,000 of 8,000: the x4 buckets make it an estimate).
    assert w.long_prompt_share == pytest.approx(4096 / 7680)
    doc = w.to_status()
    assert doc["prefillShare"] == pytest.approx(0.6667, abs=1e-4) and doc["minPromptTokens"] == 2048


def test_the_gateways_threshold_wins_over_the_engines():
    a = FakeEngine()
    a.serve(threshold=1024)
    before = {"gw": gateway_text(4096), "a": a.text()}
    a.serve(prefill=3000, decode=1000, prompts=(3000, 3000, 500), threshold=1024)
    w = window_over(before, {"gw": gateway_text(4096), "a": a.text()})
    assert w.min_prompt_tokens == 4096 and w.long_prompt_share == 0.0  # no prompt past 4,096 tokens


def test_a_moved_prompt_counted_by_the_prefill_and_the_decode_replica_counts_once():
    prefill, decode = FakeEngine(), FakeEngine()
    prefill.serve(threshold=1024)
    decode.serve(threshold=1024)
    before = {"p": prefill.text(), "d": decode.text(), "gw": gateway_text()}
    prefill.serve(prefill=3000, prompts=(3000,), threshold=1024)  # prefilled here, finished after its first token
    decode.serve(prefill=1001, decode=400, prompts=(3000, 500, 500), loaded=2999, threshold=1024)
    w = window_over(before, {"p": prefill.text(), "d": decode.text(), "gw": gateway_text()})
    assert w.prefill_share == pytest.approx(4001 / 4401)
    # 4 prompts, 7,000 tokens as counted, 0.8 of them past 1,024 by the buckets; the 2,999 loaded
    # tokens were counted twice: (0.8 x 7000 - 2999) / (7000 - 2999), near the truth 3000 / 4000.
    assert w.long_prompt_share == pytest.approx((0.8 * 7000 - 2999) / (7000 - 2999))


def test_an_engine_restart_counts_from_its_reset_and_missing_series_leave_the_figures_unset():
    a = FakeEngine()
    a.serve(prefill=5000, decode=1000, prompts=(4000,) * 5, threshold=1024)
    before = {"a": a.text(), "gw": gateway_text()}
    restarted = FakeEngine()
    restarted.serve(prefill=100, decode=300, prompts=(500,), threshold=1024)
    w = window_over(before, {"a": restarted.text(), "gw": gateway_text()})
    assert w.prefill_share == pytest.approx(0.25) and w.long_prompt_share == 0.0
    bare = window_over({"a": FakeEngine().text(), "gw": gateway_text()}, {"a": FakeEngine().text(), "gw": gateway_text()})
    assert bare.known and bare.prefill_share is None and bare.min_prompt_tokens is None
    assert bare.long_prompt_share is None and "prefillShare" not in bare.to_status()


def test_prefill_figures_need_a_threshold_and_tokens():
    prompts = Histogram.from_buckets({256: 0, 1024: 2, 4096: 4})  # 2 x 640 + 2 x 2560 tokens
    assert prefill_figures(0.0, 0.0, prompts, 7000, None, 1024) == {"min_prompt_tokens": 1024.0,
                                                                      "long_prompt_share": pytest.approx(0.8)}
    assert prefill_figures(300, 100, prompts, 7000, None, None) == {"prefill_share": 0.75}
    assert "long_prompt_share" not in prefill_figures(300, 100, prompts, 2000, 2000, 1024)  # all moved
    assert "long_prompt_share" not in prefill_figures(300, 100, Histogram.from_buckets({1024: 0}), 0, 0, 1024)


def test_the_prompt_token_share_interpolates_inside_the_bucket_holding_the_threshold():
    h = Histogram.from_buckets({1024: 10, 4096: 20})  # 10 of about 512 tokens, 10 of about 2,560
    assert h.mass_share_at_least(1024) == pytest.approx(25600 / 30720)
    assert h.mass_share_at_least(2048) == pytest.approx(20480 / 30720)
    assert h.mass_share_at_least(0) == 1.0 and h.mass_share_at_least(5000) == 0.0
    assert Histogram.from_buckets({1024: 0}).mass_share_at_least(10) is None
    past = Histogram.from_buckets({1024: 0, float("inf"): 3})  # past the last bound: counted at it
    assert past.mass_share_at_least(1000) == 1.0 and past.mass_share_at_least(2000) == 0.0


def test_prometheus_queries_the_prefill_figures_with_the_selectors():
    queries = []
    answers = {
        "cadenza_step_tokens_sum": [{"metric": {"cadenza_token_kind": "prefill"}, "value": [0, "3000"]},
                                    {"metric": {"cadenza_token_kind": "decode"}, "value": [0, "1000"]}],
        "gen_ai_client_token_usage_bucket": [{"metric": {"le": "256"}, "value": [0, "0"]},
                                             {"metric": {"le": "1024"}, "value": [0, "2"]},
                                             {"metric": {"le": "4096"}, "value": [0, "4"]},
                                             {"metric": {"le": "+Inf"}, "value": [0, "4"]}],
        "gen_ai_client_token_usage_sum": [{"metric": {}, "value": [0, "7000"]}],
        "cadenza_kv_transfer_loaded_tokens_total": [{"metric": {}, "value": [0, "1000"]}],
        "cadenza_kv_transfer_min_prompt_tokens": [{"metric": {}, "value": [0, "1024"]}],
        "cadenza_gateway_time_to_first_token_seconds_bucket": [{"metric": {"le": "+Inf"}, "value": [0, "300"]}],
    }

    def get(url, params):
        q = params["query"]
        queries.append(q)
        found = [result for name, result in answers.items() if name in q]
        return {"status": "success", "data": {"result": found[0] if found else []}}

    w = PrometheusSource("http://p", 'job="gw"', get, engine_selector='job="engines"').window(
        "interactive", 30, 0.0, SLO, min_samples=100, stale_s=60)
    assert w.prefill_share == 0.75 and w.min_prompt_tokens == 1024  # no gateway threshold: the engines'
    assert w.long_prompt_share == pytest.approx((0.8 * 7000 - 1000) / (7000 - 1000))
    assert any("max(cadenza_gateway_disagg_min_prompt_tokens{job=\"gw\"})" == q for q in queries)
    engine_queries = [q for q in queries if "cadenza_gateway" not in q]
    assert all('job="engines"' in q for q in engine_queries)
    assert any('gen_ai_token_type="input"' in q and "increase(gen_ai_client_token_usage_sum" in q for q in queries)
    assert any("cadenza_kv_transfer_recomputed_tokens_total" in q for q in queries)
    answers["cadenza_gateway_disagg_min_prompt_tokens"] = [{"metric": {}, "value": [0, "4096"]}]
    w = PrometheusSource("http://p", 'job="gw"', get, engine_selector='job="engines"').window(
        "interactive", 30, 0.0, SLO, min_samples=100, stale_s=60)
    assert w.min_prompt_tokens == 4096 and w.long_prompt_share == 0.0
