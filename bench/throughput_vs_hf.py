"""Offline throughput against ``transformers``: ``python -m bench.throughput_vs_hf``.

64 requests with the Azure 2023 conversation trace's length mix (its first 64 requests, lengths
scaled by 1/8 and capped at 512 prompt / 128 output tokens), SmolLM2-135M-Instruct, fp32, CPU.

- **cadenza**: the engine in process, all 64 requests submitted at once (continuous batching,
  chunked prefill with the default budget), each generating exactly its trace output length.
- **transformers**: ``generate()`` in static batches of 8 in trace order, left-padded, greedy,
  each batch running to its longest output.

Both count only the output tokens the trace asks for (``ignore_eos``; EOS disabled in HF).
The two run alternately, twice each; the medians are compared. Target: ratio of output
tokens/s ≥ 2. cadenza's prefix caching is off: the rounds replay the same prompts, which a cache
would serve from the second round on, and transformers has none (the hit rate is reported: 0).

``--quick``: one round of the first 8 requests (outputs capped at 16) on the tests' tiny random Llama.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from bench.common import arguments, bench_model, conv_trace, hit_rate, machine, prompt_ids, report
from cadenza.loadgen.trace import scale_trace
from cadenza.node.frontend.llm import Engine
from cadenza.node.core.request import SamplingParams

NUM_REQUESTS, LENGTH_SCALE, MAX_INPUT, MAX_OUTPUT, HF_BATCH, ROUNDS = 64, 1 / 8, 512, 128, 8, 2
QUICK_REQUESTS, QUICK_MAX_OUTPUT, QUICK_ROUNDS = 8, 16, 1


def run_cadenza(engine: Engine, prompts: list[list[int]], outputs: list[int]) -> float:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    got = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(g) for g in got] == outputs
    return elapsed


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], outputs: list[int], pad_id: int) -> float:
    start = time.perf_counter()
    for b in range(0, len(prompts), HF_BATCH):
        batch, lens = prompts[b : b + HF_BATCH], outputs[b : b + HF_BATCH]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                             do_sample=False, pad_token_id=pad_id)
        assert out.shape[1] == width + max(lens)
    return time.perf_counter() - start


def main() -> None:
    args = arguments(__doc__)
    model_dir = bench_model(args.quick)
    num_requests, max_output, rounds = ((QUICK_REQUESTS, QUICK_MAX_OUTPUT, QUICK_ROUNDS) if args.quick
                                        else (NUM_REQUESTS, MAX_OUTPUT, ROUNDS))
    trace, scaling = scale_trace(conv_trace(), length_scale=LENGTH_SCALE, max_input_len=MAX_INPUT,
                                 max_output_len=max_output, num_requests=num_requests)
    print(f"workload: {scaling.describe()}")
    prompts = prompt_ids(model_dir, [r.input_len for r in trace])
    outputs = [r.output_len for r in trace]
    useful = sum(outputs)

    engine = Engine.from_model(model_dir, kv_cache_bytes=1 << 30, prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    pad_id = min(engine.core.eos_token_ids)
    run_cadenza(engine, prompts[:4], outputs[:4])  # warm up
    run_hf(hf, prompts[:4], [4] * 4, pad_id)

    times: dict[str, list[float]] = {"cadenza": [], "transformers": []}
    for r in range(rounds):
        times["cadenza"].append(run_cadenza(engine, prompts, outputs))
        times["transformers"].append(run_hf(hf, prompts, outputs, pad_id))
        print(f"round {r + 1}: cadenza {useful / times['cadenza'][-1]:6.1f} tok/s, "
              f"transformers {useful / times['transformers'][-1]:6.1f} tok/s")
    tps = {name: useful / statistics.median(t) for name, t in times.items()}
    ratio = tps["cadenza"] / tps["transformers"]
    print(f"output tokens/s: cadenza {tps['cadenza']:.1f}, transformers {tps['transformers']:.1f}; "
          f"ratio {ratio:.2f} (target ≥ 2)")
    report({
        "benchmark": "throughput_vs_hf",
        "ratio": round(ratio, 3),
        "target": 2.0,
        "output_tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "output_tokens": useful,
        "prefix_caching": False,
        "prefix_cache_hit_rate": round(hit_rate(engine), 4),
        "workload": {"trace": "azure2023 conv", **scaling.as_dict()},
        "pass": ratio >= 2.0,
        "machine": machine(),
    }, quick=args.quick)


if __name__ == "__main__":
    main()
