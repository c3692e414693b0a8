"""decide(): the SLO controller's ladder on synthetic signal sequences, on a fake clock."""

from __future__ import annotations

import random

import pytest

from cadenza.control.decide import Shape, decide
from cadenza.control.history import DEDICATE, MERGE, History
from cadenza.control.spec import ControllerSpec
from cadenza.control.signals import ClassWindow, Signals

SLO = {"interactive": {"ttftP99Ms": 1000, "itlP99Ms": 100}, "batch": {"ttftP99Ms": 20000}}
EVERY_S = 15.0  # the operator's evaluation period


def spec(**controller) -> ControllerSpec:
    return ControllerSpec.from_pool_spec({"slo": SLO, "engine": {"chunkSize": 256, "tokenBudget": 512},
                                          "controller": controller})


def window(itl: float = 50, ttft: float = 400, requests: int = 500, known: bool = True, reason: str = "") -> ClassWindow:
    return ClassWindow(known, reason, requests, ttft, itl, 1.0 if known else None, 30)


def signals(itl: float = 50, slow_itl: float | None = None, batch_ttft: float = 5000, **kw) -> Signals:
    fast = {"interactive": window(itl, **kw), "batch": window(ttft=batch_ttft, itl=300)}
    slow = {"interactive": window(itl if slow_itl is None else slow_itl, **kw), "batch": window(ttft=batch_ttft, itl=300)}
    return Signals(fast, slow)


class Pool:
    """A pool that applies what decide() says, evaluated every EVERY_S seconds."""

    def __init__(self, controller: ControllerSpec, colocated: int = 3, now: float = 1_000_000.0) -> None:
        self.spec, self.now = controller, now
        self.shape = Shape(colocated, 0)
        self.knobs = {"chunk_size": 256, "token_budget": 512, "step_time_target_ms": None}
        self.history = History()
        self.decisions = []

    def step(self, sig: Signals):
        d = decide(sig, self.shape, self.knobs, self.history, self.spec, self.now)
        self.history = d.history
        self.decisions.append((self.now, d))
        if d.act and d.action == "retune":
            self.knobs = {**self.knobs, **d.knobs}
        if d.act and d.action == "reshape":
            delta = 1 if d.move == DEDICATE else -1
            self.shape = Shape(self.shape.colocated - delta, self.shape.interactive + delta)
        self.now += EVERY_S
        return d

    def run(self, seconds: float, sig) -> list:
        out = []
        end = self.now + seconds
        while self.now < end:
            out.append(self.step(sig(self) if callable(sig) else sig))
        return out

    def actions(self) -> list:
        return [(t, d) for t, d in self.decisions if d.act]


def test_within_slo_holds():
    pool = Pool(spec())
    assert all(d.action == "hold" for d in pool.run(1800, signals(itl=50)))
    assert pool.decisions[-1][1].slo_met == {"interactive": True, "batch": True}


def test_step_breach_retunes_first_then_reshapes_after_the_bound_held_a_slow_window():
    pool = Pool(spec())
    pool.run(1800, signals(itl=250))  # ITL 2.5x its target and staying there
    acts = pool.actions()
    kinds = [d.action for _, d in acts]
    assert kinds[:3] == ["retune"] * 3, kinds  # 256 -> 128 -> 64 -> 32, the bound
    assert pool.knobs["chunk_size"] == 32
    assert kinds[3] == "reshape" and acts[3][1].move == DEDICATE
    at_bound = acts[2][0]
    assert acts[3][0] - at_bound >= 300  # the bound held a slow window first
    # Retunes are spaced by at least a fast window (one action in flight).
    assert all(b[0] - a[0] >= 30 for a, b in zip(acts, acts[1:]))
    assert pool.decisions[-1][1].slo_met["interactive"] is False


def test_noise_around_the_target_yields_at_most_one_action_per_slow_window():
    rng = random.Random(7)

    def noisy(_pool):  # fast window within +-8 % of the target, slow window within +-3 %
        return signals(itl=100 * rng.uniform(0.92, 1.08), slow_itl=100 * rng.uniform(0.97, 1.03))

    pool = Pool(spec())
    pool.run(3600, noisy)
    times = [t for t, _ in pool.actions()]
    assert times, "a slow window over target is a breach; expected a first retune"
    assert all(b - a >= 300 for a, b in zip(times, times[1:])), times


@pytest.mark.parametrize("bad", [
    dict(known=False, reason="last scrape 90 s old"),
    dict(known=False, reason="42 requests < 200 needed"),
    dict(known=False, reason="a NaN in the latency series"),
])
def test_unknown_signals_hold(bad):
    pool = Pool(spec())
    for d in pool.run(900, signals(itl=400, **bad)):
        assert d.action == "hold" and "unknown" in d.reason
    assert pool.knobs["chunk_size"] == 256 and pool.shape == Shape(3, 0)
    assert pool.decisions[-1][1].slo_met["interactive"] is None


def test_missing_series_holds():
    pool = Pool(spec())
    d = pool.step(Signals({}, {}))
    assert d.action == "hold" and not d.act


def test_recovery_merges_back_only_after_the_dwell():
    pool = Pool(spec(cooldownSeconds=0))
    pool.run(600, signals(itl=250))
    assert pool.shape == Shape(2, 1)
    calm_from = pool.now
    pool.run(1200, signals(itl=40, batch_ttft=3000))  # every class well clear
    merges = [(t, d) for t, d in pool.actions() if d.move == MERGE]
    assert len(merges) == 1 and pool.shape == Shape(3, 0)
    assert merges[0][0] - calm_from >= 300  # dwell (defaults to the slow window)


def test_clear_but_inside_the_hysteresis_band_does_not_merge():
    pool = Pool(spec(cooldownSeconds=0))
    pool.run(600, signals(itl=250))
    pool.run(1800, signals(itl=95))  # under target, not under (1 - 0.1) x target
    assert pool.shape == Shape(2, 1)


def test_cooldown_survives_an_operator_restart():
    pool = Pool(spec(cooldownSeconds=1200))
    pool.run(600, signals(itl=250))
    assert pool.shape == Shape(2, 1)
    stored = pool.history.to_status()
    restarted = Pool(spec(cooldownSeconds=1200), now=pool.now)
    restarted.shape, restarted.knobs = pool.shape, pool.knobs
    restarted.history = History.from_status(stored)
    last = restarted.history.last_reshape
    assert last is not None and abs(last - pool.history.last_reshape) < 1
    restarted.run(1800, signals(itl=250))  # still breaching: a second dedicate waits for the cooldown
    dedicates = [t for t, d in restarted.actions() if d.move == DEDICATE]
    assert dedicates and dedicates[0] - last >= 1200


def test_two_reversals_freeze_reshaping_and_continue_in_advisory():
    pool = Pool(spec(cooldownSeconds=0, dwellSeconds=30))
    for _ in range(3):  # a breach, then calm, three times inside 30 minutes
        pool.run(420, signals(itl=250))
        pool.run(120, signals(itl=40, batch_ttft=3000))
    moves = [d.move for _, d in pool.actions() if d.action == "reshape"]
    assert moves == [DEDICATE, MERGE], moves  # the next one would have been the second reversal
    frozen = [d for _, d in pool.decisions if d.flapping]
    assert frozen and any(d.action == "reshape" and not d.act for d in frozen)
    assert "frozen" in frozen[0].reason


def test_advisory_never_acts_but_records():
    pool = Pool(spec(advisory=True))
    decisions = pool.run(1800, signals(itl=250))
    assert not any(d.act for d in decisions)
    assert pool.knobs["chunk_size"] == 256 and pool.shape == Shape(3, 0)
    assert any(e["action"] == "retune" and e["acted"] is False for e in pool.history.log)


def test_never_takes_the_last_replica_serving_batch():
    pool = Pool(spec(cooldownSeconds=0), colocated=1)
    pool.run(1800, signals(itl=250))
    assert pool.shape == Shape(1, 0)
    assert "last colocated replica" in pool.decisions[-1][1].reason


def test_last_replica_may_go_when_batch_has_no_traffic():
    idle = {"interactive": window(itl=250), "batch": window(requests=0), "background": window(requests=0)}
    idle_batch = Signals(idle, idle)
    pool = Pool(spec(cooldownSeconds=0), colocated=1)
    pool.run(1800, idle_batch)
    assert pool.shape == Shape(0, 1)


def test_grows_prefill_back_when_interactive_is_roomy_and_batch_ttft_breaches():
    pool = Pool(spec())
    pool.knobs["chunk_size"] = 32
    pool.run(600, signals(itl=40, batch_ttft=30000))
    assert pool.knobs["chunk_size"] == 256
    assert all(d.action == "retune" for _, d in pool.actions())


def test_bounds_from_the_spec_move_the_other_knobs():
    s = spec(bounds={"tokenBudget": {"min": 256, "max": 512}, "stepTimeTargetMs": {"min": 50, "max": 400}})
    pool = Pool(s)
    pool.run(20, signals(itl=250))  # one retune
    knobs = pool.knobs
    assert knobs["token_budget"] == 256 and knobs["step_time_target_ms"] == 200.0 and knobs["chunk_size"] == 128
    assert knobs["chunk_size"] <= knobs["token_budget"]


def test_history_from_garbage_status_is_empty():
    h = History.from_status({"lastAction": "yesterday", "reshapes": [1, {"time": "x"}], "decisions": "no"})
    assert h == History()


@pytest.mark.parametrize("junk", ["junk", [1], {"reshapes": 5, "decisions": 5}, {"lastAction": 1e20},
                                  {"lastAction": float("nan"), "frozenUntil": True}])
def test_history_from_junk_of_any_type_is_empty(junk):
    h = History.from_status(junk)
    assert h == History() and h.to_status() == {}


def test_a_time_from_the_future_delays_at_most_one_window():
    pool = Pool(spec())
    pool.history = History.from_status({"lastAction": "9999-12-31T23:59:59Z", "lastRetune": "9999-12-31T23:59:59Z"})
    assert pool.step(signals(itl=250)).action == "hold"  # observing "the last action": now, not in 9999
    pool.run(30, signals(itl=250))
    assert [d.action for _, d in pool.actions()] == ["retune"]


def test_no_merge_back_while_the_fast_window_breaches_again():
    pool = Pool(spec(cooldownSeconds=0))
    pool.run(600, signals(itl=250))
    assert pool.shape == Shape(2, 1)
    pool.run(1200, signals(itl=250, slow_itl=40, batch_ttft=3000))  # slow clear, fast breaching
    assert pool.shape == Shape(2, 1)
