"""Every benchmark runs on the current code: each script of ``bench/`` in its quick mode, as a user
runs it (``python -m bench.NAME --quick``), exits 0 and prints its JSON line; ``make bench`` runs
every one. The benchmarks that start servers run from ``test_quick_servers.py``; the longest only
with ``--long-benchmarks`` (``make test-long``, which CI runs after ``make test``)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from bench_scripts import BENCH, LONG, ROOT, STARTS_SERVERS, benchmarks, check_quick_run, params

IN_PROCESS = [name for name in benchmarks() if name not in STARTS_SERVERS]


def test_benchmarks_are_found():
    found = benchmarks()
    assert "common" not in found  # a helper module, not a script
    assert {"classes", "scheduler_overhead", "gpu_check", "gpu_probe", "sim_hybrid_mixes"} <= set(found)
    assert STARTS_SERVERS | LONG <= set(found), "a benchmark named in STARTS_SERVERS or LONG is gone: update the set"


@pytest.mark.parametrize("name", params(IN_PROCESS))
def test_quick_mode_runs(name, tmp_path):
    result = check_quick_run(name, tmp_path, timeout_s=240)
    if name == "gpu_check" and not torch.cuda.is_available():
        # Without CUDA it runs its one CPU-testable section: a step table the simulator can fit.
        from cadenza.sim.calibrate import load_step_table

        for section in ("kernel_tests", "decode", "prefill", "engine_step"):
            assert "needs a CUDA GPU" in result[section]["skipped"]
        table = load_step_table(tmp_path / "gpu-steps.jsonl")
        assert len(table) == result["step_table"]["steps"] > 0
        # ... and the probe's quick run, as one more section.
        assert result["probe"]["benchmark"] == "gpu_probe" and result["probe"]["quick"] is True
    if name == "gpu_probe" and not torch.cuda.is_available():
        _check_probe_on_the_cpu(result, tmp_path)


def _check_probe_on_the_cpu(result: dict, workdir) -> None:
    """Without CUDA every section runs on the CPU but the two that need CUDA, which say why; the
    step table it writes is one the simulator calibrates a profile from."""
    from cadenza.sim.calibrate import calibrate, cpu_base, load_step_table
    from cadenza.sim.model_dims import load_model_dims
    from cadenza.sim.roofline import Roofline

    sections = result["sections"]
    for name in ("gpu_busy", "graphs"):
        assert "needs a CUDA GPU" in sections[name]["skipped"]
    assert [row["batch"] for row in sections["decode"]["rows"]] == [1, 4]
    assert 0 < result["ratio"] == sections["decode"]["rows"][0]["floor_fraction"]
    assert result["mixed_ratio"] > 0 and result["stall_ratio"] > 0 and sections["prefill"]["tflops"] > 0
    assert result["prefill_ratio"] is None and "H200" in sections["prefill"]["not_compared"]
    assert result["device"] == "cpu" and result["pass"] is False
    out = workdir / "gpu-probe"  # --out's default
    assert json.loads((out / "gpu-probe.json").read_text())["sections"]["decode"] == sections["decode"]
    table = load_step_table(out / "gpu-probe-steps-tiny.jsonl")
    assert len(table) == sections["step_table"]["steps"] > 0
    model = out / "gpu-probe-models" / "tiny"
    assert f"--model {model.relative_to(workdir)} --base cpu" in sections["step_table"]["calibrate"]
    fit = calibrate(table, Roofline(load_model_dims(model), cpu_base()))
    assert fit.steps == len(table)


def _recipe(target: str) -> str:
    """The recipe lines of a Makefile target."""
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", text, re.M)
    assert match, f"no `{target}` target in the Makefile"
    return match.group(1)


def test_make_bench_runs_every_benchmark():
    ran = set(re.findall(r"-m bench\.(\w+)", _recipe("bench")))
    assert ran == set(benchmarks()) - {"gpu_check", "gpu_probe"}
    assert re.findall(r"-m bench\.(\w+)", _recipe("gpu-check")) == ["gpu_check"]
    assert re.findall(r"-m bench\.(\w+)", _recipe("gpu-probe")) == ["gpu_probe"]
    assert all((BENCH / f"{name}.py").exists() for name in ran)
