"""Tensor parallelism on this machine's cores: decode and prefill tok/s at size 1 and size 2, side by side.

A random Llama of ~1.2 B parameters (Llama-3.2-1B's shapes: 16 layers, hidden 2,048, MLP 8,192, 32
query and 8 KV heads, a tied 128,256-token vocabulary; weights drawn from a seed), fp32 on the CPU,
run by the engine core (``EngineCore``, no server) three ways in one run:

- **size 1**, one torch thread;
- **size 2**, one thread per rank (the core and one worker process), over the shared-memory
  collectives (the engine's default on a CPU);
- **size 2 over gloo** (``CADENZA_TP_COLLECTIVES=gloo``): the same, with gloo's TCP all-reduce,
  gather and broadcast — the transport the issue proposed, measured against the one chosen.

Each measures decode at batch 8 (8 requests of 64-token prompts, ``DECODE_STEPS`` steps timed
after two warm-up steps) and prefill (one ``PREFILL_TOKENS``-token prompt in one step, best of
``PREFILL_ROUNDS``). On rank 0 it also times, per decode step, the all-reduces (two per layer and
one after the embedding: 33 here) and the broadcast of the step's input arrays; both include
waiting for the other rank to arrive. What an all-reduce itself costs is measured apart
(:func:`all_reduce_latency`: two processes doing nothing else, a decode step's ``[8, 2048]`` fp32
message, over shared memory and over gloo), and its share of a step is that cost x 33 over the
step's time.

Target (issue 32): size 2 decodes >= 1.5x size 1's tok/s (``ratio``). The model is a decode step's
worth of weights read from memory (4.9 GB at size 1, 2.5 GB per rank at size 2), so what size 2
buys on one machine is a second core's share of memory bandwidth and arithmetic; on GPUs the same
split buys each GPU's own HBM. ``--quick``: the tests' tiny model, a few steps. ``--device cuda`` on a
machine with two GPUs or more: the same at bf16 over NCCL (sizes 1 and 2; no gloo run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.common import arguments, machine, report
from cadenza.node.core.config import EngineConfig
from cadenza.node.core.messages import AddRequest
from cadenza.node.core.request import SamplingParams
from cadenza.node.engine.engine_core import EngineCore

LLAMA_1B = {  # Llama-3.2-1B's shapes (config.json of meta-llama/Llama-3.2-1B), weights drawn from a seed
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 2048,
    "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128001,
}
QUICK_MODEL = {**LLAMA_1B, "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
BATCH, PROMPT = 8, 64
DECODE_STEPS, PREFILL_TOKENS, PREFILL_ROUNDS = 12, 256, 2
TARGET = 1.5


def model_folder(config: dict) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@contextmanager
def timed(obj, name: str, spent: list[float]):
    """Add the seconds each call of ``obj.name`` takes to ``spent[0]`` while inside."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    setattr(obj, name, wrapper)
    try:
        yield
    finally:
        setattr(obj, name, original)


def measure(folder: Path, tp: int, collectives: str, decode_steps: int, prefill_tokens: int, rounds: int,
            device: str = "cpu") -> dict:
    """Decode and prefill figures of one engine (size ``tp``, one torch thread per rank)."""
    os.environ["CADENZA_TP_COLLECTIVES"] = collectives
    torch.set_num_threads(1)  # one per rank: the core gives its workers as many as it has, divided by the size
    config = EngineConfig.from_knobs(str(folder), tensor_parallel_size=tp, token_budget=max(512, prefill_tokens),
                                     chunk_size=None, max_num_seqs=64, kv_cache_bytes=256 << 20, prefix_caching=False,
                                     device=device, attention_backend="cpu" if device == "cpu" else "auto")
    started = time.perf_counter()
    core = EngineCore(config, weights_seed=0)
    load_s = time.perf_counter() - started
    vocab = core.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    try:
        for i in range(BATCH):
            ids = torch.randint(10, vocab, (PROMPT,), generator=g).tolist()
            core.add_request(AddRequest(f"d{i}", ids, SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)))
        while core.scheduler.snapshot().num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                                           for r in core.scheduler.requests.values()):
            core.step()
        for _ in range(2):
            core.step()
        reduce_s, send_s = [0.0], [0.0]
        runner = core.runner
        with (timed(runner.collectives.device, "all_reduce", reduce_s) if tp > 1 else _nothing(),
              timed(runner, "_send", send_s) if tp > 1 else _nothing()):
            started = time.perf_counter()
            for _ in range(decode_steps):
                core.step()
            decode_s = time.perf_counter() - started
        for i in range(BATCH):
            core.abort_request(f"d{i}")
        best = float("inf")
        for r in range(rounds):
            ids = torch.randint(10, vocab, (prefill_tokens,), generator=g).tolist()
            core.add_request(AddRequest(f"p{r}", ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
            started = time.perf_counter()
            core.step()
            best = min(best, time.perf_counter() - started)
            core.abort_request(f"p{r}")
    finally:
        core.close()
    step_ms = 1000 * decode_s / decode_steps
    return {"tp": tp, "collectives": collectives if tp > 1 else None, "load_s": round(load_s, 1),
            "decode_tok_s": round(BATCH * decode_steps / decode_s, 2), "decode_step_ms": round(step_ms, 1),
            "all_reduce_share": round(reduce_s[0] / decode_s, 4) if tp > 1 else 0.0,
            "all_reduce_us_per_step": round(1e6 * reduce_s[0] / decode_steps) if tp > 1 else 0,
            "broadcast_us_per_step": round(1e6 * send_s[0] / decode_steps) if tp > 1 else 0,
            "prefill_tok_s": round(prefill_tokens / best, 1)}


@contextmanager
def _nothing():
    yield


def _peer(kind: str, folder: str, rounds: int, shape: tuple[int, int]) -> None:
    """Rank 1 of :func:`all_reduce_latency` (a spawned process)."""
    torch.set_num_threads(1)
    group = _group(kind, Path(folder), 1)
    x = torch.ones(shape)
    for _ in range(rounds):
        group.all_reduce(x)
    group.close()


def _group(kind: str, folder: Path, rank: int):
    import torch.distributed as dist

    from cadenza.node.runner.collectives import ShmGroup, TorchGroup

    if kind == "shm":
        return ShmGroup(folder / "arena", rank, 2)
    return TorchGroup("gloo", dist.FileStore(str(folder / "store"), 2), rank, 2)


def all_reduce_latency(kind: str, rounds: int, shape: tuple[int, int] = (BATCH, 2048)) -> float:
    """Microseconds one all-reduce of ``shape`` fp32 takes between two processes (``shm`` or
    ``gloo``), one thread each, median of ``rounds`` after a warm-up."""
    import multiprocessing

    from cadenza.node.runner.collectives import create_arena

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="tp-allreduce-"))
    try:
        create_arena(folder / "arena", 2)
        peer = multiprocessing.get_context("spawn").Process(target=_peer, args=(kind, str(folder), rounds, shape))
        peer.start()
        group = _group(kind, folder, 0)
        x, times = torch.ones(shape), []
        for _ in range(rounds):
            started = time.perf_counter()
            group.all_reduce(x)
            times.append(time.perf_counter() - started)
        peer.join(timeout=60)
        group.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return round(1e6 * sorted(times[rounds // 10:])[len(times[rounds // 10:]) // 2], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (default), or cuda on a machine with two GPUs or more (NCCL)")
    args = arguments(__doc__, parser)
    config = QUICK_MODEL if args.quick else LLAMA_1B
    steps, prefill, rounds = (4, 64, 1) if args.quick else (DECODE_STEPS, PREFILL_TOKENS, PREFILL_ROUNDS)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"--device cuda needs two GPUs, this machine has {torch.cuda.device_count()}")
    folder = model_folder(config)
    try:
        runs = [measure(folder, 1, "shm", steps, prefill, rounds, args.device),
                measure(folder, 2, "shm", steps, prefill, rounds, args.device)]
        if args.device == "cpu":
            runs.append(measure(folder, 2, "gloo", steps, prefill, rounds))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    width = config["hidden_size"]
    latency = {kind: all_reduce_latency(kind, 200 if args.quick else 2000, (BATCH, width)) for kind in ("shm", "gloo")}
    layers = config["num_hidden_layers"]
    for run in runs[1:]:
        kind = run["collectives"] if args.device == "cpu" else None
        if kind in latency:  # the all-reduce's own cost per step, as a share of the step
            run["all_reduce_alone_us"] = latency[kind]
            run["all_reduce_alone_share"] = round((2 * layers + 1) * latency[kind] / 1000 / run["decode_step_ms"], 4)
    print(f"all-reduce of a [{BATCH}, {width}] fp32 decode message between two processes: "
          f"shared memory {latency['shm']} us, gloo {latency['gloo']} us (median)")
    print(f"{'run':<14} {'decode tok/s':>12} {'step ms':>8} {'all-reduce':>10} {'broadcast':>10} {'prefill tok/s':>13}")
    for run in runs:
        name = f"size {run['tp']}" + (f" {run['collectives']}" if run["collectives"] and args.device == "cpu"
                                      else " nccl" if run["tp"] > 1 else "")
        print(f"{name:<14} {run['decode_tok_s']:>12} {run['decode_step_ms']:>8} {run['all_reduce_share']:>10.1%} "
              f"{run['broadcast_us_per_step']:>8}us {run['prefill_tok_s']:>13}")
    one, two = runs[:2]
    gloo = runs[2] if len(runs) > 2 else None
    report({"benchmark": "tensor_parallel", "ratio": round(two["decode_tok_s"] / one["decode_tok_s"], 3),
            "target": TARGET, "prefill_ratio": round(two["prefill_tok_s"] / one["prefill_tok_s"], 3),
            "gloo_decode_ratio": round(gloo["decode_tok_s"] / one["decode_tok_s"], 3) if gloo else None,
            "device": args.device,
            "runs": runs, "model": "llama-3.2-1b shapes, random fp32" if not args.quick else "tiny",
            "batch": BATCH, "machine": machine()}, quick=args.quick)


if __name__ == "__main__":
    main()
