"""``cadenza sim`` on a ServingPool YAML and a trace: the report, the layouts, clear errors."""

from __future__ import annotations

import json

import pytest
import yaml

from cadenza.node.cli import main
from cadenza.operator.validate import load_pools
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
    assert "simulating: 100%" in capsys.readouterr().err  # the progress bar reached every request
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
                                                   ("--tp", "3", "do not split")])
def test_bad_arguments_exit_2_with_the_reason(tmp_path, capsys, flag, value, message):
    args = {"--trace": write_trace(tmp_path / "t.jsonl", 5), "--pool": write_pool(tmp_path / "p.yaml", "colocated"),
            "--model": "llama-3.1-8b", "--hardware": "h100-sxm", flag: value}
    assert main(["sim", *[x for kv in args.items() for x in kv]]) == 2
    assert message in capsys.readouterr().err
