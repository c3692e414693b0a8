"""Every benchmark runs on the current code: each script of ``bench/`` in its quick mode, as a user
runs it (``python -m bench.NAME --quick``), exits 0 and prints its JSON line; ``make bench`` runs
every one. The benchmarks that start servers run from ``test_quick_servers.py``; the longest only
with ``--long-benchmarks`` (``make test-long``, which CI runs after ``make test``)."""

from __future__ import annotations

import re

import pytest
import torch

from bench_scripts import BENCH, LONG, ROOT, STARTS_SERVERS, benchmarks, check_quick_run, params

IN_PROCESS = [name for name in benchmarks() if name not in STARTS_SERVERS]


def test_benchmarks_are_found():
    found = benchmarks()
    assert "common" not in found  # a helper module, not a script
    assert {"classes", "scheduler_overhead", "gpu_check", "sim_hybrid_mixes"} <= set(found)
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


def _recipe(target: str) -> str:
    """The recipe lines of a Makefile target."""
    text = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", text, re.M)
    assert match, f"no `{target}` target in the Makefile"
    return match.group(1)


def test_make_bench_runs_every_benchmark():
    ran = set(re.findall(r"-m bench\.(\w+)", _recipe("bench")))
    assert ran == set(benchmarks()) - {"gpu_check"}
    assert re.findall(r"-m bench\.(\w+)", _recipe("gpu-check")) == ["gpu_check"]
    assert all((BENCH / f"{name}.py").exists() for name in ran)
