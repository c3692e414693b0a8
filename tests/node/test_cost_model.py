"""The step-time cost model: online least squares, its reported error, and chunk sizing."""

from __future__ import annotations

import random

import pytest

from cadenza.node.core.cost_model import StepCostModel, StepFeatures

TRUE = (0.003, 2e-5, 3e-4, 1e-7, 4e-9)  # seconds: fixed, per prefill token, per decode, per context, per pair


def true_time(f: StepFeatures) -> float:
    return sum(c * x for c, x in zip(TRUE, f.vector()))


def random_step(rng: random.Random) -> StepFeatures:
    prefill = rng.choice([0, rng.randint(1, 2048)])
    decodes = rng.randint(0, 64)
    start = rng.randint(0, 4000)
    return StepFeatures(prefill, decodes, decodes * rng.randint(10, 3000), prefill * (start + prefill / 2))


def test_not_ready_before_enough_steps():
    model = StepCostModel()
    assert not model.ready and model.predict(StepFeatures(10, 1, 10, 50.0)) is None
    assert model.max_chunk(1.0, 0) == 0


def test_it_recovers_a_linear_cost_and_reports_a_small_error():
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(200):
        f = random_step(rng)
        model.observe(f, true_time(f))
    assert model.ready
    probe = StepFeatures(512, 32, 32 * 1000, 512 * (1000 + 256))
    assert model.predict(probe) == pytest.approx(true_time(probe), rel=0.01)
    assert model.mean_relative_error < 0.02


def test_the_reported_error_tracks_noise():
    rng = random.Random(1)
    model = StepCostModel()
    for _ in range(300):
        f = random_step(rng)
        model.observe(f, true_time(f) * rng.uniform(0.8, 1.2))
    assert 0.05 < model.mean_relative_error < 0.2


def test_max_chunk_fills_the_time_left_exactly():
    rng = random.Random(2)
    model = StepCostModel()
    for _ in range(200):
        f = random_step(rng)
        model.observe(f, true_time(f))
    for context in (0, 1000, 6000):
        n = model.max_chunk(0.02, context)
        assert model.chunk_cost(n, context) <= 0.02 < model.chunk_cost(n + 2, context)
