"""Capacity at SLO by bisection."""

from __future__ import annotations

import pytest

from cadenza.node.core.config import SchedulerConfig
from cadenza.loadgen.trace import TraceRequest
from cadenza.sim.hardware import PROFILES
from cadenza.sim.model_dims import load_model_dims
from cadenza.sim.roofline import Roofline
from cadenza.sim.fleet import simulate_replica
from cadenza.sim.report import LatencySummary
from cadenza.sim.sweep import at_rate, capacity_at_slo, pool_slo_met, slo_met


def summary(itl_p99: float, rejected: int = 0) -> LatencySummary:
    flat = {"p50": 1.0, "p95": 1.0, "p99": 1.0}
    return LatencySummary(10, rejected, flat, {**flat, "p99": itl_p99}, flat, 1.0)


def test_bisection_finds_a_known_capacity():
    # a workload whose ITL p99 crosses 100 ms at exactly 7.3 requests/s
    found = capacity_at_slo(lambda rate: summary(100.0 * rate / 7.3), {"itl_ms": ("p99", 100.0)}, 1.0, 2.0,
                            tolerance=0.01)
    assert found.rate == pytest.approx(7.3, rel=0.01) and found.rate <= 7.3
    assert [r for r, ok, _ in found.runs[:3]] == [1.0, 2.0, 4.0]  # doubled until it failed at 8


def test_a_drop_fails_the_slo_and_an_unmeetable_load_has_no_capacity():
    assert not slo_met(summary(1.0, rejected=1), {"itl_ms": ("p99", 100.0)})
    assert capacity_at_slo(lambda rate: summary(500.0), {"itl_ms": ("p99", 100.0)}, 1.0, 2.0).rate == 0.0
    with pytest.raises(ValueError):
        capacity_at_slo(lambda rate: summary(1.0), {}, 2.0, 1.0)


def test_more_hardware_bandwidth_buys_capacity_in_the_simulator():
    base = [TraceRequest(i * 1.0, 600 + 100 * (i % 4), 80) for i in range(120)]

    def at(hw: str):
        model = Roofline(load_model_dims("mistral-7b"), PROFILES[hw])
        config = SchedulerConfig(token_budget=512, chunk_size=512, max_num_seqs=64, max_model_len=8192)
        return lambda rate: simulate_replica([TraceRequest(r.arrival_s / rate, r.input_len, r.output_len) for r in base],
                                             config, model)[1]

    targets = {"itl_ms": ("p99", 60.0), "ttft_ms": ("p50", 1000.0)}
    a100, h200 = (capacity_at_slo(at(hw), targets, 1.0, 2.0, tolerance=0.05).rate for hw in ("a100-80g", "h200"))
    assert a100 > 1.0 and h200 > 1.5 * a100


def test_at_rate_scales_arrivals_and_keeps_who_sent_them():
    base = [TraceRequest(float(i), 10, 5, "batch", "etl") for i in range(11)]
    fast = at_rate(base, 5.0)  # 10 gaps over 2 s
    assert fast[-1].arrival_s == pytest.approx(2.0) and fast[3].traffic_class == "batch" and fast[3].tenant == "etl"
    with pytest.raises(ValueError, match="spread over time"):
        at_rate(base[:1], 1.0)


def test_a_pool_slo_is_met_only_with_nothing_dropped_and_every_class_within_it():
    from cadenza.sim.fleet import FleetResult

    ok = summary(40.0)
    slo = {"interactive": {"ttftP99Ms": 5, "itlP99Ms": 50}, "batch": {"ttftP99Ms": 1}}
    assert pool_slo_met(FleetResult({"interactive": ok}, 0, {}), slo)  # no batch requests: not judged
    assert not pool_slo_met(FleetResult({"interactive": summary(60.0)}, 0, {}), slo)
    assert not pool_slo_met(FleetResult({"interactive": ok}, 1, {}), slo)


def test_a_first_bracket_that_fails_is_searched_downwards():
    # met at or below 3 req/s, starting from a bracket of (10, 20)
    found = capacity_at_slo(lambda rate: summary(50.0 if rate <= 3 else 500.0), {"itl_ms": ("p99", 100.0)}, 10.0, 20.0)
    assert 2.9 < found.rate <= 3.0
