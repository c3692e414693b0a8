"""Shared pieces of the benchmarks: the Azure trace's workloads and the report line.

Workloads come from the Azure 2023 conversation trace shipped in ``data/traces/`` (scaled: CPU is
~1000x slower than the GPUs it was recorded on); every benchmark says how it scaled it.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np
import torch

from cadenza.node.replay.prompts import PromptSynthesizer, load_tokenizer
from cadenza.node.replay.trace import TraceRequest, load_trace

ROOT = Path(__file__).resolve().parents[1]
CONV_TRACE = ROOT / "data" / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"


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


def report(result: dict) -> None:
    """Print the result as the last line: one JSON object with benchmark, ratio, target."""
    assert {"benchmark", "ratio", "target"} <= result.keys()
    print(json.dumps(result, sort_keys=False))


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


def serving(args: list[str], log: Path):
    """``cadenza serve ARGS`` as a subprocess, the way users start it: a context manager that
    yields the server's root URL once ``/ready`` answers and stops it after (the test suite's
    ``tests/support/server_process.py``; torch threads as the server chooses, unless ARGS say)."""
    import contextlib
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from server_process import cadenza_server

    @contextlib.contextmanager
    def run():
        with cadenza_server(args, log, ready_timeout=300.0, env={"OMP_NUM_THREADS": ""}) as url:
            yield url.removesuffix("/v1")

    return run()
