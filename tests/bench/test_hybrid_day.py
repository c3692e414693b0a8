"""The local compressed-day benchmark's pure parts (``bench/hybrid_day.py``, ``bench/pool_runs.py``):
every shape it runs is a pool ``cadenza up`` accepts, with the split its name says; the day is the
same from the same seed; the best static shape is chosen by the stated rule; windows are judged
and batch throughput counted as documented. Its quick run is smoke-tested in
``test_quick_servers.py``."""

from __future__ import annotations

import sys

import pytest

from bench_scripts import ROOT

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.hybrid_day import FULL, QUICK, QUICK_SHAPES, best_static, pool_doc, workload  # noqa: E402
from bench.pool_runs import Result, Run, summarize  # noqa: E402
from cadenza.pool.spec import Pool  # noqa: E402
from cadenza.pool.validate import validate_pool  # noqa: E402

EXPECTED_ROLES = {
    "colocated:32": {"colocated": 3}, "colocated:256": {"colocated": 3},
    "dedicated:1+2": {"interactive": 1, "batch": 2}, "dedicated:2+1": {"interactive": 2, "batch": 1},
    "disaggregated:1": {"prefill": 1, "decode": 2}, "disaggregated:2": {"prefill": 2, "decode": 1},
    "auto": {"auto": 3},
}


@pytest.mark.parametrize("name", FULL.shapes())
def test_every_shape_is_a_valid_pool_with_the_split_its_name_says(name):
    doc = validate_pool(pool_doc(name, FULL))
    roles = Pool(doc["metadata"]["name"], "default", doc["spec"]).roles()
    assert {r.name: r.replicas for r in roles} == EXPECTED_ROLES[name]


@pytest.mark.parametrize("name", QUICK_SHAPES)
def test_the_quick_shapes_are_valid_pools_of_the_tiny_model(name):
    doc = validate_pool(pool_doc(name, QUICK))
    Pool(doc["metadata"]["name"], "default", doc["spec"]).roles()


def test_an_unknown_shape_is_refused():
    for name in ("colocated", "dedicated:1+1", "hybrid:1", "auto:2"):
        with pytest.raises(ValueError):
            pool_doc(name, FULL)


def test_the_day_is_the_same_from_the_same_seed_and_fits_the_model():
    from bench.common import quick_model

    model = quick_model()
    jobs, day = workload(model, QUICK, seed=3)
    again, _ = workload(model, QUICK, seed=3)
    other, _ = workload(model, QUICK, seed=4)
    assert [(j.at, j.cls, j.prompt, j.max_tokens) for j in jobs] == [(j.at, j.cls, j.prompt, j.max_tokens)
                                                                      for j in again]
    assert [j.at for j in jobs] != [j.at for j in other]
    assert {j.cls for j in jobs} == {"interactive", "batch"}
    assert all(len(j.prompt) + j.max_tokens <= QUICK.max_model_len for j in jobs)
    assert all(QUICK.min_output <= j.max_tokens <= QUICK.output_cap for j in jobs)
    assert day.recipe.duration_s == QUICK.duration_s


def test_the_best_static_shape_holds_the_most_windows_then_has_the_most_batch():
    runs = {"colocated:256": {"slo_windows": 5, "batch_output_tokens_per_s": 9.0},
            "dedicated:2+1": {"slo_windows": 8, "batch_output_tokens_per_s": 3.0},
            "dedicated:1+2": {"slo_windows": 8, "batch_output_tokens_per_s": 4.0},
            "auto": {"slo_windows": 9, "batch_output_tokens_per_s": 6.0}}
    assert best_static(runs) == "dedicated:1+2"
    assert best_static({"auto": runs["auto"]}) is None


def test_windows_are_judged_from_enough_requests_and_cut_batch_counts_its_tokens():
    t0 = 100.0
    results = [Result("interactive", t0 + 1, ttft=0.5, gaps=[0.1, 0.2], tokens=3, end=t0 + 2),
               Result("interactive", t0 + 2, ttft=5.0, gaps=[0.1], tokens=2, end=t0 + 8),
               Result("interactive", t0 + 12, ttft=0.3, gaps=[0.1], tokens=2, end=t0 + 13),
               Result("batch", t0 + 1, ttft=2.0, gaps=[0.5] * 9, tokens=10, end=t0 + 19, cut=True),
               Result("batch", t0 + 3, error="HTTP 429")]
    slo = {"interactive": {"ttftP99Ms": 4000, "itlP99Ms": 600}, "batch": {"ttftP99Ms": 60000}}
    out = summarize("x", Run(results, t0, 0.0, []), slo=slo, duration_s=20.0, window_s=10.0, min_window_requests=2,
                    batch_over_s=20.0)
    assert [w["requests"] for w in out["windows"]] == [2, 1]
    assert [w["slo_met"] for w in out["windows"]] == [False, None]  # a 5 s TTFT; one request: not judged
    assert out["windows_judged"] == 1 and out["slo_windows_share"] == 0.0
    assert out["batch_output_tokens_per_s"] == 0.5  # the cut request's 10 tokens over the 20 s day
    assert out["failed"] == 1
