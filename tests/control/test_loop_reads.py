"""The control loop reads a pool's signals once per tick: over a Prometheus source, a tick and the
status built from it send a loopback Prometheus API exactly the queries of one reading (the
decision, the record of an action and the status once each read them again: three readings)."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.parse

import pytest

from cadenza.control.in_place import Replica, in_place_loop
from cadenza.control.prometheus import PrometheusSource
from cadenza.control.signals import read_signals
from cadenza.control.spec import ControllerSpec
from cadenza.control.status import slo_status
from cadenza.node.core.policy import CLASSES
from cadenza.pool.spec import Pool

# Per class and window: TTFT and ITL buckets, then queue depth, KV usage, preemptions and the
# predicted step time's buckets of the engines, then the pool's tokens by kind, prompt-length
# buckets and sum, loaded KV tokens and the gateways' threshold (answered here: the engines' is
# asked only when the gateways have none).
QUERIES_PER_WINDOW = 2 + 4 + 5


class PrometheusAPI:
    """``GET /api/v1/query`` on a loopback port: buckets for a ``_bucket`` query (ITL far over its
    target: every reading breaches), a small number for the engines' figures; every query kept."""

    def __init__(self) -> None:
        self.queries: list[str] = []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's name
                url = urllib.parse.urlparse(self.path)
                query = urllib.parse.parse_qs(url.query)["query"][0]
                api.queries.append(query)
                body = json.dumps(api.answer(url.path, query)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def answer(path: str, query: str) -> dict:
        assert path == "/api/v1/query"
        if "_bucket" in query:
            slow = "cadenza_gateway_itl" in query
            buckets = [("0.01", "0" if slow else "900"), ("0.5", "1000"), ("+Inf", "1000")]
            result = [{"metric": {"le": le}, "value": [0, count]} for le, count in buckets]
        else:  # a queue of 2 and 2 preempted, KV half full: retuning can help
            result = [{"metric": {}, "value": [0, "0.5" if "kv_blocks" in query else "2"]}]
        return {"status": "success", "data": {"resultType": "vector", "result": result}}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def prometheus():
    api = PrometheusAPI()
    yield api
    api.close()


def pool_spec(url: str) -> dict:
    return {"model": {"name": "m"}, "replicas": 2, "mode": "auto", "engine": {"tokenBudget": 256, "chunkSize": 64},
            "slo": {"interactive": {"itlP99Ms": 50}, "batch": {"ttftP99Ms": 5000}},
            "controller": {"fastWindowSeconds": 5, "windowSeconds": 10, "minSamples": 5,
                           "bounds": {"chunkSize": {"min": 32, "max": 64}},
                           "prometheus": {"url": url, "selector": 'job="chat-gateway"',
                                          "engineSelector": 'job="chat-engine"'}}}


class Admin:
    """Replicas that already run whatever they are asked to."""

    def __init__(self) -> None:
        self.puts = 0

    def get_config(self, url):
        return {"token_budget": 256, "chunk_size": 64, "step_time_target_ms": None}

    def put_config(self, url, doc):
        self.puts += 1
        return doc

    def ready(self, url):
        zero = {"running": 0, "waiting": 0}
        return {"classes": {"batch": zero, "background": zero}}


class Pods:
    """Two ready replicas; scraping is never asked for (Prometheus holds the series)."""

    def __init__(self) -> None:
        self.pods = [Replica("a", "http://a"), Replica("b", "http://b")]

    def replicas(self):
        return self.pods

    def scrape(self):
        raise AssertionError("a pool with spec.controller.prometheus is not scraped")

    def route(self, replica, role, routes):
        replica.routes = routes


def one_reading() -> int:
    """The queries one reading of every class's windows sends (counted on its own server)."""
    api = PrometheusAPI()
    try:
        spec = ControllerSpec.from_pool_spec(pool_spec(api.url))
        source = PrometheusSource(api.url, 'job="chat-gateway"', engine_selector='job="chat-engine"')
        read_signals(source, 1_000_000.0, spec.slo, spec.fast_window_s, spec.slow_window_s,
                     min_samples=spec.min_samples, stale_s=spec.stale_s)
        return len(api.queries)
    finally:
        api.close()


def test_a_tick_that_acts_and_the_status_it_reports_read_prometheus_once(prometheus):
    admin = Admin()
    loop = in_place_loop(Pool("chat", "prod", pool_spec(prometheus.url)), Pods(), admin, clock=lambda: 1_000_000.0)
    assert isinstance(loop.source, PrometheusSource)
    decision = loop.tick()
    status = slo_status(loop)  # what the operator reports of the tick: latency, controller, SLOMet
    assert decision is not None and decision.action == "retune" and decision.act  # the record reads the figures too
    assert admin.puts == 2 and loop.actuation.state.last_retune["signals"]["interactive.itl_p99_ms"] > 50
    assert status["sloMet"][0] == "False" and status["latency"]["itlP99Ms"] > 50
    assert len(prometheus.queries) == one_reading() == len(CLASSES) * 2 * QUERIES_PER_WINDOW
    fast, slow = prometheus.queries[:len(prometheus.queries) // 2], prometheus.queries[len(prometheus.queries) // 2:]
    # Every query but the selective threshold's (read as it is now) is over its window.
    assert all("[5s]" in q or "[5s:" in q for q in fast if "min_prompt_tokens" not in q)
    assert all("[10s]" in q or "[10s:" in q for q in slow if "min_prompt_tokens" not in q)


def test_each_tick_reads_once_and_status_between_ticks_reads_nothing(prometheus):
    clock = [1_000_000.0]
    loop = in_place_loop(Pool("chat", "prod", pool_spec(prometheus.url)), Pods(), Admin(), clock=lambda: clock[0])
    per_reading = len(CLASSES) * 2 * QUERIES_PER_WINDOW
    for n in range(1, 4):
        loop.tick()
        slo_status(loop)
        loop.status()
        assert len(prometheus.queries) == n * per_reading
        clock[0] += loop.interval_s
