"""The compressed day: a diurnal interactive rate with bursts, batch phased against it with longer
prompts in its phase, drawn from the Azure traces and reproducible from a seed."""

from __future__ import annotations

import numpy as np
import pytest

from cadenza.loadgen.day import Burst, Day, DayRecipe
from cadenza.loadgen.trace import TraceRequest

CONV = [TraceRequest(0.1 * i, 200 + 10 * (i % 50), 100 + (i % 30)) for i in range(500)]
CODE = [TraceRequest(0.1 * i, 2000 + 20 * (i % 40), 20 + (i % 9)) for i in range(300)]
QUIET = DayRecipe(duration_s=2400.0, peak_rps=20.0, peak_to_trough=4.0, peak_hour=12.0, burst_every_s=0,
                  batch_rps=10.0, batch_floor=0.2, batch_prompt_scale=2.0)


def _in(trace: list[TraceRequest], cls: str, start: float, end: float) -> list[TraceRequest]:
    return [r for r in trace if r.traffic_class == cls and start <= r.arrival_s < end]


def test_the_same_seed_gives_the_same_day_and_another_seed_another():
    day = Day(DayRecipe(duration_s=600.0, burst_every_s=100.0), seed=7)
    first = day.trace(CONV, CODE)
    assert first == day.trace(CONV, CODE) == Day(DayRecipe(duration_s=600.0, burst_every_s=100.0), 7).trace(CONV, CODE)
    assert day.bursts == Day(DayRecipe(duration_s=600.0, burst_every_s=100.0), 7).bursts
    assert first != Day(DayRecipe(duration_s=600.0, burst_every_s=100.0), 8).trace(CONV, CODE)
    assert [r.arrival_s for r in first] == sorted(r.arrival_s for r in first)


def test_interactive_follows_the_diurnal_curve_and_batch_runs_against_it():
    trace = Day(QUIET, seed=1).trace(CONV, CODE)
    # the day is 2,400 s for 24 h: the trough at hour 0 (t = 0 and 2,400), the peak at hour 12 (1,200 s)
    peak_i, trough_i = len(_in(trace, "interactive", 1100, 1300)), len(_in(trace, "interactive", 0, 100))
    peak_i_rate, trough_i_rate = peak_i / 200, (trough_i + len(_in(trace, "interactive", 2300, 2400))) / 200
    assert peak_i_rate == pytest.approx(20.0 * 0.98, rel=0.1)  # s(t) is ~0.98 on average over those 200 s
    assert trough_i_rate == pytest.approx(5.0 * 1.03, rel=0.15)
    assert peak_i_rate / trough_i_rate >= 3
    peak_b = _in(trace, "batch", 1100, 1300)
    trough_b = _in(trace, "batch", 0, 100) + _in(trace, "batch", 2300, 2400)
    assert len(trough_b) / 200 == pytest.approx(10.0, rel=0.15) and len(peak_b) / 200 == pytest.approx(2.0, rel=0.3)
    # longer batch prompts in the batch phase: twice the recorded ones at the trough, as recorded at the peak
    recorded = np.mean([r.input_len for r in CODE])
    assert np.mean([r.input_len for r in trough_b]) == pytest.approx(2 * recorded, rel=0.05)
    assert np.mean([r.input_len for r in peak_b]) == pytest.approx(recorded, rel=0.05)
    assert {(r.traffic_class, r.tenant) for r in trace} == {("interactive", "chat"), ("batch", "code")}
    # lengths are the traces' own (interactive as recorded)
    assert {(r.input_len, r.output_len) for r in trace if r.traffic_class == "interactive"} <= {
        (r.input_len, r.output_len) for r in CONV}


def test_a_burst_multiplies_the_interactive_rate_for_its_length():
    day = Day(QUIET, seed=3)
    burst = Burst(1500.0, 1620.0, 1.8)
    assert day.burst([1499.0, 1500.0, 1600.0, 1620.0]).tolist() == [1.0, 1.0, 1.0, 1.0]  # none drawn
    day.bursts = [burst, Burst(1550.0, 1560.0, 1.2)]  # overlaps take the larger
    assert day.burst([1499.0, 1500.0, 1555.0, 1619.9, 1620.0]).tolist() == [1.0, 1.8, 1.8, 1.8, 1.0]
    inside, before = _in(day.trace(CONV, CODE), "interactive", 1500, 1620), day.interactive_rps(1500.0) / 1.8
    assert len(inside) / 120 == pytest.approx(1.8 * before, rel=0.15)


def test_bursts_come_at_the_recipes_mean_gap_with_lengths_and_factors_in_range():
    recipe = DayRecipe(duration_s=36000.0, burst_every_s=600.0, burst_s=(60.0, 180.0), burst_factor=(1.5, 2.5))
    bursts = Day(recipe, seed=0).bursts
    assert len(bursts) == pytest.approx(60, rel=0.3)
    assert all(60 <= b.end_s - b.start_s <= 180 and 1.5 <= b.factor <= 2.5 for b in bursts if b.end_s < 36000)


def test_prompt_and_output_fit_the_model_length():
    long = [TraceRequest(0.0, 15000, 2000)]
    trace = Day(DayRecipe(duration_s=60.0, batch_prompt_scale=3.0, max_model_len=16384), seed=0).trace(long, long)
    assert trace and all(r.input_len + r.output_len <= 16384 and r.input_len >= 1 for r in trace)


@pytest.mark.parametrize("bad", [dict(duration_s=0), dict(peak_to_trough=0.5), dict(burst_s=(10.0, 5.0)),
                                 dict(burst_factor=(0.5, 1.0)), dict(batch_floor=1.5), dict(batch_prompt_scale=0.5),
                                 dict(peak_hour=25)])
def test_a_recipe_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        DayRecipe(**bad)


def test_a_day_needs_both_traces():
    with pytest.raises(ValueError, match="both traces"):
        Day(DayRecipe(duration_s=60.0), 0).trace(CONV, [])
