"""Client-side latency per traffic class, as the gateway sees it: the SLO controller's signal.

Two OpenTelemetry histograms, exported like the engines' (Prometheus text at the gateway's
``GET /metrics``; OTLP/HTTP when the standard ``OTEL_*`` variables say so):

- ``cadenza.gateway.time_to_first_token`` (s): from the request reaching the gateway to the first
  body chunk of a streamed (``text/event-stream``) 200 answer — a replica starts its stream with
  its first token;
- ``cadenza.gateway.inter_token_latency`` (s): every gap between consecutive body chunks of that
  stream (the closing ``data: [DONE]`` excluded).

Both carry ``cadenza.traffic_class``. Answers that are not streamed have no TTFT or ITL to
measure and are not recorded. A counter, ``cadenza.gateway.disagg.requests``, counts the requests
the selective rule sent through a prefill replica, by ``cadenza.disagg.outcome``: ``prefilled``
(a prefill replica queued it and answered with its KV source), ``fallback_busy`` (no prefill
replica free, or each one tried answered 429: prefilled where it decodes), ``fallback_failed``
(its call failed; the decode replica prefilled), ``fallback_refused`` (the prefill replica
refused the request itself, a 4xx other than 429: the decode replica gives the client the same
answer) or ``kept_queued`` (long enough for an idle prefill replica, not after the chosen one's
queue: prefilled where it decodes). One request counts once, whichever replicas it tried.
A gauge, ``cadenza.gateway.disagg.min_prompt_tokens``, is the threshold the rule applies with an
idle prefill replica (pinned or computed from the decode replicas' rules; absent while there is
none).

Every family is listed from the first scrape on: until it has a sample, ``/metrics`` gives its
``# HELP`` and ``# TYPE`` lines alone (:data:`FAMILIES`), as a Prometheus client does for a
labelled metric no label value has been used with — a scraper sees what this gateway exports,
not an empty answer. (OpenTelemetry's Prometheus reader leaves out instruments without data.)

Bucket boundaries (:func:`latency_buckets`): the GenAI semantic conventions' TTFT buckets step
0.25 -> 0.5 -> 0.75 s, too coarse to tell a 300 ms p99 from a 450 ms one. These are geometric
(x 1.5) from 1 ms to 120 s, plus, around each SLO target t of the pool, t x 0.5 ... 2.0 in steps
of 5 %: a p99 interpolated inside a 5 % bucket is within 5 % of the truth near the target.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from prometheus_client import CollectorRegistry, generate_latest

from cadenza.node import metric_names as names
from cadenza.node.core.policy import CLASSES
from cadenza.node.otel import make_resource, otlp_enabled

CLASS_ATTRIBUTE = names.TRAFFIC_CLASS
DONE = b"data: [DONE]"
TTFT_HELP = "Client-side time to the first streamed token, by traffic class"
ITL_HELP = "Client-side gaps between streamed chunks, by traffic class"
DISAGG_HELP = "Requests sent through a prefill replica, by outcome"
THRESHOLD_HELP = "The shortest prompt sent through an idle prefill replica"
# Each family as the Prometheus exposition names it: (name, type, help).
FAMILIES = (
    (names.GATEWAY_TTFT.prometheus, "histogram", TTFT_HELP),
    (names.GATEWAY_ITL.prometheus, "histogram", ITL_HELP),
    ("cadenza_gateway_disagg_requests_total", "counter", DISAGG_HELP),
    (names.GATEWAY_DISAGG_MIN_PROMPT_TOKENS.prometheus, "gauge", THRESHOLD_HELP),
)


def latency_buckets(targets_s: list[float] | tuple[float, ...] = ()) -> list[float]:
    """Histogram boundaries in seconds: coarse everywhere, dense (5 %) within 0.5-2x of each target.

    Raises:
        ValueError: a target that is not a positive number.
    """
    bounds = set()
    b = 0.001
    while b <= 120:
        bounds.add(round(b, 6))
        b *= 1.5
    for t in targets_s:
        if not t > 0:
            raise ValueError(f"an SLO target must be positive, got {t!r}")
        bounds.update(round(t * (0.5 + 0.05 * i), 6) for i in range(31))
    return sorted(bounds)


class GatewayMetrics:
    """The gateway's latency histograms on a private Prometheus registry.

    Args:
        slo_targets_s: SLO targets (seconds) to place dense buckets around (TTFT and ITL alike).
        otlp: export over OTLP/HTTP too; None decides from the ``OTEL_*`` environment.
    """

    def __init__(self, slo_targets_s: list[float] | tuple[float, ...] = (), otlp: bool | None = None) -> None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        self.registry = CollectorRegistry()
        readers = [PrometheusMetricReader(registry=self.registry)]
        if otlp if otlp is not None else otlp_enabled("metrics"):
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        self.provider = MeterProvider(resource=make_resource(), metric_readers=readers)
        meter = self.provider.get_meter("cadenza.gateway")
        buckets = latency_buckets(slo_targets_s)
        self.ttft = meter.create_histogram(names.GATEWAY_TTFT.name, names.GATEWAY_TTFT.unit, TTFT_HELP,
                                           explicit_bucket_boundaries_advisory=buckets)
        self.itl = meter.create_histogram(names.GATEWAY_ITL.name, names.GATEWAY_ITL.unit, ITL_HELP,
                                          explicit_bucket_boundaries_advisory=buckets)
        self._attrs = {c: {CLASS_ATTRIBUTE: c} for c in CLASSES}
        self._disagg = meter.create_counter("cadenza.gateway.disagg.requests", "{request}", DISAGG_HELP)
        self.disagg_outcomes: Counter = Counter()
        self.disagg_threshold: Callable[[], int | None] = lambda: None  # set by the app
        meter.create_observable_gauge(
            names.GATEWAY_DISAGG_MIN_PROMPT_TOKENS.name, [self._threshold], names.GATEWAY_DISAGG_MIN_PROMPT_TOKENS.unit,
            THRESHOLD_HELP)

    def _threshold(self, _options: CallbackOptions) -> list[Observation]:
        least = self.disagg_threshold()
        return [] if least is None else [Observation(least)]

    def count_disagg(self, outcome: str) -> None:
        """One request the selective rule sent to a prefill replica: how it went."""
        self.disagg_outcomes[outcome] += 1
        self._disagg.add(1, {"cadenza.disagg.outcome": outcome})

    def stream(self, traffic_class: str, started: float) -> StreamTimer:
        """A timer for one streamed answer; ``started`` is ``time.monotonic()`` at its arrival."""
        return StreamTimer(self, self._attrs.get(traffic_class, {CLASS_ATTRIBUTE: traffic_class}), started)

    def prometheus_text(self) -> bytes:
        """Prometheus text: the families with samples, then the others' HELP and TYPE lines."""
        text = generate_latest(self.registry)
        empty = [(name, kind, help_) for name, kind, help_ in FAMILIES if f"# TYPE {name} ".encode() not in text]
        return text + "".join(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n" for name, kind, help_ in empty).encode()

    def shutdown(self) -> None:
        self.provider.shutdown()


class StreamTimer:
    """Records the TTFT at the first chunk and a gap at each later one (not at ``[DONE]``)."""

    __slots__ = ("_metrics", "_attrs", "_last", "_first")

    def __init__(self, metrics: GatewayMetrics, attrs: dict, started: float) -> None:
        self._metrics, self._attrs, self._last = metrics, attrs, started
        self._first = True

    def chunk(self, data: bytes) -> None:
        now = time.monotonic()
        if self._first:
            self._first = False
            self._metrics.ttft.record(now - self._last, self._attrs)
        elif not data.startswith(DONE):
            self._metrics.itl.record(now - self._last, self._attrs)
        self._last = now
