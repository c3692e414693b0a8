"""The emitters write the names the readers read: node/metric_names.py against the real exporters."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from cadenza.node import metric_names as names
from cadenza.node.core.messages import StepRecord
from cadenza.node.core.stats import ClassStats, EngineStats
from cadenza.node.frontend.telemetry import Telemetry
from cadenza.gateway.metrics import GatewayMetrics
from cadenza.control import exposition
from cadenza.operator import status


def families(text: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def test_the_engines_series_carry_the_names_and_labels_the_controller_reads():
    stats = EngineStats(classes={"interactive": ClassStats(waiting=2, running=1, preemptions=3)})
    telemetry = Telemetry("tiny", stats=lambda: stats, otlp=False)
    try:
        telemetry.on_step(StepRecord(0.01, 0.012, 4, 0), time.monotonic())
        f = families(telemetry.prometheus_text())
    finally:
        telemetry.shutdown()
    for metric in (names.REQUESTS, names.KV_BLOCKS, names.REQUESTS_PREEMPTED, names.STEP_PREDICTED_DURATION):
        assert metric.prometheus in f, metric
    preempted = f[exposition.ENGINE_PREEMPTED].samples
    assert preempted[0].labels[exposition.ENGINE_CLASS_LABEL] == "interactive" and preempted[0].value == 3
    assert {s.labels[exposition.ENGINE_CLASS_LABEL] for s in f[exposition.ENGINE_REQUESTS].samples} == {"interactive"}


def test_the_gateways_series_carry_the_names_and_labels_the_controller_and_status_read():
    metrics = GatewayMetrics(otlp=False)
    metrics.disagg_threshold = lambda: 512
    try:
        timer = metrics.stream("interactive", time.monotonic())
        timer.chunk(b"data: {}")
        timer.chunk(b"data: {}")
        f = families(metrics.prometheus_text())
    finally:
        metrics.shutdown()
    for name in (exposition.TTFT_METRIC, exposition.ITL_METRIC, status.THRESHOLD_METRIC):
        assert name in f, name
    ttft = [s for s in f[exposition.TTFT_METRIC].samples if s.name.endswith("_count")]
    assert ttft and ttft[0].labels[exposition.CLASS_LABEL] == "interactive"
    assert f[status.THRESHOLD_METRIC].samples[0].value == 512


def test_prometheus_names_follow_the_exporters_rules():
    assert names.Metric("a.b.c", "s").prometheus == "a_b_c_seconds"
    assert names.Metric("a.b", "{request}").prometheus == "a_b"
    assert names.Metric("a.b", "By").prometheus == "a_b_bytes"
    assert names.label("cadenza.request.class") == "cadenza_request_class"
