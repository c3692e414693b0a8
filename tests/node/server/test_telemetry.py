"""Traces and metrics: a real OTLP/HTTP receiver, Prometheus text, and a collector that is down."""

from __future__ import annotations

import asyncio
import json
import secrets

import pytest
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as ProtoStatus
from prometheus_client.parser import text_string_to_metric_families

from cadenza.node.core.config import CacheConfig, EngineConfig, SchedulerConfig
from cadenza.node.core.policy import Policy
from cadenza.node.server.app import create_app
from cadenza.node.server.app_keys import ENGINE, TELEMETRY
from server_process import free_port
from waiting import until

MODEL = "tiny"


class Receiver:
    """An OTLP/HTTP collector stand-in: decodes what the SDK's exporters POST.

    While ``gate`` is clear, trace exports are held unanswered (a collector that hangs);
    ``held_exports`` counts those waiting.
    """

    def __init__(self) -> None:
        self.spans: list[tuple[dict, ProtoSpan]] = []  # (resource attributes, span)
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.held_exports = 0

    async def traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if not self.gate.is_set():
            self.held_exports += 1
            try:
                await self.gate.wait()
            finally:
                self.held_exports -= 1
        msg = ExportTraceServiceRequest.FromString(body)
        for rs in msg.resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                self.spans += [(resource, span) for span in ss.spans]
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def metrics_(self, request: web.Request) -> web.Response:
        self.metrics.append(ExportMetricsServiceRequest.FromString(await request.read()))
        return web.Response(body=b"", content_type="application/x-protobuf")


@pytest.fixture
async def receiver(aiohttp_server, monkeypatch):
    rx = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", rx.traces)
    app.router.add_post("/v1/metrics", rx.metrics_)
    server = await aiohttp_server(app)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "cadenza-test")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment.name=test")
    monkeypatch.setenv("CADENZA_POOL", "pool-a")
    monkeypatch.setenv("CADENZA_REPLICA", "pool-a-0")
    return rx


def make_client(aiohttp_client, tiny_llama_dir, num_kv_blocks=64, **policy):
    config = EngineConfig(
        model=str(tiny_llama_dir), served_model_name=MODEL,
        scheduler=SchedulerConfig(token_budget=32, chunk_size=8, max_model_len=256, policy=Policy(**policy)),
        cache=CacheConfig(block_size=16, num_kv_blocks=num_kv_blocks),
    )

    async def start():
        client = await aiohttp_client(create_app(config, MODEL))
        await client.app[ENGINE].wait_ready()
        return client

    return start()


async def flush(client) -> None:
    await asyncio.get_running_loop().run_in_executor(None, client.app[TELEMETRY].force_flush)


def attrs(span: ProtoSpan) -> dict:
    def value(v):
        kind = v.WhichOneof("value")
        if kind == "array_value":
            return [value(x) for x in v.array_value.values]
        return getattr(v, kind)

    return {a.key: value(a.value) for a in span.attributes}


async def test_request_span_reaches_the_collector_parented_from_traceparent(receiver, aiohttp_client, tiny_llama_dir):
    client = await make_client(aiohttp_client, tiny_llama_dir)
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story please"}],
              "max_tokens": 6, "temperature": 0.5, "top_p": 0.9, "seed": 1, "stream": True},
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "x-cadenza-class": "batch",
                 "x-cadenza-tenant": "acme"},
    )
    body = await resp.text()
    assert resp.status == 200 and body.endswith("data: [DONE]\n\n")
    response_id = json.loads(body.split("\n\n")[0][len("data: "):])["id"]
    await flush(client)
    await until(lambda: receiver.spans)
    resource, span = receiver.spans[0]
    assert span.trace_id.hex() == trace_id and span.parent_span_id.hex() == parent_id
    assert span.kind == ProtoSpan.SPAN_KIND_SERVER and span.name == f"chat {MODEL}"
    a = attrs(span)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "cadenza"
    assert a["gen_ai.request.model"] == MODEL and a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.response.id"] == response_id and a["gen_ai.response.finish_reasons"] in (["length"], ["stop"])
    assert a["gen_ai.usage.input_tokens"] > 8 and 1 <= a["gen_ai.usage.output_tokens"] <= 6
    assert a["gen_ai.usage.cache_read.input_tokens"] == 0
    assert a["cadenza.request.class"] == "batch" and a["cadenza.tenant"] == "acme"
    assert 0 < a["cadenza.time_to_first_token"] < 10 and 0 <= a["cadenza.queue_time"] < 10
    events = [e.name for e in span.events]
    assert events[0] == "queued" and events[-1] == "finish"
    chunks = [e for e in span.events if e.name == "prefill_chunk"]
    assert len(chunks) >= 2  # chunk size 8: the prompt goes in several
    assert [attrs(e)["cadenza.chunk.position"] for e in chunks][:2] == [0, 8]
    assert all(attrs(e)["cadenza.chunk.tokens"] <= 8 for e in chunks)
    assert events.index("first_token") > events.index("prefill_chunk")
    assert span.start_time_unix_nano <= span.events[0].time_unix_nano <= span.end_time_unix_nano
    assert resource["service.name"] == "cadenza-test" and resource["deployment.environment.name"] == "test"
    assert resource["cadenza.pool.name"] == "pool-a" and resource["cadenza.replica.name"] == "pool-a-0"


async def test_a_second_request_with_the_same_prompt_reports_cache_reads(receiver, aiohttp_client, tiny_llama_dir):
    client = await make_client(aiohttp_client, tiny_llama_dir)
    payload = {"model": MODEL, "prompt": [7] * 40, "max_tokens": 2, "temperature": 0}
    for _ in range(2):
        assert (await client.post("/v1/completions", json=payload)).status == 200
    await flush(client)
    await until(lambda: len(receiver.spans) == 2)
    reads = sorted(attrs(span)["gen_ai.usage.cache_read.input_tokens"] for _, span in receiver.spans)
    assert reads == [0, 32]  # two full 16-token blocks of the 40-token prompt


# A preemption's span event is checked against the telemetry hook itself, in
# tests/node/test_telemetry_hooks.py: causing one here takes a starved KV pool and many steps.


async def test_a_refused_request_has_an_error_span(receiver, aiohttp_client, tiny_llama_dir):
    client = await make_client(aiohttp_client, tiny_llama_dir)
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 250, "max_tokens": 50})
    assert resp.status == 400
    await flush(client)
    await until(lambda: receiver.spans)
    _, span = receiver.spans[0]
    assert span.status.code == ProtoStatus.STATUS_CODE_ERROR
    assert attrs(span)["error.type"] == "context_length_exceeded"


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(family, suffix: str, **labels) -> float:
    return sum(s.value for s in family.samples
               if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))


async def test_histograms_count_requests_and_every_inter_token_gap(receiver, aiohttp_client, tiny_llama_dir):
    client = await make_client(aiohttp_client, tiny_llama_dir)
    outputs = []
    for n, cls in ((5, "interactive"), (3, "interactive"), (7, "batch")):
        resp = await client.post("/v1/completions", headers={"x-cadenza-class": cls},
                                 json={"model": MODEL, "prompt": "count with me", "max_tokens": n, "ignore_eos": True})
        outputs.append((cls, (await resp.json())["usage"]["completion_tokens"]))
    text = (await (await client.get("/metrics")).text())
    f = families(text)
    assert sample(f["gen_ai_server_time_to_first_token_seconds"], "_count") == 3
    assert sample(f["gen_ai_server_request_duration_seconds"], "_count") == 3
    assert sample(f["gen_ai_server_time_per_output_token_seconds"], "_count") == 3
    assert sample(f["gen_ai_client_token_usage"], "_sum", gen_ai_token_type="output") == sum(n for _, n in outputs)
    itl = f["cadenza_request_inter_token_latency_seconds"]
    assert sample(itl, "_count") == sum(n - 1 for _, n in outputs)
    assert sample(itl, "_count", cadenza_request_class="batch") == 7 - 1
    # The spec's bucket boundaries are the ones exported.
    bounds = {s.labels["le"] for s in f["gen_ai_server_time_to_first_token_seconds"].samples if "le" in s.labels}
    assert {"0.001", "0.25", "10.0", "+Inf"} <= bounds
    assert sample(f["cadenza_kv_blocks"], "", cadenza_kv_state="used") == 0
    assert sample(f["cadenza_scheduler_prefill_tokens"], "_total", cadenza_outcome="admitted") > 0
    assert sample(f["cadenza_step_tokens"], "_count", cadenza_token_kind="decode") > 0
    assert "cadenza_requests" in f and "cadenza_request_queue_delay_seconds" in f
    # The controller's engine signals: preemptions by class, the cost model's predicted step time.
    assert sample(f["cadenza_requests_preempted"], "_total", cadenza_request_class="interactive") == 0
    assert "cadenza_step_predicted_duration_seconds" in f
    # Steps by how they ran: on a CPU none replays a CUDA graph.
    assert sample(f["cadenza_step_duration_seconds"], "_count", cadenza_step_cuda_graph="false") > 0
    assert not [s for s in f["cadenza_step_duration_seconds"].samples if s.labels.get("cadenza_step_cuda_graph") == "true"]
    # The OTLP export carries the same figures.
    await flush(client)
    await until(lambda: receiver.metrics)
    exported = {m.name: m for req in receiver.metrics for rm in req.resource_metrics
                for sm in rm.scope_metrics for m in sm.metrics}
    ttft_points = exported["gen_ai.server.time_to_first_token"].histogram.data_points
    assert sum(p.count for p in ttft_points) == 3


async def test_serving_goes_on_when_no_collector_is_reachable(aiohttp_client, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nobody listens
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    client = await make_client(aiohttp_client, tiny_llama_dir)
    for _ in range(5):
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert resp.status == 200
    assert (await client.get("/metrics")).status == 200
    await asyncio.wait_for(flush(client), 60)  # export failures are logged, not raised


async def test_requests_are_answered_while_an_export_hangs(receiver, aiohttp_client, tiny_llama_dir, monkeypatch):
    """Spans leave in the background: a collector that never answers holds the exporter, not serving."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "60")  # the held export outlives the whole test
    client = await make_client(aiohttp_client, tiny_llama_dir)
    payload = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
    receiver.gate.clear()
    try:
        assert (await client.post("/v1/completions", json=payload)).status == 200
        await until(lambda: receiver.held_exports, what="the first span's export to reach the collector")
        for _ in range(4):
            assert (await client.post("/v1/completions", json=payload)).status == 200
        assert receiver.held_exports and not receiver.spans  # all answered while that export still hung
    finally:
        receiver.gate.set()
    await flush(client)
    await until(lambda: len(receiver.spans) == 5)
