"""The scripts of ``bench/`` run as a user runs them, ``python -m bench.NAME --quick``, for the smoke
tests in ``tests/bench/``: so that a change of the engine's API cannot break one of them unseen.

Benchmarks are found, not listed: every module of ``bench/`` that runs as a script (it has an
``if __name__ == "__main__":`` block) is one, so a new benchmark is smoke-tested from its first
commit, and fails the test until it has a quick mode (``bench.common.arguments``).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

# The benchmarks whose quick run starts `cadenza serve` or `cadenza up` processes: 10-70 s each
# (every process imports torch and loads a model), so marked slow and run from their own test
# file, which xdist hands to a worker beside the file of the others.
STARTS_SERVERS = frozenset({"decode_speed", "disagg", "engine_process", "frontend_overhead", "hybrid", "hybrid_day",
                            "sim_validation"})
# Of those, the ones whose quick run alone would take `make test` past its budget (measured on 2
# cores: hybrid ~70 s, three `cadenza up` pools; hybrid_day ~60 s, two pools of three replicas;
# sim_validation ~27 s; engine_process ~15 s, four processes): marked ``long_benchmark``, skipped
# unless ``--long-benchmarks`` is given, which `make test-long` does (CI runs it after `make test`).
LONG = frozenset({"engine_process", "hybrid", "hybrid_day", "sim_validation"})


def _is_script(path: Path) -> bool:
    """True when the module has an ``if __name__ == "__main__":`` block."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            names = [n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)]
            if names == ["__name__"]:
                return True
    return False


def benchmarks() -> list[str]:
    """Every benchmark of ``bench/``, by module name, sorted."""
    return sorted(p.stem for p in BENCH.glob("*.py") if _is_script(p))


def params(names: list[str]) -> list:
    """``names`` as pytest parameters, those in :data:`LONG` marked ``long_benchmark``."""
    import pytest

    return [pytest.param(name, marks=pytest.mark.long_benchmark) if name in LONG else name for name in names]


def run_quick(name: str, workdir: Path, timeout_s: float) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``python -m bench.NAME --quick`` from ``workdir`` (files it writes, temporary ones
    included, land there), the repository on the import path; return the finished process and
    its last stdout line parsed as JSON (``{}`` when it is not a JSON object).

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout_s``.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "TMPDIR": str(workdir),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", f"bench.{name}", "--quick"], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    lines = proc.stdout.strip().splitlines()
    try:
        last = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        last = {}
    return proc, last if isinstance(last, dict) else {}


def check_quick_run(name: str, workdir: Path, timeout_s: float) -> dict:
    """Run the benchmark's quick mode and check what the project asks of every benchmark: exit 0,
    last line one JSON object with ``benchmark`` (its name), ``ratio`` and ``target``, marked
    ``"quick": true`` (so it ran the quick mode, not its full length). Returns that object."""
    proc, result = run_quick(name, workdir, timeout_s)
    context = f"python -m bench.{name} --quick exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, context
    assert result, f"its last line is not a JSON object:\n{context}"
    assert result.get("benchmark") == name, context
    assert {"ratio", "target"} <= result.keys(), context
    assert result.get("quick") is True, f"no quick mode (the JSON line lacks \"quick\": true):\n{context}"
    return result
