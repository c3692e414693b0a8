"""The advisory loop of a fixed-mode pool: it reads and decides like the in-place one, acts on
nothing, and takes its memory from the pool's status at every evaluation."""

from __future__ import annotations

from cadenza.control.advisory import ACTUATION, advisory_loop
from cadenza.control.history import History
from cadenza.control.prometheus import PrometheusSource
from cadenza.control.scrape import ScrapeSource
from cadenza.control.status import slo_status
from cadenza.gateway.metrics import GatewayMetrics

SPEC = {"replicas": 2, "mode": "colocated", "engine": {"tokenBudget": 256, "chunkSize": 64},
        "slo": {"interactive": {"itlP99Ms": 50}},
        "controller": {"fastWindowSeconds": 5, "windowSeconds": 10, "minSamples": 5, "advisory": False,
                       "bounds": {"chunkSize": {"min": 32, "max": 64}}}}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def evaluate(loop, metrics, clock, stored, spec=SPEC, scrape=None):
    """One resync's evaluation: 10 slow interactive streams, then the loop as the operator runs it."""
    for _ in range(10):
        metrics.ttft.record(0.1, {"cadenza.traffic_class": "interactive"})
        metrics.itl.record(0.2, {"cadenza.traffic_class": "interactive"})
    scrape = scrape or (lambda: {"gateway-0": metrics.prometheus_text().decode()})
    loop = advisory_loop(loop, spec, scrape, stored, clock=clock)
    loop.tick()
    clock.now += 1.0
    return loop, slo_status(loop)


def test_a_breach_is_advised_and_recorded_but_never_acted_on():
    clock, metrics, loop, stored = Clock(), GatewayMetrics([0.05]), None, None
    for _ in range(15):
        loop, out = evaluate(loop, metrics, clock, stored)
        stored = out["controller"]
    assert out["sloMet"][0] == "False" and out["latency"]["itlP99Ms"] > 50
    assert stored["actuation"] == ACTUATION and stored["lastDecision"]["acted"] is False
    assert "sloMet" not in stored and "knobs" not in stored  # nothing of an in-place actuation
    retunes = [d for d in stored["decisions"] if d["action"] == "retune"]
    assert retunes and not any(d["acted"] for d in retunes) and retunes[0]["knobs"] == {"chunk_size": 32}
    assert loop.spec.advisory and "lastAction" not in stored  # advisory whatever the spec says


def test_the_history_is_what_the_status_holds_at_each_evaluation():
    clock, metrics = Clock(), GatewayMetrics([0.05])
    loop, out = evaluate(None, metrics, clock, None)
    edited = {"decisions": [{"time": "2026-01-01T00:00:00Z", "action": "retune", "acted": False, "reason": "by hand"}]}
    loop, out = evaluate(loop, metrics, clock, edited)
    assert out["controller"]["decisions"][0]["reason"] == "by hand"  # read back, not the loop's memory
    assert loop.history == History.from_status(out["controller"])
    loop, out = evaluate(loop, metrics, clock, None)  # a status without memory: none
    assert "decisions" not in out["controller"]


def test_the_windows_survive_evaluations_and_start_over_when_the_source_changes():
    clock, metrics = Clock(), GatewayMetrics([0.05])
    loop, _ = evaluate(None, metrics, clock, None)
    source = loop.source
    assert isinstance(source, ScrapeSource)
    answered = []

    def scrape():
        answered.append(True)
        return {"gateway-0": metrics.prometheus_text().decode()}

    again, _ = evaluate(loop, metrics, clock, None, scrape=scrape)
    assert again is loop and loop.source is source and len(source.history.snapshots) == 2
    assert answered  # this evaluation's scrape (the pool's gateways as it sees them)
    spec = {**SPEC, "replicas": 3, "controller": {**SPEC["controller"], "windowSeconds": 20}}
    again, _ = evaluate(loop, metrics, clock, None, spec=spec)
    assert again is loop and loop.source is source and loop.spec.slow_window_s == 20
    assert loop.actuation.prepare(clock.now)[0].colocated == 3  # the spec of now
    prometheus = {**spec, "controller": {**spec["controller"], "prometheus": {"url": "http://127.0.0.1:9"}}}
    moved, out = evaluate(loop, metrics, clock, None, spec=prometheus)
    assert moved is not loop and isinstance(moved.source, PrometheusSource)
    assert out["sloMet"][0] == "Unknown"  # nothing answers there: unknown, which holds
