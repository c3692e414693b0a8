"""The ``h200-graphs`` profile: a runner that replays CUDA graphs for decode steps and for steps with
one bounded prefill chunk, its host time a projection from the measured H200 table until a table
taken with graphs on fits it (``cadenza sim calibrate --dispatch-only --base h200-graphs``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from cadenza.node.cli import main
from cadenza.sim.calibrate import MeasuredStep, load_step_table, solve_relative
from cadenza.sim.dispatch import fit_graph_replay
from cadenza.sim.hardware import (
    GRAPH_INPUT_COPY_S,
    GRAPH_LAUNCH_S,
    GRAPH_MAX_PREFILL_TOKENS,
    GRAPH_SAMPLING_SYNC_S,
    H200_EAGER_DISPATCH_PER_ROW_S,
    H200_GRAPH_PER_ROW_S,
    H200_GRAPH_PER_STEP_S,
    H200_RUNNER_PYTHON_PER_STEP_S,
    PROFILE_BASIS,
    PROFILES,
    HardwareProfile,
    ProfileError,
    load_profile,
)
from cadenza.sim.model_dims import load_model_dims
from cadenza.sim.roofline import Roofline, StepComposition, replays_graph

H200_8B = Path(__file__).resolve().parents[2] / "data" / "gpu" / "h200" / "steps-llama-3.1-8b.jsonl"
DIMS = load_model_dims("llama-3.1-8b")


def decode(rows: int, context: int = 1024) -> StepComposition:
    return StepComposition(decode_tokens=rows, decode_context_tokens=rows * context, num_rows=rows, num_sampled=rows)


def mixed(rows: int, *chunks: int) -> StepComposition:
    """``rows`` decodes and one prefill row per chunk (each from the prompt's start, each sampling)."""
    return StepComposition(prefill_tokens=sum(chunks), decode_tokens=rows, decode_context_tokens=rows * 1024,
                           prefill_attention_tokens=sum(n * n / 2 for n in chunks), num_rows=rows + len(chunks),
                           num_sampled=rows + len(chunks))


def test_a_graphed_decode_step_costs_the_device_and_the_replay_not_the_eager_dispatch():
    graphs, eager, ideal = (Roofline(DIMS, PROFILES[p]) for p in ("h200-graphs", "h200", "h200-roofline"))
    one = decode(1)
    t = graphs.step_time(one)
    assert t.dispatch_s == 0 and t.replay_s == pytest.approx(H200_GRAPH_PER_STEP_S + H200_GRAPH_PER_ROW_S)
    assert t.device_s == pytest.approx(ideal.step_time(one).device_s)  # the same device
    assert t.runner_s == pytest.approx(t.device_s + t.replay_s)  # serial: inputs before the launch, tokens after
    assert t.runner_s <= 1.3 * ideal.step_time(one).device_s
    assert t.runner_s < 0.5 * eager.step_time(one).runner_s  # ~5.6 ms against ~12.3 ms
    for rows in (8, 32, 128):  # the host's per-row work stays, serial, but under the eager dispatch
        assert ideal.step_time(decode(rows)).runner_s < graphs.step_time(decode(rows)).runner_s \
            < eager.step_time(decode(rows)).runner_s


@pytest.mark.parametrize("step, graphed", [
    (decode(64), True),
    (mixed(31, GRAPH_MAX_PREFILL_TOKENS), True),  # one chunk at the bound
    (mixed(0, 200), True),
    (mixed(31, GRAPH_MAX_PREFILL_TOKENS + 1), False),  # one chunk past it
    (mixed(8, 100, 100), False),  # two chunks
    (mixed(0, 2048), False),  # a long chunk
    (mixed(5, 1024, 1019), False),
    (decode(256), True),
    (decode(257), False),  # past the engine's largest decode graph
])
def test_only_decode_steps_and_steps_with_one_bounded_chunk_are_graphed(step, graphed):
    graphs, eager = Roofline(DIMS, PROFILES["h200-graphs"]), Roofline(DIMS, PROFILES["h200"])
    assert replays_graph(PROFILES["h200-graphs"], step) is graphed
    assert not replays_graph(PROFILES["h200"], step) and not replays_graph(PROFILES["h200-roofline"], step)
    if not graphed:  # an eager step is predicted as h200 predicts it
        assert graphs.step_time(step) == eager.step_time(step)
    else:
        assert graphs.step_time(step).replay_s > 0 and graphs.step_time(step).dispatch_s == 0


def test_the_replay_projection_is_built_from_the_measured_table_and_the_stated_launch_costs():
    """The runner's own Python per step is taken as the scheduler's, measured beside it on the same
    host (the intercept of host_seconds over the decode steps' rows); per row, the eager fit's."""
    decodes = [s for s in load_step_table(H200_8B) if not s.composition.prefill_tokens]
    x = np.array([[1.0, s.composition.num_rows] for s in decodes])
    h0, _hr = solve_relative(x, np.array([s.host_seconds for s in decodes]), {}, nonnegative=(0, 1))
    assert H200_RUNNER_PYTHON_PER_STEP_S == pytest.approx(h0, rel=0.02)
    assert H200_GRAPH_PER_STEP_S == pytest.approx(
        H200_RUNNER_PYTHON_PER_STEP_S + GRAPH_LAUNCH_S + GRAPH_INPUT_COPY_S + GRAPH_SAMPLING_SYNC_S)
    assert H200_GRAPH_PER_ROW_S == H200_EAGER_DISPATCH_PER_ROW_S
    assert PROFILES["h200-graphs"].dispatch_per_step_s == PROFILES["h200"].dispatch_per_step_s  # eager steps


def graphs_table(truth: HardwareProfile, n: int = 400, seed: int = 5) -> list[MeasuredStep]:
    """Steps of a synthetic graphs-on run timed by ``truth``, +-3 % noise: decodes, bounded and
    unbounded chunks."""
    model, rng, steps = Roofline(DIMS, truth), random.Random(seed), []
    for _ in range(n):
        rows = rng.randint(1, 128)
        c = rng.choice([decode(rows, rng.randint(64, 4096)), decode(rows), mixed(rows, rng.randint(16, 512)),
                        mixed(rows, 1024, rng.randint(256, 1024))])
        steps.append(MeasuredStep(c, model.step_time(c).runner_s * rng.uniform(0.97, 1.03)))
    return steps


def test_the_replay_fit_recovers_a_known_replay_time_from_the_graphed_steps():
    truth = PROFILES["h200-graphs"].with_factors(graph_per_step_s=300e-6, graph_per_row_s=6e-6)
    steps = graphs_table(truth)
    fit = fit_graph_replay(steps, Roofline(DIMS, PROFILES["h200-graphs"]))
    assert fit.per_step_s == pytest.approx(300e-6, rel=0.25) and fit.per_row_s == pytest.approx(6e-6, rel=0.2)
    assert fit.graphed_steps == sum(replays_graph(truth, s.composition) for s in steps) < len(steps)
    assert fit.mean_abs_error < 0.03
    refit = fit.profile(PROFILES["h200-graphs"], "h200-graphs-fitted")
    assert refit.cuda_graphs and refit.dispatch_per_step_s == PROFILES["h200"].dispatch_per_step_s


def test_the_replay_fit_needs_a_graphs_profile_and_graphed_steps():
    steps = graphs_table(PROFILES["h200-graphs"], n=20)
    with pytest.raises(ValueError, match="replays no CUDA graphs"):
        fit_graph_replay(steps, Roofline(DIMS, PROFILES["h200"]))
    long_chunks = [MeasuredStep(mixed(4, 1024, 1024), 0.05)] * 5
    with pytest.raises(ValueError, match="0 steps of 5 are graphed"):
        fit_graph_replay(long_chunks, Roofline(DIMS, PROFILES["h200-graphs"]))


@pytest.mark.parametrize("field, value", [("cuda_graphs", "yes"), ("graph_max_prefill_tokens", -1),
                                          ("graph_max_prefill_tokens", 512.5), ("graph_per_step_s", -1e-6),
                                          ("graph_per_row_s", float("inf"))])
def test_a_profile_with_an_impossible_graph_field_is_refused(field, value):
    with pytest.raises(ProfileError, match=field):
        PROFILES["h200-graphs"].with_factors(**{field: value})


def test_every_built_in_profile_says_what_it_rests_on(capsys):
    assert set(PROFILE_BASIS) == set(PROFILES)
    assert PROFILE_BASIS["h200"].startswith("measured") and PROFILE_BASIS["h200-roofline"] == "roofline"
    assert PROFILE_BASIS["h200-graphs"].startswith("projection")
    with pytest.raises(SystemExit):
        main(["sim", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "h200-graphs (projection" in shown and "h200 (measured" in shown and "h200-roofline (roofline)" in shown


def test_cadenza_sim_calibrate_dispatch_only_fits_the_replay_of_a_graphs_table(tmp_path, capsys):
    truth = PROFILES["h200-graphs"].with_factors(graph_per_step_s=250e-6, graph_per_row_s=4e-6)
    table = tmp_path / "steps-graphs.jsonl"
    table.write_text("".join(json.dumps({
        "prefill_tokens": s.composition.prefill_tokens, "decode_tokens": s.composition.decode_tokens,
        "decode_context_tokens": s.composition.decode_context_tokens,
        "prefill_attention_tokens": s.composition.prefill_attention_tokens, "num_rows": s.composition.num_rows,
        "num_sampled": s.composition.num_sampled, "seconds": s.seconds}) + "\n" for s in graphs_table(truth)))
    out = tmp_path / "h200-graphs.json"
    assert main(["sim", "calibrate", "--dispatch-only", "--steps", str(table), "--model", "llama-3.1-8b",
                 "--base", "h200-graphs", "--name", "h200-graphs", "--out", str(out)]) == 0
    shown = capsys.readouterr()
    assert "graph replay" in shown.out and "warning" not in shown.err
    fitted = load_profile(out)
    assert fitted.cuda_graphs and fitted.graph_max_prefill_tokens == GRAPH_MAX_PREFILL_TOKENS
    assert fitted.graph_per_step_s == pytest.approx(250e-6, rel=0.25)
    # the eager H200 table through the same command: an eager runner's host time, said so
    assert main(["sim", "calibrate", "--dispatch-only", "--steps", str(H200_8B), "--model", "llama-3.1-8b",
                 "--base", "h200-graphs", "--out", str(tmp_path / "wrong.json")]) == 0
    assert "--no-cuda-graphs?" in capsys.readouterr().err


def test_cadenza_sim_runs_on_the_graphs_profile_and_its_decode_is_faster(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 50 * i, "input_length": 200 + 13 * (i % 7),
                                         "output_length": 30 + i % 11}) + "\n" for i in range(40)))
    pool = tmp_path / "p.json"  # JSON is YAML
    pool.write_text(json.dumps({
        "apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool",
        "metadata": {"name": "sim-pool", "namespace": "default"},
        "spec": {"model": {"name": "Llama-3.1-8B-Instruct", "source": {"path": "/models/llama"}}, "replicas": 1,
                 "mode": "colocated", "engine": {"tokenBudget": 1024, "chunkSize": 512, "maxNumSeqs": 64,
                                                 "maxModelLen": 8192},
                 "slo": {"interactive": {"ttftP99Ms": 500, "itlP99Ms": 50}}}}))
    itl = {}
    for hw in ("h200", "h200-graphs"):
        out = tmp_path / f"{hw}.json"
        assert main(["sim", "--trace", str(trace), "--pool", str(pool), "--model", "llama-3.1-8b",
                     "--hardware", hw, "--no-progress", "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        assert report["hardware"] == hw and report["by_class"]["interactive"]["requests"] == 40
        itl[hw] = report["by_class"]["interactive"]["itl_ms"]["p50"]
    assert itl["h200-graphs"] < 0.6 * itl["h200"]  # ~6 ms against ~12 ms a token
    # A pool that turns graphs off runs eagerly on the graphs profile too.
    spec = json.loads(pool.read_text())
    spec["spec"]["engine"]["cudaGraphs"] = False
    pool.write_text(json.dumps(spec))
    out = tmp_path / "off.json"
    assert main(["sim", "--trace", str(trace), "--pool", str(pool), "--model", "llama-3.1-8b",
                 "--hardware", "h200-graphs", "--no-progress", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["by_class"]["interactive"]["itl_ms"]["p50"] == pytest.approx(itl["h200"])
