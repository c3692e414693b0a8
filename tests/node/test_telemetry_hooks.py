"""The telemetry hooks driven by hand: a request's span events and the counters read from the stats.

The front end calls :meth:`Telemetry.on_step` with every step's record from the engine core and
:meth:`Telemetry.on_output` for every token; here both are fed hand-made steps and outputs, so a
preemption (which takes a starved KV pool and hundreds of steps to cause in a real server) is one
line. That the engine calls the hook with its steps is checked end to end in
``tests/node/server/test_telemetry.py``, and that the scheduler reports its victims in
``SchedulerOutput.preempted`` in ``tests/node/test_scheduler.py``.
"""

from __future__ import annotations

import json

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from cadenza.node.core.messages import StepRecord
from cadenza.node.core.request import Request, SamplingParams, choice_request_id
from cadenza.node.core.stats import EngineStats
from cadenza.node.frontend.output_processor import RequestOutput
from cadenza.node.frontend.telemetry import Telemetry

ARRIVAL = 100.0  # time.monotonic() seconds of the request's arrival, as the server would pass it


def telemetry_with_spans(stats=lambda: None) -> tuple[Telemetry, InMemorySpanExporter]:
    telemetry = Telemetry("tiny", stats=stats, otlp=False)
    spans = InMemorySpanExporter()
    telemetry.tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    return telemetry, spans


def start(telemetry: Telemetry, request_id: str = "cmpl-1") -> Request:
    telemetry.start_request(request_id, "text_completion", {}, max_tokens=4, temperature=0.0, top_p=None,
                            traffic_class="batch", tenant="acme", arrival=ARRIVAL)
    return Request(request_id, [7] * 20, SamplingParams(max_tokens=4), traffic_class="batch", tenant="acme")


def output(req: Request, at: float, n: int, finish_reason: str | None = None) -> RequestOutput:
    return RequestOutput(req.request_id, [5], "x", finish_reason, req.num_prompt_tokens, n, 0, at)


def test_a_preemption_is_an_event_on_the_victims_span_at_the_step_that_preempted_it():
    telemetry, spans = telemetry_with_spans()
    req = start(telemetry)
    rid = req.request_id
    telemetry.on_step(StepRecord(0.01, None, 16, 0, chunks=[(rid, 0, 16)]), ARRIVAL + 0.1)
    telemetry.on_step(StepRecord(0.01, None, 0, 0, preempted=[(rid, 1)]), ARRIVAL + 0.2)
    telemetry.on_step(StepRecord(0.01, None, 20, 0, chunks=[(rid, 0, 20)]), ARRIVAL + 0.3)
    telemetry.on_output(output(req, ARRIVAL + 0.3, 1))
    telemetry.on_output(output(req, ARRIVAL + 0.4, 2, "length"))

    (span,) = spans.get_finished_spans()
    assert [e.name for e in span.events] == ["queued", "prefill_chunk", "preempted", "prefill_chunk", "first_token",
                                             "finish"]
    preempted = span.events[2]
    assert dict(preempted.attributes) == {"cadenza.preemptions": 1}
    assert preempted.timestamp - span.events[0].timestamp == round(0.2 * 1e9)  # on the request's own clock
    assert span.events[3].attributes["cadenza.chunk.position"] == 0  # recomputed from the start


def test_a_second_preemption_carries_the_running_count():
    telemetry, spans = telemetry_with_spans()
    req = start(telemetry)
    for n in (1, 2):
        telemetry.on_step(StepRecord(0.01, None, 0, 0, preempted=[(req.request_id, n)]), ARRIVAL + n)
    telemetry.fail_request(req.request_id, "cancelled", "the client went away")
    (span,) = spans.get_finished_spans()
    assert [e.attributes["cadenza.preemptions"] for e in span.events if e.name == "preempted"] == [1, 2]


def test_preempting_a_request_the_server_does_not_trace_is_ignored():
    telemetry, spans = telemetry_with_spans()
    traced = start(telemetry, "traced")
    telemetry.on_step(StepRecord(0.01, None, 0, 0, preempted=[("offline", 1)]), ARRIVAL + 1)  # no span
    telemetry.on_output(output(traced, ARRIVAL + 2, 1, "length"))
    (span,) = spans.get_finished_spans()
    assert "preempted" not in [e.name for e in span.events]


def test_preemptions_are_counted_by_reason_from_the_engine_counters():
    stats = EngineStats(num_preemptions=5, num_admission_preemptions=2, num_recomputed_tokens=70)
    telemetry, _ = telemetry_with_spans(stats=lambda: stats)
    families = {f.name: f for f in text_string_to_metric_families(telemetry.prometheus_text().decode())}
    by_reason = {s.labels["cadenza_reason"]: s.value for s in families["cadenza_scheduler_preemptions"].samples
                 if s.name.endswith("_total")}
    assert by_reason == {"kv_growth": 3, "admission": 2}
    (recomputed,) = [s.value for s in families["cadenza_scheduler_recomputed_tokens"].samples
                     if s.name.endswith("_total")]
    assert recomputed == 70


def test_the_step_log_gets_every_steps_composition_and_seconds(tmp_path):
    from cadenza.node.frontend.step_log import STEP_LOG_FIELDS, StepLog

    path = tmp_path / "logs" / "steps.jsonl"
    telemetry = Telemetry("tiny", otlp=False, step_log=StepLog(path))
    telemetry.on_step(StepRecord(0.02, None, 64, 3, decode_context_tokens=900, prefill_attention_tokens=2048.0,
                                 num_rows=4, num_sampled=3, host_seconds=0.0002), ARRIVAL)
    telemetry.on_step(StepRecord(0.01, None, 0, 3, decode_context_tokens=903, num_rows=3, num_sampled=3), ARRIVAL)
    telemetry.shutdown()  # flushes and closes the log
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [tuple(line) for line in lines] == [STEP_LOG_FIELDS] * 2
    assert lines[0] == {"prefill_tokens": 64, "decode_tokens": 3, "decode_context_tokens": 900,
                        "prefill_attention_tokens": 2048.0, "num_rows": 4, "num_sampled": 3, "seconds": 0.02,
                        "host_seconds": 0.0002}


def test_a_remote_kv_load_is_an_event_on_the_span_when_the_step_that_runs_the_request_begins():
    telemetry, spans = telemetry_with_spans()
    req = start(telemetry)
    rid = req.request_id
    telemetry.on_step(StepRecord(0.01, None, 0, 1, kv_loads=[(rid, 16, 4)]), ARRIVAL + 0.2)
    telemetry.on_step(StepRecord(0.01, None, 4, 0, chunks=[(rid, 16, 4)]), ARRIVAL + 0.3)
    telemetry.on_output(output(req, ARRIVAL + 0.3, 1, "length"))
    (span,) = spans.get_finished_spans()
    assert [e.name for e in span.events] == ["queued", "kv_transfer.loaded", "prefill_chunk", "first_token", "finish"]
    loaded = span.events[1]
    assert dict(loaded.attributes) == {"cadenza.kv_transfer.loaded_tokens": 16, "cadenza.kv_transfer.computed_tokens": 4}
    assert loaded.timestamp - span.events[0].timestamp == pytest.approx(0.19e9, abs=100)  # when the step began


def test_a_call_of_n_choices_is_one_span_ended_by_its_last_choice_with_summed_usage():
    telemetry, spans = telemetry_with_spans()
    call = start(telemetry, "chatcmpl-3")
    telemetry.expect_choices(call.request_id, 3)
    choices = [call, *(Request(choice_request_id(call.request_id, i), [7] * 20, SamplingParams())
                       for i in (1, 2))]
    for req in choices:  # one step: every choice's first token
        telemetry.on_output(output(req, ARRIVAL + 0.5, 1))
    telemetry.on_output(output(choices[1], ARRIVAL + 0.6, 2, "stop"))
    telemetry.on_output(output(choices[0], ARRIVAL + 0.7, 2))
    telemetry.on_output(output(choices[2], ARRIVAL + 0.7, 2, "length"))
    assert not spans.get_finished_spans()  # choice 0 is still running
    telemetry.on_output(output(choices[0], ARRIVAL + 0.9, 3, "stop"))

    (span,) = spans.get_finished_spans()
    assert span.attributes["gen_ai.response.finish_reasons"] == ("stop", "stop", "length")
    assert span.attributes["gen_ai.usage.input_tokens"] == 20
    assert span.attributes["gen_ai.usage.output_tokens"] == 3 + 2 + 2
    assert [e.name for e in span.events].count("first_token") == 1
    assert span.end_time - span.events[0].timestamp == round(0.9 * 1e9)
    families = {f.name: f for f in text_string_to_metric_families(telemetry.prometheus_text().decode())}
    usage = {s.labels["gen_ai_token_type"]: s.value for s in families["gen_ai_client_token_usage"].samples
             if s.name.endswith("_sum")}
    assert usage == {"input": 20, "output": 7}
    itl = {s.name.rsplit("_", 1)[1]: s.value for s in families["cadenza_request_inter_token_latency_seconds"].samples
           if s.name.endswith(("_count", "_sum"))}
    assert itl["count"] == 4 and itl["sum"] == pytest.approx(0.1 + 0.2 + 0.2 + 0.2)  # each choice's own gaps
    assert not telemetry._tracked and not telemetry._choices
