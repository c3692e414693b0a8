"""The Prometheus signal source against a real Prometheus server scraping a gateway's histograms.

Prometheus (Debian's ``prometheus`` package; ``.ci/run`` installs it) is started on a loopback
port with a 1 s scrape interval, scraping an HTTP endpoint served by the gateway's own
:class:`~cadenza.node.gateway.metrics.GatewayMetrics`. Skipped where the binary is missing.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request

import pytest

from cadenza.node.gateway.metrics import GatewayMetrics
from cadenza.operator.signals import PrometheusSource, SnapshotHistory, parse_gateway_metrics
from metrics_server import serve_metrics
from server_process import free_port
from waiting import wait_until

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not on PATH (Debian: apt install prometheus)")
SLO = {"ttftP99Ms": 500, "itlP99Ms": 50}


@pytest.fixture
def gateway():
    metrics = GatewayMetrics([0.05, 0.5])
    server = serve_metrics(metrics)
    yield metrics, server.server_address[1]
    server.shutdown()


@pytest.fixture
def prometheus(tmp_path, gateway):
    _metrics, port = gateway
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""global: {{scrape_interval: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: chat-gateway
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
""")
    web = free_port()
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{web}"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "prometheus.log", "w"))
    url = f"http://127.0.0.1:{web}"
    try:
        wait_until(lambda: urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200, 60,
                   "prometheus to be ready", interval=0.2, ignore=(OSError,))
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_windows_from_prometheus_match_the_scraped_histograms(gateway, prometheus):
    metrics, port = gateway
    source = PrometheusSource(prometheus, 'job="chat-gateway"')
    scraped = SnapshotHistory(keep_s=120)

    def scrape(now):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            scraped.add(parse_gateway_metrics([resp.read().decode()], now))

    # Before any request: no series, so unknown (never "no load").
    assert not source.window("interactive", 20, time.time(), SLO, min_samples=1, stale_s=60).known
    scrape(time.time())
    for _ in range(12):  # 12 s of interactive traffic with a 55 ms ITL: just over the 50 ms target
        for _ in range(50):
            metrics.ttft.record(0.1, {"cadenza.traffic_class": "interactive"})
            metrics.itl.record(0.055, {"cadenza.traffic_class": "interactive"})
        time.sleep(1)
    time.sleep(2)  # the last samples scraped
    now = time.time()
    scrape(now)
    window = wait_until(lambda: (w := source.window("interactive", 30, time.time(), SLO, min_samples=100,
                                                    stale_s=60)).known and w, 30, "a known window", interval=0.5)
    assert window.requests >= 300  # increase() extrapolates, so about the 600 observed
    assert window.itl_p99_ms == pytest.approx(55, rel=0.1)  # the buckets are dense near the target
    assert window.ttft_p99_ms == pytest.approx(100, rel=0.1)
    direct = scraped.window("interactive", 10, now, SLO, min_samples=100, stale_s=60)
    assert direct.itl_p99_ms == pytest.approx(window.itl_p99_ms, rel=0.1)
    assert window.attainment == pytest.approx(0.0, abs=0.02)  # no gap within 50 ms
    # A selector that matches nothing, and a server that is not there, are unknown too.
    assert not PrometheusSource(prometheus, 'job="other"').window("interactive", 30, time.time(), SLO,
                                                                    min_samples=1, stale_s=60).known
    gone = PrometheusSource(f"http://127.0.0.1:{free_port()}").window("interactive", 30, time.time(), SLO,
                                                                       min_samples=1, stale_s=60)
    assert not gone.known and "prometheus" in gone.reason
