"""A gateway's ``/metrics`` on a loopback port, served from a real :class:`GatewayMetrics`."""

from __future__ import annotations

import http.server
import threading

from cadenza.node.gateway.metrics import GatewayMetrics


def serve_metrics(metrics: GatewayMetrics) -> http.server.ThreadingHTTPServer:
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
