"""The metrics one side of cadenza emits and another reads: one owner for the names.

The engines (:mod:`cadenza.node.frontend.telemetry`) and the gateway
(:mod:`cadenza.gateway.metrics`) emit these through the OpenTelemetry SDK; the SLO controller
(:mod:`cadenza.control.signals`) and the operator's status (:mod:`cadenza.operator.status`) read
them back from Prometheus. Each is named here once, by its OpenTelemetry name and unit, and
:attr:`Metric.prometheus` is the name the SDK's Prometheus exporter gives it (OpenTelemetry's
"Prometheus and OpenMetrics compatibility" rules: dots become underscores, a unit becomes a suffix,
an annotation unit such as ``{request}`` none; a counter's samples add ``_total``).
``tests/node/test_metric_names.py`` holds the exporters to these names. No dependencies.
"""

from __future__ import annotations

from typing import NamedTuple

_UNIT_SUFFIX = {"s": "_seconds", "By": "_bytes", "1": "_ratio"}


class Metric(NamedTuple):
    """One instrument: its OpenTelemetry ``name`` and ``unit`` (UCUM, as the SDK takes them)."""

    name: str
    unit: str

    @property
    def prometheus(self) -> str:
        """The family name in a Prometheus scrape (without a counter's ``_total``)."""
        suffix = "" if self.unit.startswith("{") else _UNIT_SUFFIX.get(self.unit, "")
        return label(self.name) + suffix


def label(attribute: str) -> str:
    """An attribute's (or a name's) Prometheus spelling: ``cadenza.request.class`` ->
    ``cadenza_request_class``."""
    return attribute.replace(".", "_")


# The engines' series.
REQUESTS = Metric("cadenza.requests", "{request}")  # gauge by REQUEST_CLASS and cadenza.request.state
KV_BLOCKS = Metric("cadenza.kv.blocks", "{block}")  # gauge by cadenza.kv.state: used, reserved, cached, free
REQUESTS_PREEMPTED = Metric("cadenza.requests.preempted", "{request}")  # counter by REQUEST_CLASS
STEP_PREDICTED_DURATION = Metric("cadenza.step.predicted_duration", "s")  # histogram
REQUEST_CLASS = "cadenza.request.class"
STEP_TOKENS = Metric("cadenza.step.tokens", "{token}")  # histogram by TOKEN_KIND: prefill, decode
TOKEN_KIND = "cadenza.token.kind"
TOKEN_USAGE = Metric("gen_ai.client.token.usage", "{token}")  # histogram by TOKEN_TYPE: input, output
TOKEN_TYPE = "gen_ai.token.type"
KV_TRANSFER_LOADED_TOKENS = Metric("cadenza.kv_transfer.loaded_tokens", "{token}")  # counter
KV_TRANSFER_RECOMPUTED_TOKENS = Metric("cadenza.kv_transfer.recomputed_tokens", "{token}")  # counter
KV_TRANSFER_MIN_PROMPT_TOKENS = Metric("cadenza.kv_transfer.min_prompt_tokens", "{token}")  # gauge

# The gateway's series.
GATEWAY_TTFT = Metric("cadenza.gateway.time_to_first_token", "s")  # histogram by TRAFFIC_CLASS
GATEWAY_ITL = Metric("cadenza.gateway.inter_token_latency", "s")  # histogram by TRAFFIC_CLASS
GATEWAY_DISAGG_MIN_PROMPT_TOKENS = Metric("cadenza.gateway.disagg.min_prompt_tokens", "{token}")  # gauge
TRAFFIC_CLASS = "cadenza.traffic_class"
