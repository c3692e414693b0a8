"""The controller in the simulation: the operator's control loop and decide() on simulated windows,
acting through the fleet after its delays."""

from __future__ import annotations

import pytest

from cadenza.node.core.config import SchedulerConfig
from cadenza.loadgen.trace import TraceRequest
from cadenza.control.decide import decide
from cadenza.control.signals import read_signals
from cadenza.control.spec import ControllerSpec
from cadenza.sim.control import FleetSource, sim_controller
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


def fleet() -> Fleet:
    return Fleet({"interactive": ["a", "b"], "batch": ["a", "b"]}, {"a": CONFIG, "b": CONFIG}, MODEL)


def run(fleet: Fleet, seconds: float = 60) -> Fleet:
    fleet.run(*mixed_trace(seconds))
    return fleet


def test_an_itl_breach_halves_the_chunks_live_until_the_slo_holds():
    tuned, static = fleet(), fleet()
    controller = sim_controller(pool_spec(), tuned, interval_s=5, scrape_delay_s=5, retune_delay_s=1)
    run(tuned), run(static)
    retunes = [a for a in controller.actuation.actions if a.action == "retune"]
    assert [a.knobs for a in retunes[:2]] == [{"chunk_size": 1024}, {"chunk_size": 512}]
    assert all(a.acted for a in retunes) and retunes[0].time_s >= 5
    assert {r.scheduler.config.chunk_size for r in tuned.replicas.values()} == {retunes[-1].knobs["chunk_size"]}
    tuned_itl = tuned.result(["interactive"]).by_class["interactive"].itl_ms["p99"]
    static_itl = static.result(["interactive"]).by_class["interactive"].itl_ms["p99"]
    assert static_itl > 40 and tuned_itl < static_itl / 2


def test_every_simulated_decision_is_what_decide_returns_for_the_same_inputs():
    simulated = fleet()
    controller = sim_controller(pool_spec(), simulated, interval_s=5, scrape_delay_s=5)
    run(simulated, seconds=40)
    decisions = controller.actuation.decisions
    assert len(decisions) >= 7
    for now, signals, shape, knobs, before, _spec, decision in decisions:
        assert decide(signals, shape, knobs, before, controller.spec, now) == decision
    assert [a.time_s for a in controller.actuation.actions] == [t for t, *_, d in decisions if d.action != "hold"]


def test_with_prefill_at_its_bound_a_replica_is_dedicated_to_interactive_after_a_slow_window():
    # chunkSize may not move: rung 1 is exhausted from the start, so the breach reshapes
    simulated = fleet()
    controller = sim_controller(pool_spec(bounds={"chunkSize": {"min": 2048, "max": 2048}}), simulated, interval_s=5,
                                scrape_delay_s=5, reshape_delay_s=10)
    run(simulated, seconds=90)
    reshapes = [a for a in controller.actuation.actions if a.action == "reshape" and a.acted]
    assert reshapes and reshapes[0].move == "dedicate"
    assert reshapes[0].time_s >= 20  # the breach must hold at the bound for a slow window first
    assert simulated.roles() == {"interactive": ["a", "b"], "batch": ["a"]}
    batch_on_b = [t for rid, t in simulated.replicas["b"].times.items() if simulated.classes[rid] == "batch"]
    assert all(t.arrival_s < reshapes[0].time_s + controller.actuation.reshape_delay_s for t in batch_on_b)


@pytest.mark.parametrize("delay", [0.0, 7.5])
def test_a_window_holds_the_first_tokens_of_its_span_ending_a_scrape_delay_ago(delay):
    spec, simulated = pool_spec(), run(fleet(), seconds=20)
    source = FleetSource(simulated, spec, scrape_delay_s=delay)
    end = 20.0 - delay
    source.record(20.0)
    fast = read_signals(source, 20.0, spec.slo, spec.fast_window_s, spec.slow_window_s, min_samples=spec.min_samples,
                        stale_s=spec.stale_s).fast["interactive"]
    first_tokens = [t.token_s[0] for t in simulated.timelines("interactive") if t.token_s]
    assert fast.window_s == pytest.approx(5.0)
    assert fast.requests == sum(1 for t in first_tokens if end - 5.0 < t <= end) > 20
