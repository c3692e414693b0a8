"""OpenTelemetry traces and metrics for every request and every engine step.

Follows the OpenTelemetry GenAI semantic conventions (spans, attributes, and the
``gen_ai.server.*`` / ``gen_ai.client.token.usage`` histograms with the spec's bucket boundaries);
cadenza's own engine signals live under ``cadenza.*``. Uses the OpenTelemetry SDK and its
exporters only:

- **OTLP/HTTP** for traces and metrics, configured by the standard ``OTEL_EXPORTER_OTLP_*``
  variables, ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``. Exporting starts when an OTLP
  endpoint is configured (or ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` say ``otlp``);
  failures are logged by the SDK's background exporters, never raised, and never block serving.
- **Prometheus** text at ``GET /metrics`` (the SDK's Prometheus reader, on a private registry).

Where the work happens — all of it in the front end, on the event loop, never in the engine core:
a request's span is opened by the HTTP handler (parented from the incoming W3C ``traceparent``);
each step's :class:`~cadenza.node.core.messages.StepRecord` from the core adds the prefill-chunk
and preemption events and the per-step metrics (:meth:`Telemetry.on_step`); per-token metrics
(TTFT, ITL, TPOT) are recorded as outputs are dispatched (:meth:`Telemetry.on_output`). Gauges and
counters of the scheduler are read at collection time from the typed
:class:`~cadenza.node.core.stats.EngineStats` the core last published.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, generate_latest

from cadenza.node import metric_names as names
from cadenza.node.core.messages import StepRecord
from cadenza.node.core.request import choice_request_id
from cadenza.node.core.stats import EngineStats
from cadenza.node.frontend.output_processor import RequestOutput
from cadenza.node.frontend.step_log import StepLog
from cadenza.node.otel import make_resource, otlp_enabled

PROVIDER = "cadenza"
# Bucket boundaries from the GenAI semantic conventions (metrics spec), seconds or tokens.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
# Predicted step time is compared with ITL targets: geometric x1.25 from 1 ms to ~30 s, so a p99
# is within ~12 % anywhere (the TTFT buckets step 0.25 -> 0.5 -> 0.75 s).
STEP_BUCKETS = [round(0.001 * 1.25 ** i, 6) for i in range(47)]
TOKEN_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864]
STEP_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_propagator = TraceContextTextMapPropagator()


@dataclass(slots=True)
class _Tracked:
    """One request in flight: its span and the times per-request metrics need."""

    span: Span | None
    wall_start_ns: int
    mono_start: float
    attrs: dict
    traffic_class: str
    first: float | None = None  # the call's first token, of any choice (TTFT)
    extra: dict = field(default_factory=dict)
    class_attrs: dict = field(default_factory=dict)  # {names.REQUEST_CLASS: ...}, built once
    n: int = 1  # choices (OpenAI ``n``); the call ends with the last
    firsts: dict = field(default_factory=dict)  # choice index -> its first token's time (TPOT)
    lasts: dict = field(default_factory=dict)  # choice index -> its last token's time (ITL)
    ended: dict = field(default_factory=dict)  # choice index -> its last RequestOutput

    def ns(self, mono: float) -> int:
        return self.wall_start_ns + int((mono - self.mono_start) * 1e9)



def _preemptions_by_reason(stats: EngineStats) -> list[tuple[dict, int]]:
    """Preemptions split by why: a decode or chunk lacked a KV block, or a higher class took the
    victim's slot or blocks at admission (the two add up to ``num_preemptions``)."""
    admission = stats.num_admission_preemptions
    return [({"cadenza.reason": "kv_growth"}, stats.num_preemptions - admission),
            ({"cadenza.reason": "admission"}, admission)]


def _prefill_tokens(stats: EngineStats) -> list[tuple[dict, int]]:
    return [({"cadenza.outcome": "admitted"}, stats.prefill_tokens_admitted),
            ({"cadenza.outcome": "deferred"}, stats.prefill_tokens_deferred)]


def _kv_transfer_bytes(stats: EngineStats) -> list[tuple[dict, int]]:
    return [({"cadenza.kv_transfer.direction": "sent"}, stats.kv_transfer_sent_bytes),
            ({"cadenza.kv_transfer.direction": "received"}, stats.kv_transfer_received_bytes)]


def _kv_transfer_failures(stats: EngineStats) -> list[tuple[dict, int]]:
    """Pulls made here that failed (``pull``, by TransferError kind) and pulls or handshakes
    served here that failed (``serve``, by the code sent: a refused peer counts as
    ``unauthorized``, ``incompatible``, ``busy`` or ``protocol``)."""
    return [({"cadenza.kv_transfer.side": side, "error.type": kind}, n)
            for side, failures in (("pull", stats.kv_transfer_pull_failures),
                                   ("serve", stats.kv_transfer_serve_failures))
            for kind, n in sorted(failures.items())]


class Telemetry:
    """Traces and metrics of one server (or one in-process engine).

    Args:
        model_name: ``gen_ai.request.model`` / ``gen_ai.response.model``.
        stats: returns the engine's latest published :class:`EngineStats` (gauges read them at
            collection; before the engine has published any, nothing is observed).
        otlp: export over OTLP/HTTP; None decides from the ``OTEL_*`` environment.
        step_log: also writes every step's composition and seconds there (closed at shutdown).
    """

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None] = lambda: None,
                 otlp: bool | None = None, step_log: StepLog | None = None) -> None:
        self.model_name = model_name
        self._stats = stats
        self.step_log = step_log
        resource = make_resource()
        self.tracer_provider = TracerProvider(resource=resource)
        if otlp if otlp is not None else otlp_enabled("traces"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.tracer = self.tracer_provider.get_tracer("cadenza.node")
        self.registry = CollectorRegistry()
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        readers = [PrometheusMetricReader(registry=self.registry)]
        if otlp if otlp is not None else otlp_enabled("metrics"):
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        self.meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        self._instruments(self.meter_provider.get_meter("cadenza.node"))
        self._tracked: dict[str, _Tracked] = {}
        self._choices: dict[str, tuple[str, int]] = {}  # a choice's engine id -> (call id, index), n > 1

    # -- instruments ----------------------------------------------------------------------------

    def _instruments(self, m) -> None:
        h = m.create_histogram
        self.ttft = h("gen_ai.server.time_to_first_token", "s", "Time to generate the first token",
                      explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.tpot = h("gen_ai.server.time_per_output_token", "s", "Time per output token after the first",
                      explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self.duration = h("gen_ai.server.request.duration", "s", "Generative AI server request duration",
                          explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.token_usage = h(names.TOKEN_USAGE.name, names.TOKEN_USAGE.unit, "Input and output tokens used",
                             explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)
        self.itl = h("cadenza.request.inter_token_latency", "s", "Every gap between consecutive output tokens",
                     explicit_bucket_boundaries_advisory=TPOT_BUCKETS)
        self.queue_delay = h("cadenza.request.queue_delay", "s", "Time waiting to be scheduled, by phase",
                             explicit_bucket_boundaries_advisory=DURATION_BUCKETS)
        self.step_duration = h("cadenza.step.duration", "s", "Model time of one engine step",
                               explicit_bucket_boundaries_advisory=TTFT_BUCKETS)
        self.step_predicted = h(names.STEP_PREDICTED_DURATION.name, names.STEP_PREDICTED_DURATION.unit,
                                "The cost model's model time of each step, predicted when it was scheduled",
                                explicit_bucket_boundaries_advisory=STEP_BUCKETS)
        self.step_tokens = h(names.STEP_TOKENS.name, names.STEP_TOKENS.unit, "Tokens computed in one step, by kind",
                             explicit_bucket_boundaries_advisory=STEP_TOKEN_BUCKETS)
        counters = {
            "cadenza.scheduler.prefill_tokens": ("{token}", "Prefill tokens admitted to steps or deferred",
                                                 _prefill_tokens),
            "cadenza.scheduler.decode_steps_delayed": ("{step}", "Decodes that could not run in a step", None),
            "cadenza.scheduler.preemptions": ("{preemption}", "Requests preempted by recompute, by reason",
                                              _preemptions_by_reason),
            "cadenza.scheduler.recomputed_tokens": ("{token}", "Computed tokens dropped by preemption",
                                                    "num_recomputed_tokens"),
            "cadenza.scheduler.allocation_failures": ("{failure}", "KV block allocations that failed", None),
            "cadenza.requests.cancelled_before_first_token": ("{request}", "Requests cancelled before a token",
                                                              "num_cancelled_before_first_token"),
            "cadenza.prefix_cache.hit_tokens": ("{token}", "Prompt tokens served from the prefix cache",
                                                "prefix_cache_hit_tokens"),
            "cadenza.prefix_cache.queried_tokens": ("{token}", "Prompt tokens looked up in the prefix cache",
                                                    "prefix_cache_queried_tokens"),
            "cadenza.kv_transfer.loads": ("{request}", "Prompts whose KV was pulled from a prefill replica",
                                          "remote_kv_loads"),
            names.KV_TRANSFER_LOADED_TOKENS.name: ("{token}", "Prompt tokens whose KV arrived verified",
                                                   "remote_kv_tokens"),
            "cadenza.kv_transfer.failed_loads": ("{request}", "Pulls that failed from some block on",
                                                 "remote_kv_failed_loads"),
            names.KV_TRANSFER_RECOMPUTED_TOKENS.name: ("{token}", "Tokens of failed pulls computed here instead",
                                                       "remote_kv_recomputed_tokens"),
            "cadenza.kv_transfer.released_holds": ("{request}", "Prompts queued here past the maximum hold: "
                                                   "their source released, computed here", "remote_kv_released_holds"),
            "cadenza.kv_transfer.published": ("{request}", "Prompts whose KV was held for a decode replica",
                                              "kv_transfer_published"),
            "cadenza.kv_transfer.bytes": ("By", "KV bytes moved, by direction", _kv_transfer_bytes),
            "cadenza.kv_transfer.failures": ("{failure}", "KV transfers that failed, by side and kind",
                                             _kv_transfer_failures),
            "cadenza.kv_transfer.expired_leases": ("{lease}", "Published KV freed because no decode replica "
                                                   "took it in time", "kv_transfer_expired"),
        }
        for name, (unit, description, source) in counters.items():
            key = source or name.rsplit(".", 1)[-1]
            m.create_observable_counter(name, [self._reader(key)], unit, description)
        m.create_observable_gauge(names.KV_BLOCKS.name, [self._kv_blocks], names.KV_BLOCKS.unit, "KV blocks by state")
        m.create_observable_counter(names.REQUESTS_PREEMPTED.name, [self._preempted_by_class], names.REQUESTS_PREEMPTED.unit,
                                    "Requests preempted by recompute, by the victim's class")
        m.create_observable_gauge(names.REQUESTS.name, [self._requests], names.REQUESTS.unit, "Requests by class and state")
        m.create_observable_gauge("cadenza.cost_model.error", [self._cost_model_error], "1",
                                  "Mean relative error of the step-time cost model")
        m.create_observable_gauge("cadenza.kv_transfer.bandwidth", [self._optional("kv_transfer_bandwidth")],
                                  "By/s", "Bandwidth this replica's KV pulls measured")
        m.create_observable_gauge(names.KV_TRANSFER_MIN_PROMPT_TOKENS.name,
                                  [self._optional("kv_transfer_min_prompt_tokens")], names.KV_TRANSFER_MIN_PROMPT_TOKENS.unit,
                                  "The shortest prompt this replica computes worth prefilling elsewhere")

    def _reader(self, key) -> Callable[[CallbackOptions], list[Observation]]:
        def read(_options: CallbackOptions) -> list[Observation]:
            stats = self._stats()
            if stats is None:
                return []
            if callable(key):
                return [Observation(value, attrs) for attrs, value in key(stats)]
            return [Observation(getattr(stats, key))]

        return read

    def _kv_blocks(self, _options: CallbackOptions) -> list[Observation]:
        stats = self._stats()
        if stats is None:
            return []
        return [Observation(getattr(stats, f"kv_blocks_{state}"), {"cadenza.kv.state": state})
                for state in ("used", "reserved", "cached", "free")]

    def _requests(self, _options: CallbackOptions) -> list[Observation]:
        stats = self._stats()
        out = []
        for cls, info in (stats.classes if stats is not None else {}).items():
            for state in ("running", "waiting"):
                out.append(Observation(getattr(info, state), {names.REQUEST_CLASS: cls,
                                                              "cadenza.request.state": state}))
        return out

    def _preempted_by_class(self, _options: CallbackOptions) -> list[Observation]:
        stats = self._stats()
        return [Observation(info.preemptions, {names.REQUEST_CLASS: cls})
                for cls, info in (stats.classes if stats is not None else {}).items()]

    def _optional(self, key: str) -> Callable[[CallbackOptions], list[Observation]]:
        """A gauge of an EngineStats figure that may be None (then nothing is observed)."""
        def read(_options: CallbackOptions) -> list[Observation]:
            stats = self._stats()
            value = None if stats is None else getattr(stats, key)
            return [] if value is None else [Observation(value)]

        return read

    def _cost_model_error(self, _options: CallbackOptions) -> list[Observation]:
        stats = self._stats()
        return [] if stats is None or stats.cost_model_error is None else [Observation(stats.cost_model_error)]

    # -- requests (event loop thread) -------------------------------------------------------------

    def start_request(
        self, request_id: str, operation: str, headers: Mapping[str, str], *, max_tokens: int | None,
        temperature: float | None, top_p: float | None, traffic_class: str, tenant: str, arrival: float,
    ) -> None:
        """Open the request's SERVER span, parented from ``traceparent`` when the client sent one."""
        attrs = {"gen_ai.operation.name": operation, "gen_ai.provider.name": PROVIDER,
                 "gen_ai.request.model": self.model_name, names.REQUEST_CLASS: traffic_class}
        span_attrs = {**attrs, "cadenza.tenant": tenant, "gen_ai.response.id": request_id}
        for key, value in (("gen_ai.request.max_tokens", max_tokens), ("gen_ai.request.temperature", temperature),
                           ("gen_ai.request.top_p", top_p)):
            if value is not None:
                span_attrs[key] = value
        wall = time.time_ns() - int((time.monotonic() - arrival) * 1e9)
        span = self.tracer.start_span(f"{operation} {self.model_name}", context=_propagator.extract(headers),
                                      kind=SpanKind.SERVER, attributes=span_attrs, start_time=wall)
        span.add_event("queued", timestamp=wall)
        self._tracked[request_id] = _Tracked(span, wall, arrival, attrs, traffic_class,
                                             class_attrs={names.REQUEST_CLASS: traffic_class})

    def expect_choices(self, request_id: str, n: int) -> None:
        """``request_id`` runs ``n`` choices (OpenAI ``n``; outputs under
        :func:`~cadenza.node.core.request.choice_request_id` ids). The call stays one span and one
        request in the metrics: TTFT is its first token of any choice, ITL and TPOT are each
        choice's own, usage counts the prompt once and sums the choices' output, the span ends with
        the last choice, and ``gen_ai.response.finish_reasons`` lists each choice's reason."""
        t = self._tracked.get(request_id)
        if t is None:
            return
        t.n = n
        for index in range(1, n):
            self._choices[choice_request_id(request_id, index)] = (request_id, index)

    def on_output(self, out: RequestOutput) -> None:
        """Record TTFT, ITL, TPOT, duration and usage as a request's outputs arrive."""
        request_id, index = self._choices.get(out.request_id, (out.request_id, 0))
        t = self._tracked.get(request_id)
        if t is None:
            return
        if t.first is None:
            t.first = out.time
            self.ttft.record(out.time - t.mono_start, t.attrs)
            if t.span is not None:
                t.span.add_event("first_token", timestamp=t.ns(out.time))
        if index in t.lasts:
            self.itl.record(out.time - t.lasts[index], t.class_attrs)
        else:
            t.firsts[index] = out.time
        t.lasts[index] = out.time
        if out.finished:
            t.ended[index] = out
            attrs = {**t.attrs, "gen_ai.response.model": self.model_name}
            if out.num_output_tokens > 1:
                self.tpot.record((out.time - t.firsts[index]) / (out.num_output_tokens - 1), attrs)
            if len(t.ended) == t.n:
                self._finish(request_id, t, out.time)

    def _finish(self, request_id: str, t: _Tracked, now: float) -> None:
        del self._tracked[request_id]
        self._forget_choices(request_id, t)
        outs = [t.ended[i] for i in sorted(t.ended)]
        prompt, output = outs[0].num_prompt_tokens, sum(o.num_output_tokens for o in outs)
        reasons = [o.finish_reason for o in outs]
        attrs = {**t.attrs, "gen_ai.response.model": self.model_name}
        self.duration.record(now - t.mono_start, attrs)
        self.token_usage.record(prompt, {**attrs, names.TOKEN_TYPE: "input"})
        self.token_usage.record(output, {**attrs, names.TOKEN_TYPE: "output"})
        if t.span is not None:
            span = t.span
            span.set_attributes({
                "gen_ai.response.model": self.model_name,
                "gen_ai.response.finish_reasons": reasons,
                "gen_ai.usage.input_tokens": prompt,
                "gen_ai.usage.output_tokens": output,
                "gen_ai.usage.cache_read.input_tokens": outs[0].num_cached_tokens,
                "cadenza.time_to_first_token": (t.first or now) - t.mono_start,
                **t.extra,
            })
            span.add_event("finish", {"gen_ai.response.finish_reasons": reasons}, timestamp=t.ns(now))
            span.end(end_time=t.ns(now))

    def _forget_choices(self, request_id: str, t: _Tracked) -> None:
        for index in range(1, t.n):
            self._choices.pop(choice_request_id(request_id, index), None)

    def fail_request(self, request_id: str, error_type: str, message: str) -> None:
        """End a request that failed (status ERROR, ``error.type``) or was cancelled by its client."""
        t = self._tracked.pop(request_id, None)
        if t is None:
            return
        self._forget_choices(request_id, t)
        now = time.monotonic()
        self.duration.record(now - t.mono_start, {**t.attrs, "error.type": error_type})
        if t.span is not None:
            if error_type == "cancelled":
                t.span.set_attribute("gen_ai.response.finish_reasons", ["abort"])
                t.span.add_event("cancelled", timestamp=t.ns(now))
            else:
                t.span.set_attribute("error.type", error_type)
                t.span.set_status(Status(StatusCode.ERROR, message))
            t.span.set_attributes(t.extra)
            t.span.end(end_time=t.ns(now))

    # -- steps ----------------------------------------------------------------------------------

    def on_step(self, step: StepRecord, now: float) -> None:
        """Per-step metrics, and the span events of the requests in the step (``now``: when the
        step ended, ``time.monotonic()`` seconds)."""
        self.step_duration.record(step.seconds, {"cadenza.step.cuda_graph": step.cuda_graph})
        if self.step_log is not None:
            self.step_log.write(step)
        if step.predicted_seconds is not None:
            self.step_predicted.record(step.predicted_seconds)
        if step.num_prefill_tokens:
            self.step_tokens.record(step.num_prefill_tokens, {names.TOKEN_KIND: "prefill"})
        if step.num_decode_tokens:
            self.step_tokens.record(step.num_decode_tokens, {names.TOKEN_KIND: "decode"})
        tracked = self._tracked
        for request_id, cls, phase, waited in step.admitted:
            self.queue_delay.record(waited, {names.REQUEST_CLASS: cls, "cadenza.queue.phase": phase})
            t = tracked.get(request_id)
            if t is not None and phase == "admission":
                t.extra["cadenza.queue_time"] = waited
        choices = self._choices  # a sibling choice's chunks and preemptions go on its call's span
        for request_id, start, num_tokens in step.chunks:
            t = tracked.get(choices.get(request_id, (request_id,))[0])
            if t is not None and t.span is not None:
                t.span.add_event("prefill_chunk", {"cadenza.chunk.tokens": num_tokens,
                                                   "cadenza.chunk.position": start}, timestamp=t.ns(now))
        for request_id, times in step.preempted:
            t = tracked.get(choices.get(request_id, (request_id,))[0])
            if t is not None and t.span is not None:
                t.span.add_event("preempted", {"cadenza.preemptions": times}, timestamp=t.ns(now))
        for request_id, loaded, left in step.kv_loads:  # ended before this step, which runs the request
            t = tracked.get(request_id)
            if t is not None and t.span is not None:
                t.span.add_event("kv_transfer.loaded", {"cadenza.kv_transfer.loaded_tokens": loaded,
                                                        "cadenza.kv_transfer.computed_tokens": left},
                                 timestamp=t.ns(now - step.seconds))

    # -- export ---------------------------------------------------------------------------------

    def prometheus_text(self) -> bytes:
        """The current metrics in the Prometheus text format."""
        return generate_latest(self.registry)

    def force_flush(self) -> None:
        self.tracer_provider.force_flush()
        self.meter_provider.force_flush()

    def shutdown(self) -> None:
        """Flush and stop the exporters (requests still open are ended as cancelled)."""
        for request_id in list(self._tracked):
            self.fail_request(request_id, "cancelled", "server shutting down")
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
        if self.step_log is not None:
            self.step_log.close()
