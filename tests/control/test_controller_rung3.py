"""decide()'s third rung: disaggregating (a colocated replica into the prefill role) when prefill
interference comes from long prompts, dedicating when it comes from load, and giving back in
order, on synthetic signals and a fake clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cadenza.control.decide import Shape, decide
from cadenza.control.history import AGGREGATE, DEDICATE, DISAGGREGATE, MERGE, History
from cadenza.control.moves import LONG_PROMPTS, PREFILL_DOMINANT, give_back, split
from cadenza.control.signals import ClassWindow, Signals
from cadenza.control.spec import ControllerSpec

SLO = {"interactive": {"ttftP99Ms": 1000, "itlP99Ms": 100}, "batch": {"ttftP99Ms": 20000}}
EVERY_S = 15.0
LONG = dict(prefill_share=0.8, long_prompt_share=0.5, min_prompt_tokens=2048.0)  # long prompts interfere
LOAD = dict(prefill_share=0.3, long_prompt_share=0.1, min_prompt_tokens=2048.0, queue_depth=5)  # short, many
GONE = dict(prefill_share=0.3, long_prompt_share=0.1, min_prompt_tokens=2048.0)  # long prompts have gone
STAY = dict(prefill_share=0.8, long_prompt_share=0.5, min_prompt_tokens=2048.0)  # long prompts still there
def spec(**controller) -> ControllerSpec:
    return ControllerSpec.from_pool_spec({"slo": SLO, "engine": {"chunkSize": 256, "tokenBudget": 512},
                                          "controller": controller})


def window(itl: float = 50, ttft: float = 400, requests: int = 500, known: bool = True, **figures) -> ClassWindow:
    return ClassWindow(known, "" if known else "last scrape 90 s old", requests, ttft, itl, 1.0 if known else None,
                       30, **figures)


def signals(itl: float = 50, batch_requests: int = 500, batch_ttft: float = 5000, known: bool = True,
            **figures) -> Signals:
    def one() -> dict:
        batch = window(ttft=batch_ttft, itl=300, requests=batch_requests, **figures)
        idle = window(requests=batch_requests, **figures)
        return {"interactive": window(itl, known=known, **figures), "batch": batch, "background": idle}

    return Signals(one(), one())


class Pool:
    """A pool that applies every move decide() makes, evaluated every EVERY_S seconds."""

    def __init__(self, controller: ControllerSpec, shape: Shape | None = None, *, at_bound: bool = False,
                 now: float = 1_000_000.0) -> None:
        self.spec, self.shape, self.now = controller, shape or Shape(3), now
        chunk = 32 if at_bound else 256  # rung 1 exhausted already, or not
        self.knobs = {"chunk_size": chunk, "token_budget": 512, "step_time_target_ms": None}
        self.history = History()
        self.decisions = []

    def step(self, sig: Signals):
        d = decide(sig, self.shape, self.knobs, self.history, self.spec, self.now)
        self.history = d.history
        self.decisions.append((self.now, d))
        if d.act and d.action == "retune":
            self.knobs = {**self.knobs, **d.knobs}
        if d.act and d.action == "reshape":
            self.shape = self.shape.after(d.move)
            assert min(self.shape.colocated, self.shape.interactive, self.shape.prefill) >= 0, self.shape
        self.now += EVERY_S
        return d

    def run(self, seconds: float, sig: Signals) -> list:
        out = []
        end = self.now + seconds
        while self.now < end:
            out.append(self.step(sig))
        return out

    def moves(self) -> list:
        return [(t, d) for t, d in self.decisions if d.act and d.action == "reshape"]


# -- the choice: long prompts or load -----------------------------------------------------------


def test_long_prompts_disaggregate_after_retuning_held_a_slow_window():
    pool = Pool(spec())
    pool.run(900, signals(itl=250, **LONG))
    acts = [(t, d) for t, d in pool.decisions if d.act]
    assert [d.action for _, d in acts[:3]] == ["retune"] * 3  # rung 1 first, down to its bound
    (t, first), = pool.moves()[:1]
    assert first.move == DISAGGREGATE and pool.shape.prefill >= 1
    assert t - acts[2][0] >= 300  # rung 1 sat at its bound for a slow window first
    for figure in ("long prompts", "prefill 80% of computed tokens", "50% of prompt tokens", ">= 2048 tokens"):
        assert figure in first.reason, first.reason


def test_load_dedicates_and_says_it_is_load():
    pool = Pool(spec(), at_bound=True)
    pool.run(330, signals(itl=250, **LOAD))
    (_, d), = pool.moves()
    assert d.move == DEDICATE and pool.shape == Shape(2, 1, 0)
    assert "interference from load" in d.reason and "queue 5" in d.reason and "prefill 30%" in d.reason


def test_prefill_dominant_without_long_prompts_is_load():
    pool = Pool(spec(), at_bound=True)
    pool.run(330, signals(itl=250, prefill_share=0.9, long_prompt_share=0.05, min_prompt_tokens=4096.0))
    assert [d.move for _, d in pool.moves()] == [DEDICATE]


def test_kv_bound_breach_is_load():
    pool = Pool(spec())
    pool.run(330, signals(itl=250, kv_usage=0.99, **LOAD | {"prefill_share": 0.8, "long_prompt_share": 0.5}))
    (_, d), = pool.moves()
    assert d.move == DEDICATE and "KV full" in d.reason


def test_unknown_latency_holds_whatever_the_prefill_figures_say():
    pool = Pool(spec(), at_bound=True)
    decisions = pool.run(900, signals(itl=250, known=False, **LONG))
    assert all(d.action == "hold" and not d.act and "unknown" in d.reason for d in decisions)
    assert pool.shape == Shape(3)


@pytest.mark.parametrize("missing", ["prefill_share", "long_prompt_share", "min_prompt_tokens"])
def test_unknown_attribution_dedicates_and_says_so(missing):
    pool = Pool(spec(), at_bound=True)
    pool.run(330, signals(itl=250, **LONG | {missing: None}))
    (_, d), = pool.moves()
    assert d.move == DEDICATE and "could not be attributed" in d.reason and "unknown" in d.reason


def test_rung_3_off_dedicates_and_says_why():
    pool = Pool(spec(disaggregate=False), at_bound=True)
    pool.run(330, signals(itl=250, **LONG))
    (_, d), = pool.moves()
    assert d.move == DEDICATE and "disaggregate is false" in d.reason


def test_still_breaching_long_prompts_disaggregate_again_and_load_dedicates():
    pool = Pool(spec(cooldownSeconds=0), Shape(3), at_bound=True)
    pool.run(330, signals(itl=250, **LONG))
    assert pool.shape == Shape(2, 0, 1)
    pool.run(330, signals(itl=250, **LONG))  # one more slow window at the bound: another
    assert pool.shape == Shape(1, 0, 2)
    pool = Pool(spec(cooldownSeconds=0), Shape(2, 0, 1), at_bound=True)
    pool.run(330, signals(itl=250, **LOAD))
    assert pool.shape == Shape(1, 1, 1)


def test_split_thresholds_are_inclusive():
    at = ClassWindow(True, prefill_share=PREFILL_DOMINANT, long_prompt_share=LONG_PROMPTS, min_prompt_tokens=512)
    assert split(at, kv_bound=False, disaggregate=True)[0] == DISAGGREGATE
    below = replace(at, long_prompt_share=LONG_PROMPTS - 0.01)
    assert split(below, kv_bound=False, disaggregate=True)[0] == DEDICATE


def test_a_ttft_breach_with_long_prompts_disaggregates():
    # A prefill replica at its bulk budget prefills interactive's own long prompts too, which a
    # small colocated budget starves: in the simulator's day, reading this (TTFT 5.5 s, queue
    # 70, ITL fine, long prompts) as load and dedicating held the SLO in 65 % of windows against
    # 85 % for disaggregating (docs/benchmarks.md, issue 31).
    peak = dict(LONG, queue_depth=70)
    pool = Pool(spec(), at_bound=True)
    pool.run(330, Signals(*({"interactive": window(itl=50, ttft=5500, **peak),
                             "batch": window(ttft=5000, itl=300, **peak),
                             "background": window(**peak)} for _ in range(2))))
    (_, d), = pool.moves()
    assert d.move == DISAGGREGATE and pool.shape == Shape(2, 0, 1)
    assert "TTFT p99 5500 ms > 1000 ms" in d.reason and "long prompts" in d.reason


# -- no class left without a replica --------------------------------------------------------------


def test_two_replica_pool_keeps_its_colocated_replica_for_batch():
    pool = Pool(spec(cooldownSeconds=0), Shape(2), at_bound=True)
    pool.run(1800, signals(itl=250, **LONG))
    assert pool.shape == Shape(1, 0, 1)  # one disaggregated, the last colocated one stays
    assert "last colocated replica serves batch/background" in pool.decisions[-1][1].reason


def test_one_colocated_and_one_prefill_hold_under_load_while_long_prompts_stay():
    pool = Pool(spec(cooldownSeconds=0), Shape(1, 0, 1), at_bound=True)
    pool.run(900, signals(itl=250, **{**LOAD, "long_prompt_share": 0.5}))
    assert pool.shape == Shape(1, 0, 1) and not pool.moves()
    assert "the last colocated replica serves batch" in pool.decisions[-1][1].reason


def test_an_idle_prefill_replica_comes_back_when_load_breaches_and_nothing_else_can_move():
    # (1, 0, 1) with the long prompts gone and interactive breaching from load: dedicating the
    # last colocated replica is blocked, a give-back waits for every class to be clear — so the
    # prefill replica, prefilling little, comes back to decode; then, load still breaching, the
    # ladder dedicates as usual.
    pool = Pool(spec(cooldownSeconds=0), Shape(1, 0, 1), at_bound=True)
    pool.run(900, signals(itl=250, **LOAD))
    assert [d.move for _, d in pool.moves()] == [AGGREGATE, DEDICATE]
    assert pool.shape == Shape(1, 1, 0)
    assert "giving one prefill replica back to colocated" in pool.moves()[0][1].reason


def test_interactive_keeps_a_replica_that_decodes_even_when_batch_is_idle():
    pool = Pool(spec(cooldownSeconds=0), Shape(1, 0, 1), at_bound=True)
    pool.run(900, signals(itl=250, batch_requests=0, **LONG))
    assert pool.shape == Shape(1, 0, 1)
    assert "no replica that decodes" in pool.decisions[-1][1].reason
    pool = Pool(spec(cooldownSeconds=0), Shape(1, 1, 0), at_bound=True)  # an interactive replica decodes
    pool.run(330, signals(itl=250, batch_requests=0, **LONG))
    assert pool.shape == Shape(0, 1, 1)


def test_no_colocated_replica_left_holds():
    pool = Pool(spec(cooldownSeconds=0), Shape(0, 1, 1), at_bound=True)
    pool.run(600, signals(itl=250, batch_requests=0, **LONG))
    assert pool.shape == Shape(0, 1, 1) and "no colocated replica" in pool.decisions[-1][1].reason


# -- giving back --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape, figures, first", [
    (Shape(1, 1, 1), GONE, AGGREGATE),  # long prompts gone: the prefill replica first
    (Shape(1, 1, 1), STAY, MERGE),  # long prompts still there: the interactive one first
    (Shape(1, 1, 1), {}, MERGE),  # unknown: the prefill replica's cause may be there
    (Shape(2, 0, 1), GONE, AGGREGATE),  # nothing else to give back, its long prompts gone
    (Shape(2, 0, 1), {}, AGGREGATE),  # nothing else, its cause unknown: back to the default shape
    (Shape(2, 1, 0), GONE, MERGE),
])
def test_give_back_order(shape, figures, first):
    pool = Pool(spec(), shape)
    calm = signals(itl=40, batch_ttft=3000, **figures)
    pool.run(600, calm)
    moves = [d.move for _, d in pool.moves()]
    assert moves[:1] == [first], moves
    assert pool.moves()[0][0] - pool.decisions[0][0] >= 300  # after the dwell


def test_a_prefill_replica_is_kept_while_its_long_prompts_stay_and_given_back_once_they_go():
    # Given back while its long prompts stay, the interference it removed would return: the pool
    # would cycle disaggregate -> clear -> aggregate -> breach -> disaggregate.
    pool = Pool(spec(cooldownSeconds=0), Shape(2, 0, 1))
    pool.run(1200, signals(itl=40, batch_ttft=3000, **STAY))
    assert pool.shape == Shape(2, 0, 1) and not pool.moves()
    last = pool.decisions[-1][1]
    assert last.action == "hold" and "50% of prompt tokens still in long prompts" in last.reason
    assert "keeping the prefill replica" in last.reason
    pool.run(600, signals(itl=40, batch_ttft=3000, **GONE))
    assert [d.move for _, d in pool.moves()] == [AGGREGATE] and pool.shape == Shape(3)
    assert give_back(Shape(2, 0, 1), ClassWindow(True, long_prompt_share=0.5), hysteresis=0.1)[0] is None


def test_give_back_keeps_the_hysteresis_band_on_the_long_prompt_share():
    just_under = ClassWindow(True, long_prompt_share=LONG_PROMPTS * 0.95)  # under the threshold, not the band
    assert give_back(Shape(1, 1, 1), just_under, hysteresis=0.1)[0] == MERGE
    assert give_back(Shape(1, 1, 1), replace(just_under, long_prompt_share=0.2), hysteresis=0.1)[0] == AGGREGATE
    with pytest.raises(ValueError):
        give_back(Shape(3), just_under, hysteresis=0.1)


def test_whole_ladder_back_to_colocated():
    pool = Pool(spec(cooldownSeconds=0), Shape(3), at_bound=True)
    pool.run(330, signals(itl=250, **LONG))
    pool.run(330, signals(itl=250, **LOAD))
    assert pool.shape == Shape(1, 1, 1)
    pool.run(1200, signals(itl=40, batch_ttft=3000, **GONE))
    assert pool.shape == Shape(3) and [d.move for _, d in pool.moves()] == [DISAGGREGATE, DEDICATE, AGGREGATE, MERGE]


# -- the guards: flap, advisory, cooldown ---------------------------------------------------------


def test_second_reversal_across_rungs_freezes():
    pool = Pool(spec(cooldownSeconds=0), Shape(2, 0, 1), at_bound=True)  # a prefill replica from long ago
    pool.run(330, signals(itl=250, **LOAD))  # load: dedicate
    pool.run(330, signals(itl=40, batch_ttft=3000, **GONE))  # clear, long prompts gone: aggregate
    assert [d.move for _, d in pool.moves()] == [DEDICATE, AGGREGATE] and pool.shape == Shape(2, 1, 0)
    pool.run(600, signals(itl=250, **LONG))  # long prompts: disaggregating would be the second reversal
    assert pool.shape == Shape(2, 1, 0) and len(pool.moves()) == 2
    frozen = [d for _, d in pool.decisions if d.flapping]
    assert frozen[0].action == "reshape" and frozen[0].move == DISAGGREGATE and not frozen[0].act
    assert "second reversal" in frozen[0].reason and pool.decisions[-1][1].flapping


def test_two_splits_in_a_row_are_no_reversal():
    pool = Pool(spec(cooldownSeconds=0), Shape(2, 1, 1), at_bound=True)
    pool.history = History(reshapes=((pool.now - 600, DISAGGREGATE), (pool.now - 300, DEDICATE)))
    pool.run(330, signals(itl=250, **LONG))
    assert [d.move for _, d in pool.moves()] == [DISAGGREGATE] and pool.shape == Shape(1, 1, 2)


def test_advisory_records_a_disaggregate_without_acting():
    pool = Pool(spec(advisory=True), at_bound=True)
    decisions = pool.run(600, signals(itl=250, **LONG))
    assert not any(d.act for d in decisions) and pool.shape == Shape(3)
    advised = [e for e in pool.history.log if e.get("move") == DISAGGREGATE]
    assert advised and advised[0]["acted"] is False and "long prompts" in advised[0]["reason"]


def test_cooldown_spaces_disaggregates():
    pool = Pool(spec(cooldownSeconds=1200), Shape(4), at_bound=True)
    pool.run(1800, signals(itl=250, **LONG))
    times = [t for t, _ in pool.moves()]
    assert [d.move for _, d in pool.moves()] == [DISAGGREGATE, DISAGGREGATE]
    assert times[1] - times[0] >= 1200
    held = [d for _, d in pool.decisions if "cooldown" in d.reason]
    assert held and all(d.action == "hold" for d in held)
