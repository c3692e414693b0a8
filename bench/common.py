"""Shared pieces of the benchmarks: the command line, the Azure trace's workloads, the report line.

Workloads come from the Azure 2023 conversation trace shipped in ``data/traces/`` (scaled: CPU is
~1000x slower than the GPUs it was recorded on); every benchmark says how it scaled it.

Every benchmark takes ``--quick`` (:func:`arguments`): the same code path on its smallest shapes
(one round, a few requests, short prompts, the tests' tiny random Llama in place of SmolLM2 where
it serves a model), in seconds, so ``tests/bench/`` can run each one as a user does.
A quick run still measures and prints its JSON line, marked ``"quick": true``: its figures are
not the recorded ones (``docs/benchmarks.md``) and say nothing about the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from cadenza.loadgen.prompts import PromptSynthesizer, load_tokenizer
from cadenza.loadgen.trace import TraceRequest, load_trace

ROOT = Path(__file__).resolve().parents[1]
CONV_TRACE = ROOT / "data" / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"


QUICK_HELP = ("the same code path on the smallest shapes, in seconds (a smoke test: its figures are not "
              "comparable with the recorded ones)")


def arguments(doc: str, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse a benchmark's command line: ``parser``'s own flags (None: none) plus ``--quick``.

    ``doc``: the module docstring, whose first line describes the benchmark in ``--help``.
    """
    parser = parser or argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = parser.parse_args()
    if args.quick:
        print("quick mode: smallest shapes; the figures below are a smoke test, not a measurement to record")
    return args


def conv_trace() -> list[TraceRequest]:
    return load_trace(CONV_TRACE)


def prompt_ids(model_dir: Path, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token ids of synthesized English prompts of exactly the given lengths."""
    tokenizer = load_tokenizer(model_dir)
    synth = PromptSynthesizer(tokenizer, seed=seed)
    out = []
    for n in lengths:
        ids = tokenizer.encode(synth.prompt(n), add_special_tokens=False).ids
        out.append(ids[:n] if len(ids) >= n else ids + ids[: n - len(ids)])
    return out


def pct(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def machine() -> dict:
    return {"cpu_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}


def report(result: dict, quick: bool = False) -> None:
    """Print the result as the last line: one JSON object with benchmark, ratio, target (and
    ``"quick": true`` after a quick run)."""
    assert {"benchmark", "ratio", "target"} <= result.keys()
    print(json.dumps(result | {"quick": True} if quick else result, sort_keys=False))


def hit_rate(engine) -> float:
    """Share of the prompt tokens an engine looked up that its prefix cache served (0 when none)."""
    stats = engine.scheduler.stats
    return stats.prefix_cache_hit_tokens / stats.prefix_cache_queried_tokens if stats.prefix_cache_queried_tokens else 0.0


def tiny_random_llama(path: Path) -> Path:
    """A random Llama of 2 layers, 64 wide, with the tests' 384-token BPE tokenizer, written once to
    ``path``: a model whose forward pass and LM head cost next to nothing, so the host side shows
    (built by ``tests/support/tiny_models.py``, the same builder the test suite uses)."""
    if (path / "config.json").exists():
        return path
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from tiny_models import build_tiny_model

    return build_tiny_model(path, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def quick_model() -> Path:
    """The model of a quick run: :func:`tiny_random_llama`, built once into the cadenza cache
    folder (``$CADENZA_CACHE_DIR/bench/tiny-llama``, see :mod:`cadenza.node.embedded`). Built in
    a temporary folder and renamed into place, so runs started at once never see half of it."""
    from cadenza.node.embedded import cache_dir

    path = cache_dir() / "bench" / "tiny-llama"
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="tiny-llama-", dir=path.parent))
    tiny_random_llama(staging)
    try:
        os.rename(staging, path)
    except OSError:  # another run put it there first
        shutil.rmtree(staging, ignore_errors=True)
    return path


def bench_model(quick: bool) -> Path:
    """The embedded SmolLM2-135M-Instruct, or in a quick run :func:`quick_model`."""
    from cadenza.node.embedded import ensure_embedded_model

    return quick_model() if quick else ensure_embedded_model()


def serving(args: list[str], log: Path, quick: bool = False):
    """``cadenza serve ARGS`` as a subprocess, the way users start it: a context manager that
    yields the server's root URL once ``/ready`` answers and stops it after (the test suite's
    ``tests/support/server_process.py``). Torch threads as the server chooses, unless ARGS say;
    ``quick``: one thread, so a smoke run beside other work does not oversubscribe the cores.

    Raises:
        RuntimeError: the server exited before it was ready.
        TimeoutError: it was not ready within 300 s.
    """
    import contextlib
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from server_process import cadenza_server

    @contextlib.contextmanager
    def run():
        env = None if quick else {"OMP_NUM_THREADS": ""}  # None: OMP_NUM_THREADS=1 (cadenza_server's default)
        with cadenza_server(args, log, ready_timeout=300.0, env=env) as url:
            yield url.removesuffix("/v1")

    return run()
