"""The controller in the simulation: the operator's control loop and decide() on simulated windows,
acting through the fleet after its delays."""

from __future__ import annotations

import pytest

from cadenza.node.core.config import SchedulerConfig
from cadenza.loadgen.trace import TraceRequest
from cadenza.control.decide import Decision, Shape, decide
from cadenza.control.history import AGGREGATE, DISAGGREGATE, History
from cadenza.control.loop import Evaluation
from cadenza.control.signals import Signals, read_signals
from cadenza.control.spec import ControllerSpec
from cadenza.sim.control import FleetActuation, FleetSource, sim_controller
from cadenza.sim.disagg import KVLinkModel, rule
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


def varied_trace(seconds: float, batch_every_s: float = 0.5) -> tuple[list[TraceRequest], list[str]]:
    """:func:`mixed_trace` with prompts of many lengths (chat 100-470 tokens, batch 1,000-6,600),
    so the engines' cost models fit their prefill terms apart and the selective rule finds a
    threshold between the two."""
    n, m = int(seconds * 10), int(seconds / batch_every_s)
    trace = [TraceRequest(0.1 * i, 100 + 37 * (i % 11), 100) for i in range(n)]
    trace += [TraceRequest(batch_every_s * i + 0.05, 1000 + 700 * (i % 9), 10) for i in range(m)]
    return trace, ["interactive"] * n + ["batch"] * m


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
    assert reshapes and reshapes[0].move == "dedicate" and _acts_as_decided(controller)[0] == "dedicate"
    assert reshapes[0].time_s >= 20  # the breach must hold at the bound for a slow window first
    assert simulated.roles() == {"interactive": ["a", "b"], "batch": ["a"]}
    batch_on_b = [t for rid, t in simulated.replicas["b"].times.items() if simulated.classes[rid] == "batch"]
    assert all(t.arrival_s < reshapes[0].time_s + controller.actuation.reshape_delay_s for t in batch_on_b)


def _acts_as_decided(controller) -> list[str]:
    """Every evaluation the simulated loop made is decide()'s on the same inputs, and every
    reshape it acted on is the shape of the next one; the moves made, in order."""
    decisions, moves = controller.actuation.decisions, []
    for now, signals, shape, knobs, before, spec, decision in decisions:
        assert decide(signals, shape, knobs, before, spec, now) == decision
    for (_t, _s, shape, *_, decision), later in zip(decisions, decisions[1:]):
        if decision.act and decision.action == "reshape":
            moves.append(decision.move)
            assert later.shape == shape.after(decision.move)
        elif decision.action != "retune":
            assert later.shape == shape
    return moves


def test_long_prompts_breaching_with_rung_1_exhausted_move_a_replica_to_prefill_as_decide_says():
    simulated = Fleet({"interactive": ["a", "b", "c"], "batch": ["a", "b", "c"]}, {n: CONFIG for n in "abc"}, MODEL,
                      link=KVLinkModel(5e10, 10e-6))
    spec = pool_spec(bounds={"chunkSize": {"min": 2048, "max": 2048}}, dwellSeconds=20)
    controller = sim_controller(spec, simulated, interval_s=5, scrape_delay_s=5, reshape_delay_s=5)
    trace, classes = varied_trace(120, batch_every_s=0.2)  # a long prompt's steps in most streams' p99
    simulated.run(trace, classes)
    moves = _acts_as_decided(controller)
    assert moves and moves[0] == DISAGGREGATE
    first = next(a for a in controller.actuation.actions if a.move == DISAGGREGATE)
    assert "long prompts" in first.reason and first.time_s >= 20  # a slow window at the bound first
    assert simulated.kv_transfer["moved"] > 0  # the prefill replica took long prompts


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


def test_the_windows_carry_the_pools_prefill_share_threshold_and_long_prompt_share():
    # no prefill replica: the threshold is still what the serving replicas' rules give on the link
    simulated = Fleet({"interactive": ["a", "b"], "batch": ["a", "b"]}, {"a": CONFIG, "b": CONFIG}, MODEL,
                      link=KVLinkModel(5e10, 10e-6))
    spec = pool_spec()
    source = FleetSource(simulated, spec, scrape_delay_s=5)
    seen = {}

    def record(f: Fleet) -> None:
        source.record(f.clock.now)
        stats = [r.scheduler.stats for r in f.replicas.values()]
        rules = [rule(r.scheduler.cost_model, f.link, f.bytes_per_token) for r in f.replicas.values()]
        seen[f.clock.now] = (sum(s.prefill_tokens_admitted for s in stats),
                             sum(s.prefill_tokens_admitted + s.decode_tokens for s in stats),
                             max(r.min_prompt_tokens(r.queue_s(0, 0.0)) for r in rules))

    for t in (10.0, 15.0, 20.0):
        simulated.at(t, record)
    trace, classes = varied_trace(20)
    simulated.run(trace, classes)
    fast = read_signals(source, 20.0, spec.slo, spec.fast_window_s, spec.slow_window_s, min_samples=spec.min_samples,
                        stale_s=spec.stale_s).fast
    (p0, t0, _), (p1, t1, _), (_, _, threshold) = seen[10.0], seen[15.0], seen[20.0]
    assert 470 < threshold < 6600  # some batch prompts would move to a prefill replica, chat's would not
    prompts = [r.input_len for r in trace if 10.0 < r.arrival_s <= 15.0]
    for cls in ("interactive", "batch"):  # pool-wide figures, on every class's window
        w = fast[cls]
        assert w.prefill_share == pytest.approx((p1 - p0) / (t1 - t0)) and 0 < w.prefill_share < 1
        assert w.min_prompt_tokens == threshold
        assert w.long_prompt_share == pytest.approx(sum(n for n in prompts if n >= threshold) / sum(prompts))
        assert 0 < w.long_prompt_share < 1


def _reshape(actuation: FleetActuation, move: str):
    """Have ``actuation`` carry out a reshape decided now (a decision made by hand)."""
    def act(f: Fleet) -> None:
        decision = Decision("reshape", f"test: {move}", True, History(), move=move)
        actuation.act(Evaluation(f.clock.now, Signals({}, {}), Shape(0), {}, History(), pool_spec(), decision))
    return act


def test_disaggregate_drains_a_colocated_replica_into_prefill_and_aggregate_brings_it_back():
    simulated = Fleet({"interactive": ["a", "b", "c"], "batch": ["a", "b", "c"]}, {n: CONFIG for n in "abc"}, MODEL,
                      link=KVLinkModel(5e10, 10e-6))
    prefill_knobs = {"chunk_size": 4096, "token_budget": 4096, "step_time_target_ms": None}
    actuation = FleetActuation(simulated, reshape_delay_s=2.0, prefill_knobs=prefill_knobs)
    simulated.reconfigure(["a", "b", "c"], {"chunk_size": 512})  # retuned knobs: what c must come back to
    seen: dict[float, tuple] = {}

    def look(f: Fleet) -> None:
        seen[f.clock.now] = (actuation.shape(f)[0], f.roles(), actuation.prepare(f.clock.now))

    simulated.at(10.0, _reshape(actuation, DISAGGREGATE))
    simulated.at(30.0, _reshape(actuation, AGGREGATE))
    for t in (11.0, 12.01, 25.0, 31.0, 32.01):
        simulated.at(t, look)
    trace, classes = varied_trace(40)
    result = simulated.run(trace, classes)
    assert result.dropped == 0 and result.by_class["batch"].requests == len(trace) // 6
    assert seen[11.0][0] == Shape(3) and seen[11.0][2] is None  # decided, not yet routed: nothing to decide
    shape, roles, prepared = seen[25.0]
    assert shape == Shape(2, 0, 1) and roles["prefill"] == ["c"] and "c" not in roles["batch"] + roles["interactive"]
    assert prepared is not None and prepared[0] == Shape(2, 0, 1)
    assert seen[31.0][0] == Shape(2, 0, 1) and seen[32.01][0] == Shape(3) and "prefill" not in seen[32.01][1]
    # from 12 s c took no request of its own until it came back; the long prompts then moved to it
    on_c = {rid: t for rid, t in simulated.replicas["c"].times.items() if not rid.endswith("/prefill")}
    assert on_c and not [t for t in on_c.values() if 12.0 <= t.arrival_s < 32.0]
    moved = [rid for rid in simulated.replicas["c"].times if rid.endswith("/prefill")]
    assert len(moved) == result.kv_transfer["moved"] >= 10
    assert all(classes[int(rid[1:].removesuffix("/prefill"))] == "batch" for rid in moved)
    # in the prefill role with its knobs; back with the colocated replicas' knobs
    assert simulated.replicas["c"].scheduler.config == simulated.replicas["a"].scheduler.config
    assert [(a.action, a.move, a.acted) for a in actuation.actions] == [("reshape", DISAGGREGATE, True),
                                                                        ("reshape", AGGREGATE, True)]


def test_a_replica_in_the_prefill_role_runs_the_prefill_knobs_and_the_last_colocated_one_stays():
    simulated = Fleet({"interactive": ["a", "b"], "batch": ["a", "b"]}, {n: CONFIG for n in "ab"}, MODEL)
    actuation = FleetActuation(simulated, reshape_delay_s=1.0,
                               prefill_knobs={"chunk_size": 4096, "token_budget": 4096, "step_time_target_ms": None})
    simulated.at(1.0, _reshape(actuation, DISAGGREGATE))
    # the last replica that decodes never moves to prefill: the pool cannot make that move, and drops it
    simulated.at(5.0, _reshape(actuation, DISAGGREGATE))
    simulated.run(*mixed_trace(10))
    config = simulated.replicas["b"].scheduler.config
    assert simulated.roles() == {"interactive": ["a"], "batch": ["a"], "prefill": ["b"]}
    assert (config.chunk_size, config.token_budget) == (4096, 4096) and actuation.moving is None
    assert [a.move for a in actuation.actions] == [DISAGGREGATE, DISAGGREGATE]
