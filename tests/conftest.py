"""Fixtures shared by every test package (the embedded model, tiny random models) and how the suite
runs in parallel.

The suite runs under pytest-xdist (``-n auto --dist loadfile`` in pyproject.toml): one worker per
CPU this process may use (``os.sched_getaffinity``), at most ``MAX_WORKERS``; a run of named tests
only (``pytest tests/x.py::test_y``) stays in this process. ``-n 0`` runs everything here, ``-n 3``
picks a count. Each worker, and each server a test starts, computes with one torch thread, so two
workers on two cores never fight over them.

A test file goes to one worker whole, so its module fixtures (a compile of every kernel, a wheel
built in the source tree, a server process) are built once, never twice at the same time.
(``--dist loadgroup`` would allow finer units, but with pytest 9.2 it silently stops grouping:
pytest-xdist issue #1386.) Files holding ``slow`` tests are handed out first
(``--no-loadscope-reorder`` keeps this order), so the longest ones do not start last.
Session fixtures are built once per worker, each in its own temporary folder.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_WORKERS = 4
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # set in xdist's worker processes

# Before torch (and its OpenMP pool) is loaded: a worker, and every process it starts, computes
# with one thread. The parent of the workers only schedules.
if XDIST_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

import torch  # noqa: E402

if XDIST_WORKER:
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already used: the inter-op pool is fixed by then
        pass

# Triton kernels run under the interpreter on a GPU-less machine. Triton reads this when it is
# first imported (torch imports it lazily), so it is set before anything else can import it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from cadenza.node.embedded import ensure_embedded_model  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

# No property test may fail because the machine is busy: no per-example deadline, and no health
# check that times data generation (tests that set their own settings inherit both).
settings.register_profile("cadenza", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("cadenza")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: the CPUs this process may use, capped; in-process for named tests only."""
    if env := os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(env)
    if config.args and all("::" in arg for arg in config.args):
        return 0  # a test or a few, picked by id: starting workers would cost more than it saves
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long-benchmarks", action="store_true",
                     help="also run the tests marked long_benchmark (`make test-long`; CI runs it after `make test`)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules holding ``slow`` tests first (stable: each module stays whole and in order); tests
    marked ``long_benchmark`` skipped without ``--long-benchmarks``."""
    if not config.getoption("--long-benchmarks"):
        skip = pytest.mark.skip(reason="a long benchmark: run with --long-benchmarks (make test-long; CI runs it)")
        for item in items:
            if item.get_closest_marker("long_benchmark"):
                item.add_marker(skip)
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_modules)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (``make test`` fetches it first; else ~30 s).

    Under xdist every worker asks; the first converts and the others wait on its lock."""
    return ensure_embedded_model()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with GQA (4 query heads, 2 KV heads), untied embeddings (seeded, so
    every xdist worker builds the same one in its own temporary folder)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
