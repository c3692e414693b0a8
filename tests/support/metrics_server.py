"""A gateway's or an engine's ``/metrics`` on a loopback port, served from the real telemetry
(:class:`GatewayMetrics`, or :class:`Telemetry` over engine stats a test sets: :class:`FakeEngine`)."""

from __future__ import annotations

import http.server
import threading

from cadenza.node.core.messages import StepRecord
from cadenza.node.core.stats import ClassStats, EngineStats
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

    def text(self) -> str:
        return self.telemetry.prometheus_text().decode()
