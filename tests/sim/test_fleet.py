"""Simulated replicas behind the gateway's routing: where requests go, what one replica does alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cadenza.node.core.config import SchedulerConfig
from cadenza.node.replay.trace import TraceRequest
from cadenza.sim.fleet import Fleet, simulate_fleet, simulate_replica
from cadenza.sim.hardware import PROFILES
from cadenza.sim.model_dims import load_model_dims
from cadenza.sim.roofline import Roofline

CONFIG = SchedulerConfig(token_budget=512, chunk_size=256, max_num_seqs=32, max_model_len=8192)
MODEL = Roofline(load_model_dims("llama-3.1-8b"), PROFILES["h100-sxm"])


def trace(n: int, every_s: float) -> list[TraceRequest]:
    return [TraceRequest(every_s * i, 300 + 53 * (i % 7), 30 + 7 * (i % 4)) for i in range(n)]


def test_one_replica_behind_the_gateway_is_the_replica_alone():
    requests = trace(80, 0.04)
    fleet = simulate_fleet(requests, {"interactive": ["a"], "batch": ["a"]}, {"a": CONFIG}, MODEL)
    _, alone = simulate_replica(requests, CONFIG, MODEL)
    assert fleet.dropped == 0 and fleet.by_class["interactive"] == alone


def test_colocated_replicas_share_the_load_and_cut_the_queueing():
    requests = trace(300, 0.01)
    one = simulate_fleet(requests, {"interactive": ["a"], "batch": ["a"]}, {"a": CONFIG}, MODEL)
    four = simulate_fleet(requests, {"interactive": list("abcd"), "batch": list("abcd")},
                          {n: CONFIG for n in "abcd"}, MODEL)
    assert min(four.steps.values()) > 0.5 * max(four.steps.values())  # least-outstanding spreads them
    assert four.by_class["interactive"].ttft_ms["p99"] < one.by_class["interactive"].ttft_ms["p99"] / 2


def test_dedicated_roles_keep_batch_off_the_interactive_replica():
    requests = trace(60, 0.02)
    classes = ["batch" if i % 2 else "interactive" for i in range(60)]
    result = simulate_fleet(requests, {"interactive": ["fast"], "batch": ["bulk"]},
                            {"fast": CONFIG, "bulk": CONFIG}, MODEL, classes=classes)
    assert result.by_class["interactive"].requests == result.by_class["batch"].requests == 30
    solo = simulate_fleet([r for r, c in zip(requests, classes) if c == "interactive"],
                          {"interactive": ["fast"]}, {"fast": CONFIG}, MODEL)
    # the batch half never touched it (goodput alone differs: it is over the whole run's span)
    assert replace(result.by_class["interactive"], goodput_rps=None) == replace(solo.by_class["interactive"],
                                                                                goodput_rps=None)


def test_a_request_no_replica_takes_is_dropped_and_counted():
    requests = [TraceRequest(0.0, 1000, 500) for _ in range(40)]
    told = []
    result = Fleet({"interactive": ["a"]}, {"a": CONFIG}, MODEL, max_outstanding=10).run(requests, on_done=told.append)
    assert result.dropped == 30 and result.by_class["interactive"].requests == 10
    assert result.by_class["interactive"].rejected == 30
    assert sum(told) == 40  # every request, finished or dropped, reached the progress hook


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="without a config"):
        simulate_fleet(trace(2, 1), {"interactive": ["a"]}, {}, MODEL)
    with pytest.raises(ValueError, match="classes"):
        simulate_fleet(trace(2, 1), {"interactive": ["a"]}, {"a": CONFIG}, MODEL, classes=["batch"])
