"""The engines' part of the signals: queue depth, KV usage, preemptions and predicted step time per
window, parsed from the real telemetry's Prometheus text, and what the controller makes of them."""

from __future__ import annotations

import re

import pytest

from cadenza.gateway.metrics import GatewayMetrics
from cadenza.control.decide import Shape, decide
from cadenza.control.history import History
from cadenza.control.spec import ControllerSpec
from cadenza.control.exposition import parse_pool_metrics
from cadenza.control.prometheus import PrometheusSource
from cadenza.control.scrape import SnapshotHistory
from cadenza.control.signals import ClassWindow, Signals
from metrics_server import FakeEngine

SLO = {"interactive": {"ttftP99Ms": 500, "itlP99Ms": 100}}


@pytest.fixture
def gateway():
    return GatewayMetrics([0.1, 0.5])


def traffic(gateway: GatewayMetrics, n: int, ttft: float = 0.05, itl: float = 0.02) -> None:
    for _ in range(n):
        gateway.ttft.record(ttft, {"cadenza.traffic_class": "interactive"})
        gateway.itl.record(itl, {"cadenza.traffic_class": "interactive"})


def gateway_text(gateway: GatewayMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(gateway.registry).decode()


def test_an_engine_text_is_told_from_a_gateway_text_and_engines_are_combined(gateway):
    a, b = FakeEngine(), FakeEngine()
    a.load(used=50, reserved=10, waiting={"interactive": 2, "batch": 5}, preempted={"interactive": 1})
    b.load(used=90, reserved=5, waiting={"interactive": 1}, steps_s=(0.2, 0.3))
    traffic(gateway, 3)
    snap = parse_pool_metrics([gateway_text(gateway), a.text(), b.text()], 10.0)
    assert snap.ttft["interactive"].total == 3  # the engines' own TTFT histograms are not the gateway's
    engine = snap.engine
    assert engine.engines == 2
    assert engine.waiting == {"interactive": 3, "batch": 5}
    assert engine.preempted == {"interactive": 1, "batch": 0}
    assert engine.kv_usage == pytest.approx(0.95)  # the fullest engine's (used + reserved) / all
    assert engine.predicted_step.total == 2
    assert parse_pool_metrics([gateway_text(gateway)], 10.0).engine is None


def test_a_window_has_the_peak_queue_and_kv_the_preemptions_in_it_and_the_predicted_step_p99(gateway):
    engine = FakeEngine()
    history = SnapshotHistory(keep_s=100)
    engine.load(preempted={"interactive": 4}, steps_s=(0.1,) * 10)  # before the window: not counted
    history.add(parse_pool_metrics([gateway_text(gateway), engine.text()], 0.0))
    for t, (waiting, used) in enumerate([(1, 20), (6, 97), (2, 40)], start=1):
        traffic(gateway, 10)
        engine.load(used=used, waiting={"interactive": waiting}, preempted={"interactive": 4 + t},
                    steps_s=(0.4,) * 20)
        history.add(parse_pool_metrics([gateway_text(gateway), engine.text()], 10.0 * t))
    w = history.window("interactive", 30, 30.0, SLO["interactive"], min_samples=10, stale_s=60)
    assert w.known and w.requests == 30
    assert w.queue_depth == 6  # the peak, not the last scrape's 2
    assert w.kv_usage == pytest.approx(0.97)
    assert w.preemptions == 3  # 7 - 4
    assert w.predicted_step_p99_ms == pytest.approx(400, rel=0.13)  # 1.25x buckets; the 0.1 s steps are before
    assert "queue 6" in w.load() and "KV 97%" in w.load() and "3 preempted" in w.load()
    doc = w.to_status()
    assert doc["queueDepth"] == 6 and doc["kvUsage"] == pytest.approx(0.97) and doc["preemptions"] == 3


def test_an_engine_restart_restarts_its_counts_and_missing_engines_leave_figures_unset(gateway):
    engine = FakeEngine()
    history = SnapshotHistory(keep_s=100)
    engine.load(preempted={"interactive": 9})
    traffic(gateway, 5)
    history.add(parse_pool_metrics([gateway_text(gateway), engine.text()], 0.0))
    restarted = FakeEngine()
    restarted.load(preempted={"interactive": 2})
    traffic(gateway, 5)
    history.add(parse_pool_metrics([gateway_text(gateway), restarted.text()], 30.0))
    w = history.window("interactive", 30, 30.0, SLO["interactive"], min_samples=1, stale_s=60)
    assert w.preemptions == 2  # never negative
    bare = SnapshotHistory(keep_s=100)
    bare.add(parse_pool_metrics([gateway_text(gateway)], 0.0))
    traffic(gateway, 5)
    bare.add(parse_pool_metrics([gateway_text(gateway)], 30.0))
    w = bare.window("interactive", 30, 30.0, SLO["interactive"], min_samples=1, stale_s=60)
    assert w.known and w.queue_depth is None and w.kv_usage is None and w.preemptions is None
    assert w.load() == ""


def window(itl_ms: float, **engine) -> ClassWindow:
    return ClassWindow(True, requests=500, ttft_p99_ms=100, itl_p99_ms=itl_ms, window_s=30, **engine)


def test_a_kv_bound_breach_skips_retuning_and_its_reason_names_the_load():
    spec = ControllerSpec.from_pool_spec({"slo": SLO, "engine": {"chunkSize": 256}})
    knobs = {"chunk_size": 256, "token_budget": 512, "step_time_target_ms": None}
    pressed = window(300, queue_depth=4, kv_usage=0.99, preemptions=3, predicted_step_p99_ms=80)
    signals = Signals({"interactive": pressed}, {"interactive": pressed})
    d = decide(signals, Shape(2), knobs, History(), spec, now=1000.0)
    assert d.action == "hold" and d.knobs is None
    assert "KV full" in d.reason and "queue 4, KV 99%, 3 preempted, predicted step p99 80 ms" in d.reason
    assert d.history.bound_since == 1000.0  # rung 1 counts as exhausted: the slow-window wait starts
    d = decide(signals, Shape(2), knobs, d.history, spec, now=1000.0 + spec.slow_window_s)
    assert d.action == "reshape" and d.move == "dedicate" and "KV full" in d.reason
    # The same breach with KV to spare retunes first.
    roomy = window(300, queue_depth=4, kv_usage=0.5, preemptions=0)
    d = decide(Signals({"interactive": roomy}, {"interactive": roomy}), Shape(2), knobs, History(), spec, 1000.0)
    assert d.action == "retune" and d.knobs["chunk_size"] == 128 and "queue 4, KV 50%" in d.reason


def test_prometheus_engine_queries_use_the_engine_selector_and_a_failing_one_leaves_the_figure_unset():
    queries = []

    def get(url, params):
        q = params["query"]
        queries.append(q)
        if "_bucket" in q and "cadenza_gateway" in q:
            return {"status": "success", "data": {"result": [
                {"metric": {"le": "0.1"}, "value": [0, "300"]}, {"metric": {"le": "+Inf"}, "value": [0, "300"]}]}}
        if "cadenza_requests{" in q:
            return {"status": "success", "data": {"result": [{"metric": {}, "value": [0, "3"]}]}}
        if "cadenza_kv_blocks" in q:
            return {"status": "success", "data": {"result": [{"metric": {}, "value": [0, "0.5"]}]}}
        return {"status": "error", "error": "bad query"}

    w = PrometheusSource("http://p", 'job="gw"', get, engine_selector='job="engines"').window(
        "interactive", 30, 0.0, SLO["interactive"], min_samples=100, stale_s=60)
    assert w.known and w.queue_depth == 3 and w.kv_usage == 0.5
    assert w.preemptions is None and w.predicted_step_p99_ms is None
    engine_queries = [q for q in queries if "cadenza_gateway" not in q]
    assert engine_queries and all('job="engines"' in q for q in engine_queries)
    assert all('job="gw"' in q for q in queries if "cadenza_gateway" in q)
    queries.clear()
    PrometheusSource("http://p", 'job="gw"', get).window("interactive", 30, 0.0, SLO["interactive"],
                                                         min_samples=1, stale_s=60)
    assert all("cadenza_gateway" in q for q in queries)  # no engine selector: no engine queries


def test_a_gateway_that_misses_a_scrape_never_lets_its_lifetime_into_a_window():
    a, b = GatewayMetrics([0.1]), GatewayMetrics([0.1])
    traffic(a, 1000, ttft=0.9)  # slow history from before the window
    traffic(b, 1000, ttft=0.9)
    history = SnapshotHistory(keep_s=100)
    history.add(parse_pool_metrics({"gw-a": gateway_text(a), "gw-b": gateway_text(b)}, 0.0))
    traffic(a, 50)
    history.add(parse_pool_metrics({"gw-a": gateway_text(a)}, 10.0))  # gw-b did not answer
    traffic(a, 50)
    traffic(b, 50)
    history.add(parse_pool_metrics({"gw-a": gateway_text(a), "gw-b": gateway_text(b)}, 20.0))
    # Fast window (10 -> 20 s): gw-b was not seen at 10 s; it counts from its first scrape in the
    # window only, so its 1,000 old slow requests stay out (a summed delta would let them in).
    fast = history.window("interactive", 10, 20.0, SLO["interactive"], min_samples=1, stale_s=60)
    assert fast.requests == 50 and fast.ttft_p99_ms < 100
    slow = history.window("interactive", 20, 20.0, SLO["interactive"], min_samples=1, stale_s=60)
    assert slow.requests == 150 and slow.ttft_p99_ms < 100
    # The newest scrape missing gw-b: its part is left out, the rest still measured.
    traffic(a, 10)
    history.add(parse_pool_metrics({"gw-a": gateway_text(a)}, 30.0))
    w = history.window("interactive", 10, 30.0, SLO["interactive"], min_samples=1, stale_s=60)
    assert w.requests == 10
    # A class only a brand-new gateway has seen is unknown, not a known zero.
    c = GatewayMetrics([0.1])
    c.ttft.record(0.05, {"cadenza.traffic_class": "batch"})
    history.add(parse_pool_metrics({"gw-a": gateway_text(a), "gw-c": gateway_text(c)}, 40.0))
    assert not history.window("batch", 10, 40.0, {}, min_samples=1, stale_s=60).known


TTFT_TEXT = """# TYPE cadenza_gateway_time_to_first_token_seconds histogram
cadenza_gateway_time_to_first_token_seconds_bucket{cadenza_traffic_class="interactive",le="0.1"} %s
cadenza_gateway_time_to_first_token_seconds_bucket{cadenza_traffic_class="interactive",le="1.0"} %s
cadenza_gateway_time_to_first_token_seconds_bucket{cadenza_traffic_class="interactive",le="+Inf"} %s
"""


def two_scrapes(first: str, second: str, **extra) -> ClassWindow:
    history = SnapshotHistory(keep_s=100)
    history.add(parse_pool_metrics({"gw": first, **extra}, 0.0))
    history.add(parse_pool_metrics({"gw": second, **extra}, 30.0))
    return history.window("interactive", 30, 30.0, {"ttftP99Ms": 500}, min_samples=1, stale_s=60)


@pytest.mark.parametrize("bad", ["NaN", "+Inf", "-5"])
def test_a_nan_or_negative_count_in_either_scrape_is_unknown(bad):
    w = two_scrapes(TTFT_TEXT % (bad, 10, 10), TTFT_TEXT % (300, 500, 500))
    assert not w.known and "NaN or negative" in w.reason
    w = two_scrapes(TTFT_TEXT % (0, 0, 0), TTFT_TEXT % (300, bad, 500))
    assert not w.known and "NaN or negative" in w.reason


def test_buckets_that_go_down_are_raised_to_the_running_maximum_so_attainment_stays_a_share():
    w = two_scrapes(TTFT_TEXT % (0, 0, 0), TTFT_TEXT % (400, 200, 400))  # a scrape race: le=1 < le=0.1
    assert w.known and w.requests == 400 and 0 <= w.attainment <= 1 and w.ttft_p99_ms <= 100


def test_an_unparseable_or_malformed_text_is_left_out_not_fatal():
    engine = FakeEngine()
    engine.load(waiting={"interactive": 2})
    broken_engine = re.sub(r'(cadenza_request_state="waiting"[^}]*\}) 2\.0', r"\1 NaN", engine.text())
    assert "NaN" in broken_engine
    no_le = TTFT_TEXT.replace(',le="1.0"', "") % (1, 2, 3)
    w = two_scrapes(TTFT_TEXT % (0, 0, 0), TTFT_TEXT % (300, 300, 300), junk="<html>502 Bad Gateway</html>",
                    engine=broken_engine)
    assert w.known and w.requests == 300 and w.queue_depth == 0  # the NaN gauge says nothing
    snap = parse_pool_metrics({"gw": no_le}, 0.0)  # a bucket without its bound is skipped
    assert snap.ttft["interactive"].bounds == (0.1,)
    with pytest.raises(ValueError):
        parse_pool_metrics({"a": "<html>", "b": "{}}"}, 0.0)  # nothing parsed at all: the scrape fails


def prometheus(result_for):
    return lambda url, params: result_for(params["query"])


def test_prometheus_answers_that_are_not_objects_or_lack_inf_are_handled():
    for answer in ([], None, "x", 5):
        w = PrometheusSource("http://p", get=prometheus(lambda q, a=answer: a)).window(
            "batch", 30, 0.0, {}, min_samples=1, stale_s=60)
        assert not w.known and "not a JSON object" in w.reason
    buckets = {"status": "success", "data": {"result": [
        {"metric": {"le": "0.1"}, "value": [0, "500"]}, {"metric": {"le": "1"}, "value": [0, "1000"]}]}}
    w = PrometheusSource("http://p", get=prometheus(lambda q: buckets)).window("batch", 30, 0.0, {}, min_samples=1,
                                                                              stale_s=60)
    assert w.known and w.requests == 1000  # the last finite bucket, never "no traffic"
    negative = {"status": "success", "data": {"result": [{"metric": {}, "value": [0, "-7"]}]}}
    w = PrometheusSource("http://p", get=prometheus(lambda q: buckets if "_bucket" in q else negative),
                         engine_selector='job="e"').window("batch", 30, 0.0, {}, min_samples=1, stale_s=60)
    assert w.known and w.queue_depth is None and w.kv_usage is None and w.preemptions is None


def test_a_malformed_http_answer_is_an_unknown_window_not_an_exception():
    from http.client import BadStatusLine

    def broken(url, params):
        raise BadStatusLine("garbage")

    w = PrometheusSource("http://p", get=broken).window("interactive", 30, 0.0, {}, min_samples=1, stale_s=60)
    assert not w.known and "prometheus" in w.reason
