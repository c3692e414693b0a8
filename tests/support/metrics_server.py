"""A gateway's or an engine's ``/metrics`` on a loopback port, served from the real telemetry
(:class:`GatewayMetrics`, or :class:`Telemetry` over engine stats a test sets: :class:`FakeEngine`)."""

from __future__ import annotations

import http.server
import itertools
import threading
import time

from cadenza.node.core.messages import StepRecord
from cadenza.node.core.stats import ClassStats, EngineStats
from cadenza.node.frontend.output_processor import RequestOutput
from cadenza.node.frontend.telemetry import Telemetry
from cadenza.gateway.metrics import GatewayMetrics


def serve_metrics(metrics: GatewayMetrics | Telemetry) -> http.server.ThreadingHTTPServer:
    """Start serving ``metrics`` on a free port (``server.server_address[1]``); ``shutdown()`` stops it."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            body = metrics.prometheus_text()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class FakeEngine:
    """A real :class:`Telemetry` over stats we set, as an engine's ``/metrics`` would show them."""

    def __init__(self, total_blocks: int = 100) -> None:
        self.stats = EngineStats(kv_blocks_total=total_blocks, kv_blocks_free=total_blocks,
                                 classes={cls: ClassStats() for cls in ("interactive", "batch")})
        self.telemetry = Telemetry("m", lambda: self.stats, otlp=False)
        self.total = total_blocks
        self._ids = itertools.count()

    def load(self, *, used: int = 0, reserved: int = 0, waiting: dict | None = None,
             preempted: dict | None = None, steps_s: tuple[float, ...] = ()) -> None:
        stats = self.stats
        stats.kv_blocks_used, stats.kv_blocks_reserved, stats.kv_blocks_free = used, reserved, self.total - used
        for cls, n in (waiting or {}).items():
            stats.classes[cls].waiting = n
        for cls, n in (preempted or {}).items():
            stats.classes[cls].preemptions = n
        for seconds in steps_s:
            self.telemetry.on_step(StepRecord(seconds, seconds, 0, 0), 0.0)

    def serve(self, *, prefill: int = 0, decode: int = 0, prompts: tuple[int, ...] = (), loaded: int = 0,
              threshold: int | None = None) -> None:
        """A step that computed ``prefill`` and ``decode`` tokens, requests finished with these
        prompt lengths, ``loaded`` prompt tokens whose KV came from a prefill replica, and the
        selective threshold the engine reports now (None: none)."""
        if prefill or decode:
            self.telemetry.on_step(StepRecord(0.01, 0.01, prefill, decode), 0.0)
        for n in prompts:
            rid, now = f"r{next(self._ids)}", time.monotonic()
            self.telemetry.start_request(rid, "text_completion", {}, max_tokens=1, temperature=None, top_p=None,
                                         traffic_class="batch", tenant="t", arrival=now)
            self.telemetry.on_output(RequestOutput(rid, [1], "x", "length", n, 1, time=now))
        self.stats.remote_kv_tokens += loaded
        self.stats.kv_transfer_min_prompt_tokens = threshold

    def text(self) -> str:
        return self.telemetry.prometheus_text().decode()
