"""What logprobs cost, and who pays: decode steps with no request asking, one of eight asking, all asking.

The engine core (no server) decodes 8 requests of SmolLM2-135M-Instruct (fp32, this machine's
threads) three ways, interleaved round by round so the machine's drift falls on all alike:
nobody asks for logprobs; one request asks for ``top_logprobs=20``; all eight do. A step computes
logprobs (a ``log_softmax`` of the asking rows' logits, a top-20, one more read of the device) only
for the rows that ask (``node/runner/sampler.py``: ``token_logprobs``), so with nobody asking a step
does exactly what it did before logprobs existed.

Target (issue 33): the requests that do not ask see no change — decode tok/s with one of eight
asking >= 0.97x that with nobody asking (``ratio``). Prefix caching is off; the prompts are fresh
random ids. ``--quick``: the tests' tiny model, a few steps.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import arguments, bench_model, machine, report
from cadenza.node.core.messages import AddRequest
from cadenza.node.core.request import SamplingParams
from cadenza.node.engine.engine_core import EngineCore

BATCH, PROMPT, STEPS, ROUNDS = 8, 64, 32, 5
TARGET = 0.97
WAYS = {"nobody": 0, "one of eight": 1, "all eight": BATCH}


def decode_tok_s(core: EngineCore, asking: int, steps: int, round_: int) -> float:
    """Decode tok/s of ``BATCH`` fresh requests, ``asking`` of them with ``top_logprobs=20``."""
    g = torch.Generator().manual_seed(round_)
    ids = [f"r{round_}-{asking}-{i}" for i in range(BATCH)]
    for i, rid in enumerate(ids):
        prompt = torch.randint(10, core.model_config.vocab_size, (PROMPT,), generator=g).tolist()
        sampling = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True,
                                  logprobs=20 if i < asking else None)
        core.add_request(AddRequest(rid, prompt, sampling))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
        core.step()
    core.step()  # the first decode
    started = time.perf_counter()
    for _ in range(steps):
        core.step()
    elapsed = time.perf_counter() - started
    for rid in ids:
        core.abort_request(rid)
    return BATCH * steps / elapsed


def main() -> None:
    args = arguments(__doc__)
    steps, rounds = (4, 2) if args.quick else (STEPS, ROUNDS)
    core = EngineCore.from_model(bench_model(args.quick), token_budget=512, chunk_size=None, prefix_caching=False,
                                 max_num_seqs=BATCH)
    try:
        figures: dict[str, list[float]] = {name: [] for name in WAYS}
        for r in range(rounds):
            for name, asking in WAYS.items():
                figures[name].append(decode_tok_s(core, asking, steps, r))
    finally:
        core.close()
    medians = {name: round(statistics.median(v), 2) for name, v in figures.items()}
    for name, value in medians.items():
        print(f"{name:<14} asking: {value:>8} decode tok/s (median of {rounds} rounds)")
    base = medians["nobody"]
    report({"benchmark": "logprobs", "ratio": round(medians["one of eight"] / base, 3), "target": TARGET,
            "all_asking_ratio": round(medians["all eight"] / base, 3), "decode_tok_s": medians, "batch": BATCH,
            "top_logprobs": 20, "machine": machine()}, quick=args.quick)


if __name__ == "__main__":
    main()
