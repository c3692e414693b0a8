"""Reading gauges out of scraped ``/metrics`` texts: the gateways' disaggregation threshold as the
operator's status reports it."""

from __future__ import annotations

from cadenza.control.exposition import gauge_values
from cadenza.gateway.metrics import GatewayMetrics
from cadenza.operator.status import THRESHOLD_METRIC, disaggregation_status


def gateway_text(threshold: int | None) -> str:
    metrics = GatewayMetrics(otlp=False)
    metrics.disagg_threshold = lambda: threshold
    try:
        return metrics.prometheus_text().decode()
    finally:
        metrics.shutdown()


def test_a_gauge_is_read_from_every_text_that_has_it_and_a_broken_text_is_skipped():
    texts = [gateway_text(512), "not { exposition", gateway_text(640), "# TYPE other gauge\nother 3\n"]
    assert gauge_values(texts, THRESHOLD_METRIC) == [512.0, 640.0]
    assert gauge_values(texts, "other") == [3.0]
    assert gauge_values(texts, "missing") == []


def test_a_gauge_named_as_the_prefix_of_another_is_not_confused_with_it():
    text = "# TYPE a gauge\na 1\n# TYPE a_b gauge\na_b 2\n"
    assert gauge_values([text], "a") == [1.0] and gauge_values([text], "a_b") == [2.0]


def test_the_disaggregation_status_reports_the_highest_threshold_the_gateways_computed():
    scraped = {"gw-0": gateway_text(512), "gw-1": gateway_text(640), "engine-0": "# TYPE x gauge\nx 1\n"}
    assert disaggregation_status(None, scraped)["minPromptTokens"] == 640
    assert disaggregation_status(None, scraped)["source"] == "computed"
    assert disaggregation_status(None, {"engine-0": "x 1\n"})["source"] == "unknown"
    assert disaggregation_status(None, None)["source"] == "unknown"
    assert disaggregation_status(300, scraped) == {"minPromptTokens": 300, "source": "pinned",
                                                    "message": "spec.disaggregated.minPromptTokens"}
