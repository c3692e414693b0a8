"""``cadenza sim`` on a ServingPool YAML and a trace: the report, the layouts, clear errors."""

from __future__ import annotations

import json

import pytest
import yaml

from cadenza.node.cli import main
from cadenza.pool.validate import load_pools
from cadenza.sim.hardware import PROFILES
from cadenza.sim.model_dims import load_model_dims
from cadenza.sim.pool import fleet_layout
from cadenza.sim.roofline import Roofline


def write_pool(path, mode: str, replicas: int = 3, **extra) -> str:
    doc = {"apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool",
           "metadata": {"name": "sim-pool", "namespace": "default"},
           "spec": {"model": {"name": "Llama-3.1-8B-Instruct", "source": {"path": "/models/llama"}},
                    "replicas": replicas, "mode": mode,
                    "engine": {"tokenBudget": 1024, "chunkSize": 512, "maxNumSeqs": 64, "maxModelLen": 8192},
                    "slo": {"interactive": {"ttftP99Ms": 500, "itlP99Ms": 50}}, **extra}}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def write_trace(path, n: int = 200) -> str:
    path.write_text("".join(json.dumps({"timestamp": 20 * i, "input_length": 300 + 17 * (i % 11),
                                        "output_length": 40 + i % 23}) + "\n" for i in range(n)))
    return str(path)


MODEL = Roofline(load_model_dims("llama-3.1-8b"), PROFILES["h100-sxm"])


def test_pool_modes_become_fleet_layouts(tmp_path):
    colocated = fleet_layout(load_pools(write_pool(tmp_path / "c.yaml", "colocated"))[0], MODEL)
    assert colocated.roles == {"interactive": ["colocated-0", "colocated-1", "colocated-2"],
                               "batch": ["colocated-0", "colocated-1", "colocated-2"]}
    assert colocated.controller is None and colocated.configs["colocated-0"].chunk_size == 512
    dedicated = fleet_layout(load_pools(write_pool(tmp_path / "d.yaml", "dedicated", dedicated={
        "interactiveReplicas": 1, "engine": {"chunkSize": 128}}))[0], MODEL)
    assert dedicated.roles == {"interactive": ["interactive-0"], "batch": ["batch-0", "batch-1"]}
    assert dedicated.configs["interactive-0"].chunk_size == 128 and dedicated.configs["batch-0"].chunk_size == 512
    auto = fleet_layout(load_pools(write_pool(tmp_path / "a.yaml", "auto"))[0], MODEL)
    assert auto.controller is not None and auto.controller.slo["interactive"]["itlP99Ms"] == 50


def test_cadenza_sim_reports_each_class_and_writes_json(tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["sim", "--trace", write_trace(tmp_path / "t.jsonl"), "--pool", write_pool(tmp_path / "p.yaml", "auto"),
                 "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--json", str(out)])
    assert code == 0
    assert "simulating" in capsys.readouterr().err  # a progress bar
    report = json.loads(out.read_text())
    assert report["requests"] == 200 and report["replicas"] == 3 and report["dropped"] == 0
    assert report["by_class"]["interactive"]["requests"] == 200
    assert 0 < report["by_class"]["interactive"]["itl_ms"]["p50"] < 50
    code = main(["sim", "--trace", str(tmp_path / "t.jsonl"), "--pool", str(tmp_path / "p.yaml"), "--model",
                 "llama-3.1-8b", "--hardware", "h100-sxm", "--no-progress"])
    shown = capsys.readouterr()
    assert code == 0 and "interactive: 200 done" in shown.out and "simulating" not in shown.err


@pytest.mark.parametrize("flag, value, message", [("--hardware", "tpu-v5", "unknown hardware profile"),
                                                   ("--model", "gpt-5", "unknown model"),
                                                   ("--tp", "3", "does not divide")])
def test_bad_arguments_exit_2_with_the_reason(tmp_path, capsys, flag, value, message):
    args = {"--trace": write_trace(tmp_path / "t.jsonl", 5), "--pool": write_pool(tmp_path / "p.yaml", "colocated"),
            "--model": "llama-3.1-8b", "--hardware": "h100-sxm", flag: value}
    assert main(["sim", *[x for kv in args.items() for x in kv]]) == 2
    assert message in capsys.readouterr().err


def write_mixed_trace(path, n: int = 240) -> str:
    """Interactive chat with a batch tenant's long prompts every fourth request."""
    rows = []
    for i in range(n):
        batch = i % 4 == 3
        rows.append({"timestamp": 25 * i, "input_length": 3000 if batch else 300 + 17 * (i % 11),
                     "output_length": 200 if batch else 40 + i % 23, "class": "batch" if batch else "interactive",
                     "tenant": "etl" if batch else "chat"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_compare_runs_every_policy_on_the_same_trace_and_plots_them(tmp_path, capsys):
    out, plots = tmp_path / "report.json", tmp_path / "plots"
    slo = {"slo": {"interactive": {"ttftP99Ms": 500, "itlP99Ms": 50}, "batch": {"ttftP99Ms": 20000}}}
    code = main(["sim", "--trace", write_mixed_trace(tmp_path / "t.jsonl"), "--pool",
                 write_pool(tmp_path / "p.yaml", "colocated", replicas=2, **slo), "--model", "llama-3.1-8b",
                 "--hardware", "h100-sxm", "--compare", "--json", str(out), "--plot", str(plots), "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert list(report["policies"]) == ["prefill-first", "chunked-fcfs", "chunked-classes", "dedicated",
                                        "disaggregated", "auto"]
    # over the default 10 Gb/s link, moving Llama-3.1-8B's 128 KiB a token never pays for 3,000 tokens
    moved = report["policies"]["disaggregated"]["kv_transfer"]
    assert moved["moved"] == 0 and moved["min_prompt_tokens"] > 3000
    assert report["policies"]["chunked-classes"]["kv_transfer"] == {}
    for name, run in report["policies"].items():
        by_class = run["by_class"]
        assert set(by_class) == {"interactive", "batch"}, name  # reported by the trace's classes
        assert by_class["interactive"]["requests"] + by_class["interactive"]["rejected"] == 180
        assert by_class["batch"]["requests"] + by_class["batch"]["rejected"] == 60
        assert 0 <= by_class["interactive"]["slo_attainment"] <= 1 and run["goodput_rps"] >= 0
        assert 0 < run["kv_usage"]["mean"] <= run["kv_usage"]["peak"] <= 1
        assert run["attainment_over_time"]["interactive"]
    # chunking keeps decodes moving: prefill-first's ITL p99 is the long prompts' whole prefills
    first, chunked = (report["policies"][p]["by_class"]["interactive"] for p in ("prefill-first", "chunked-classes"))
    assert first["itl_ms"]["p99"] > chunked["itl_ms"]["p99"]
    assert {p.name for p in plots.iterdir()} == {"goodput_by_policy.png", "slo_attainment_over_time.png"}
    assert "chunked-classes: goodput" in capsys.readouterr().out


def test_sweep_finds_a_capacity_per_policy(tmp_path):
    out = tmp_path / "report.json"
    code = main(["sim", "--trace", write_trace(tmp_path / "t.jsonl", 120), "--pool",
                 write_pool(tmp_path / "p.yaml", "colocated", replicas=1), "--model", "llama-3.1-8b",
                 "--hardware", "h100-sxm", "--compare", "prefill-first", "chunked-classes", "--sweep", "--json", str(out),
                 "--no-progress"])
    assert code == 0
    capacity = json.loads(out.read_text())["capacity_req_s"]
    assert set(capacity) == {"prefill-first", "chunked-classes"}  # a one-replica pool has no split to compare
    assert capacity["chunked-classes"] > capacity["prefill-first"] > 0


def test_an_unknown_policy_is_refused(tmp_path, capsys):
    assert main(["sim", "--trace", write_trace(tmp_path / "t.jsonl", 5), "--pool",
                 write_pool(tmp_path / "p.yaml", "colocated"), "--model", "llama-3.1-8b", "--hardware", "h100-sxm",
                 "--compare", "round-robin"]) == 2
    assert "unknown policies ['round-robin']" in capsys.readouterr().err


def test_outputs_and_sweeps_that_cannot_work_fail_before_the_run(tmp_path, capsys):
    base = ["sim", "--trace", write_trace(tmp_path / "t.jsonl", 1), "--pool", write_pool(tmp_path / "p.yaml", "colocated"),
            "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--no-progress"]
    assert main([*base, "--sweep"]) == 2
    assert "two or more requests spread over time" in capsys.readouterr().err
    assert main([*base, "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert main([*base, "--time-scale", "inf"]) == 2
    assert "finite" in capsys.readouterr().err
    one = write_pool(tmp_path / "one.yaml", "colocated", replicas=1)
    assert main([*base[:4], one, *base[5:], "--compare", "dedicated"]) == 2
    assert "nothing to run (dedicated: a pool of one replica has no split)" in capsys.readouterr().err


def test_the_json_report_is_strict_json(tmp_path):
    out = tmp_path / "r.json"
    trace = tmp_path / "t.jsonl"  # one-token outputs: no inter-token gaps, no ITL percentiles
    trace.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 50, "output_length": 1}) + "\n"
                             for i in range(5)))
    assert main(["sim", "--trace", str(trace), "--pool", write_pool(tmp_path / "p.yaml", "colocated"), "--model",
                 "llama-3.1-8b", "--hardware", "h100-sxm", "--no-progress", "--json", str(out)]) == 0
    assert "NaN" not in out.read_text()
    assert json.loads(out.read_text())["by_class"]["interactive"]["itl_ms"]["p50"] is None


def test_batch_above_and_class_send_a_classless_trace_as_traffic_classes(tmp_path):
    """The Azure traces carry no class: --batch-above (as in `cadenza bench`) splits them by prompt length."""
    trace, pool, out = write_trace(tmp_path / "t.jsonl"), write_pool(tmp_path / "p.yaml", "colocated"), tmp_path / "r.json"
    base = ["sim", "--trace", trace, "--pool", pool, "--model", "llama-3.1-8b", "--hardware", "h100-sxm",
            "--no-progress", "--json", str(out)]
    assert main([*base, "--batch-above", "400"]) == 0
    by_class = json.loads(out.read_text())["by_class"]
    # prompts are 300 + 17 * (i % 11) tokens: 6 of every 11 reach 400
    lengths = [300 + 17 * (i % 11) for i in range(200)]
    assert by_class["batch"]["requests"] == sum(n >= 400 for n in lengths)
    assert by_class["interactive"]["requests"] == sum(n < 400 for n in lengths)
    assert main([*base, "--class", "background"]) == 0
    assert set(json.loads(out.read_text())["by_class"]) == {"background"}


def test_a_batch_threshold_below_one_token_is_refused(tmp_path, capsys):
    assert main(["sim", "--trace", write_trace(tmp_path / "t.jsonl", 5), "--pool", write_pool(tmp_path / "p.yaml",
                 "colocated"), "--model", "llama-3.1-8b", "--hardware", "h100-sxm", "--batch-above", "0"]) == 2
    assert "batch threshold must be >= 1 token" in capsys.readouterr().err


# --- tensor parallelism: the pool's size is the simulator's --------------------------------------


def sim_args(tmp_path, pool: str, *more: str) -> list[str]:
    return ["sim", "--trace", write_trace(tmp_path / "t.jsonl", 20), "--pool", pool, "--model", "llama-3.1-8b",
            "--hardware", "h100-sxm", "--no-progress", "--json", str(tmp_path / "r.json"), *more]


def test_a_pools_tensor_parallel_size_is_the_simulators(tmp_path):
    pool = write_pool(tmp_path / "p.yaml", "colocated", engine={"maxModelLen": 8192, "tensorParallelSize": 4})
    assert main(sim_args(tmp_path, pool)) == 0
    assert json.loads((tmp_path / "r.json").read_text())["tp"] == 4
    assert main(sim_args(tmp_path, pool, "--tp", "4")) == 0  # --tp may say the same


def test_a_pools_gpus_per_replica_are_its_tensor_parallel_size():
    from cadenza.sim.pool import pool_tensor_parallel_size

    doc = {"metadata": {"name": "p"}, "spec": {"resources": {"limits": {"nvidia.com/gpu": 2}}}}
    assert pool_tensor_parallel_size(doc) == pool_tensor_parallel_size(doc, 2) == 2
    assert pool_tensor_parallel_size({"metadata": {"name": "p"}, "spec": {}}, 8) == 8  # the pool says nothing
    assert pool_tensor_parallel_size({"metadata": {"name": "p"}, "spec": {}}) == 1


@pytest.mark.parametrize("spec, said", [
    ({"engine": {"tensorParallelSize": 4}}, "spec.engine.tensorParallelSize"),
    ({"resources": {"limits": {"nvidia.com/gpu": 4}}}, "its 4 GPUs per replica"),
])
def test_a_tp_flag_other_than_the_pools_is_refused_naming_both(tmp_path, capsys, spec, said):
    assert main(sim_args(tmp_path, write_pool(tmp_path / "p.yaml", "colocated", **spec), "--tp", "2")) == 2
    assert f"--tp 2 differs from the pool's tensor-parallel size 4 ({said})" in capsys.readouterr().err


def test_a_tp_flag_sets_the_size_of_a_pool_that_says_none(tmp_path):
    assert main(sim_args(tmp_path, write_pool(tmp_path / "p.yaml", "colocated"), "--tp", "2")) == 0
    assert json.loads((tmp_path / "r.json").read_text())["tp"] == 2


def test_compare_runs_every_policy_of_a_tensor_parallel_pool(tmp_path):
    # KV moves between tensor-parallel replicas of one size: disaggregated and auto's prefill rung run too
    pool = write_pool(tmp_path / "p.yaml", "colocated", replicas=2, engine={"tensorParallelSize": 2})
    assert main(sim_args(tmp_path, pool, "--compare", "chunked-classes", "disaggregated", "auto")) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert list(report["policies"]) == ["chunked-classes", "disaggregated", "auto"] and report["tp"] == 2
