"""The gateway's client-side TTFT / ITL histograms per class, read back as the controller reads them."""

from __future__ import annotations

import random

import pytest

from cadenza.gateway.metrics import latency_buckets
from cadenza.control.exposition import parse_pool_metrics
from cadenza.control.histograms import Histogram
from cadenza.control.scrape import SnapshotHistory

STREAM = {"model": "fake", "prompt": "hi", "max_tokens": 5, "stream": True}


async def test_streams_are_timed_per_class_and_exported_at_metrics(start_replica, start_gateway):
    replica = await start_replica("r", chunks=4, delay_s=0.02)  # paced: one event per chunk
    gateway = await start_gateway({"interactive": [replica.url], "batch": [replica.url]})
    for cls, n in (("interactive", 3), ("batch", 2)):
        for _ in range(n):
            resp = await gateway.post("/v1/completions", json=STREAM, headers={"x-cadenza-class": cls})
            assert resp.status == 200
            await resp.read()
    resp = await gateway.post("/v1/completions", json={**STREAM, "stream": False})  # not streamed: not timed
    assert resp.status == 200
    metrics = await gateway.get("/metrics")
    assert metrics.status == 200
    text = await metrics.text()
    snap = parse_pool_metrics([text], time=0.0)
    assert snap.ttft["interactive"].total == 3 and snap.ttft["batch"].total == 2
    # Four events and [DONE] per stream: three gaps between the events, none to [DONE].
    assert snap.itl["interactive"].total == 9 and snap.itl["batch"].total == 6
    assert "background" not in snap.ttft


async def test_metrics_lists_every_family_before_the_first_request(start_replica, start_gateway):
    from cadenza.gateway.metrics import FAMILIES

    replica = await start_replica("r", chunks=2)
    gateway = await start_gateway({"interactive": [replica.url], "batch": [replica.url]})
    resp = await gateway.get("/metrics")
    assert resp.status == 200 and resp.headers["content-type"].startswith("text/plain")
    text = await resp.text()
    for name, kind, _help in FAMILIES:
        assert f"# TYPE {name} {kind}\n" in text and f"# HELP {name} " in text
    snap = parse_pool_metrics([text], time=0.0)  # the controller reads it as no traffic yet
    assert not any(h.total for h in snap.ttft.values())

    # once they have samples, the families are named as listed, each once
    await (await gateway.post("/v1/completions", json=STREAM)).read()
    text = await (await gateway.get("/metrics")).text()
    for name, kind, _help in FAMILIES:
        assert text.count(f"# TYPE {name} {kind}\n") == 1
    assert "cadenza_gateway_time_to_first_token_seconds_count{" in text


def test_p99_near_the_target_is_within_10_percent():
    """Latencies drawn around a 300 ms target: the bucketed p99 is within 10 % of the exact one."""
    rng = random.Random(3)
    bounds = tuple(latency_buckets([0.3]))
    for scale in (0.15, 0.25, 0.3, 0.4, 0.55):
        samples = sorted(rng.lognormvariate(0, 0.35) * scale for _ in range(5000))
        exact = samples[int(0.99 * len(samples)) - 1]
        counts = tuple(sum(1 for x in samples if x <= b) for b in bounds) + (len(samples),)
        estimate = Histogram(bounds, counts).quantile(0.99)
        if 0.15 <= exact <= 0.6:  # within 0.5-2x of the target, where the buckets are dense
            assert abs(estimate - exact) / exact < 0.10, (scale, exact, estimate)
    # The semantic conventions' default TTFT buckets cannot do this (0.25 -> 0.5 s).
    coarse = (0.1, 0.25, 0.5, 0.75, 1.0)
    samples = [0.27 + 0.001 * i for i in range(100)]  # exact p99 ~0.368 s
    counts = tuple(sum(1 for x in samples if x <= b) for b in coarse) + (100,)
    assert abs(Histogram(coarse, counts).quantile(0.99) - 0.368) / 0.368 > 0.10


def test_bad_targets_are_refused():
    with pytest.raises(ValueError):
        latency_buckets([0.0])


def test_a_window_is_the_difference_of_two_scrapes():
    bounds = (0.1, 0.2, 0.4)
    history = SnapshotHistory(keep_s=400)
    from cadenza.control.exposition import Snapshot

    def snap(t, ttft_counts, itl_counts):
        return Snapshot(t, {"interactive": Histogram(bounds, ttft_counts)}, {"interactive": Histogram(bounds, itl_counts)})

    history.add(snap(0, (100, 100, 100, 100), (1000, 1000, 1000, 1000)))
    history.add(snap(30, (100, 150, 300, 300), (1000, 1500, 1500, 3000)))
    slo = {"ttftP99Ms": 400, "itlP99Ms": 200}
    w = history.window("interactive", 30, now=31, slo=slo, min_samples=100, stale_s=60)
    assert w.known and w.requests == 200
    assert 400 > w.ttft_p99_ms > 350  # inside the (0.2, 0.4] bucket
    assert w.itl_p99_ms == pytest.approx(400)  # in +Inf: reported as the last finite bound
    assert w.attainment == pytest.approx(500 / 2000)  # 500 of 2000 gaps at or under 200 ms
    assert not history.window("interactive", 300, now=31, slo=slo, min_samples=100, stale_s=60).known
    stale = history.window("interactive", 30, now=200, slo=slo, min_samples=100, stale_s=60)
    assert not stale.known and "old" in stale.reason
    sparse = history.window("interactive", 30, now=31, slo=slo, min_samples=500, stale_s=60)
    assert not sparse.known and "500" in sparse.reason
    assert not history.window("batch", 30, now=31, slo=slo, min_samples=1, stale_s=60).known  # no series
    # A gateway restart resets its counters: the window restarts at the reset, never negative.
    history.add(snap(60, (5, 5, 5, 5), (0, 0, 0, 0)))
    w = history.window("interactive", 30, now=61, slo=slo, min_samples=1, stale_s=60)
    assert w.requests == 5
    history.add(snap(90, (5, 5, 5, float("nan")), (0, 0, 0, 0)))
    assert "NaN" in history.window("interactive", 30, now=91, slo=slo, min_samples=1, stale_s=60).reason


def test_a_covered_window_without_requests_is_a_known_zero():
    from cadenza.control.exposition import Snapshot

    h = Histogram((0.1,), (7, 7))
    history = SnapshotHistory(keep_s=100)
    history.add(Snapshot(0, {"batch": h}, {"batch": h}))
    history.add(Snapshot(30, {"batch": h}, {"batch": h}))
    w = history.window("batch", 30, now=30, slo={"ttftP99Ms": 100}, min_samples=200, stale_s=60)
    assert w.known and w.requests == 0 and w.ttft_p99_ms is None
