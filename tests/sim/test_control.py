"""The controller in the simulation: the operator's decide() on simulated windows, acting through
the fleet after its delays."""

from __future__ import annotations

import pytest

from cadenza.node.core.config import SchedulerConfig
from cadenza.loadgen.trace import TraceRequest
from cadenza.control.decide import decide
from cadenza.control.spec import ControllerSpec
from cadenza.sim.control import SimController
from cadenza.sim.fleet import Fleet
from cadenza.sim.hardware import PROFILES
from cadenza.sim.model_dims import load_model_dims
from cadenza.sim.roofline import Roofline

MODEL = Roofline(load_model_dims("llama-3.1-8b"), PROFILES["h100-sxm"])
CONFIG = SchedulerConfig(token_budget=2048, chunk_size=2048, max_num_seqs=64, max_model_len=16384)


def mixed_trace(seconds: float) -> tuple[list[TraceRequest], list[str]]:
    """Chat streams every 0.1 s and 6,000-token batch prompts every 0.5 s: 2,048-token chunks
    stretch the chat's decode steps to ~50 ms."""
    trace = [TraceRequest(0.1 * i, 200, 100) for i in range(int(seconds * 10))]
    trace += [TraceRequest(0.5 * i + 0.05, 6000, 10) for i in range(int(seconds * 2))]
    return trace, ["interactive"] * int(seconds * 10) + ["batch"] * int(seconds * 2)


def pool_spec(**controller) -> ControllerSpec:
    return ControllerSpec.from_pool_spec({
        "slo": {"interactive": {"itlP99Ms": 25, "ttftP99Ms": 2000}, "batch": {"ttftP99Ms": 30000}},
        "engine": {"chunkSize": 2048, "tokenBudget": 2048},
        "controller": {"fastWindowSeconds": 5, "windowSeconds": 20, "minSamples": 20, "cooldownSeconds": 30,
                       **controller}})


def run(controller: SimController | None, seconds: float = 60) -> Fleet:
    fleet = Fleet({"interactive": ["a", "b"], "batch": ["a", "b"]}, {"a": CONFIG, "b": CONFIG}, MODEL)
    if controller is not None:
        controller.attach(fleet)
    fleet.run(*mixed_trace(seconds))
    return fleet


def test_an_itl_breach_halves_the_chunks_live_until_the_slo_holds():
    controller = SimController(pool_spec(), interval_s=5, scrape_delay_s=5, retune_delay_s=1)
    tuned, static = run(controller), run(None)
    retunes = [a for a in controller.actions if a.action == "retune"]
    assert [a.knobs for a in retunes[:2]] == [{"chunk_size": 1024}, {"chunk_size": 512}]
    assert all(a.acted for a in retunes) and retunes[0].time_s >= 5
    assert {r.scheduler.config.chunk_size for r in tuned.replicas.values()} == {retunes[-1].knobs["chunk_size"]}
    tuned_itl = tuned.result(["interactive"]).by_class["interactive"].itl_ms["p99"]
    static_itl = static.result(["interactive"]).by_class["interactive"].itl_ms["p99"]
    assert static_itl > 40 and tuned_itl < static_itl / 2


def test_every_simulated_decision_is_what_decide_returns_for_the_same_inputs():
    controller = SimController(pool_spec(), interval_s=5, scrape_delay_s=5)
    run(controller, seconds=40)
    assert len(controller.decisions) >= 7
    for now, signals, shape, knobs, before, decision in controller.decisions:
        assert decide(signals, shape, knobs, before, controller.spec, now) == decision
    assert [a.time_s for a in controller.actions] == [t for t, *_, d in controller.decisions if d.action != "hold"]


def test_with_prefill_at_its_bound_a_replica_is_dedicated_to_interactive_after_a_slow_window():
    # chunkSize may not move: rung 1 is exhausted from the start, so the breach reshapes
    controller = SimController(pool_spec(bounds={"chunkSize": {"min": 2048, "max": 2048}}), interval_s=5,
                               scrape_delay_s=5, reshape_delay_s=10)
    fleet = run(controller, seconds=90)
    reshapes = [a for a in controller.actions if a.action == "reshape" and a.acted]
    assert reshapes and reshapes[0].move == "dedicate"
    assert reshapes[0].time_s >= 20  # the breach must hold at the bound for a slow window first
    assert fleet.roles() == {"interactive": ["a", "b"], "batch": ["a"]}
    batch_on_b = [t for rid, t in fleet.replicas["b"].times.items() if fleet.classes[rid] == "batch"]
    assert all(t.arrival_s < reshapes[0].time_s + controller.reshape_delay_s for t in batch_on_b)


@pytest.mark.parametrize("delay", [0.0, 7.5])
def test_a_window_holds_the_first_tokens_of_its_span_ending_a_scrape_delay_ago(delay):
    controller = SimController(pool_spec(), interval_s=5, scrape_delay_s=delay)
    fleet = run(None, seconds=20)
    end = 20.0 - delay
    fast = controller.signals(fleet, now=20.0).fast["interactive"]
    first_tokens = [t.token_s[0] for t in fleet.timelines("interactive") if t.token_s]
    assert fast.window_s == pytest.approx(5.0)
    assert fast.requests == sum(1 for t in first_tokens if end - 5.0 < t <= end) > 20
