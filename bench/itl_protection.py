"""Chunked prefill protects live streams: ``python -m bench.itl_protection``.

SmolLM2-135M-Instruct on CPU, in process. Four streams are decoding when a ~2,000-token prompt
arrives. We record every inter-token gap of the four streams while the long prompt is ingested
(from its arrival to its first token), and the long prompt's TTFT, under

- **chunked**: ``chunk_size`` 128, ``token_budget`` 256;
- **unchunked**: ``token_budget`` 4,096 and no chunk cap (the prompt goes in one step).

Workload from the Azure 2023 conversation trace: the long prompt is the first request of
1,900-2,100 prompt tokens; the four streams are the first four requests with prompts ≤ 256
tokens, decoding with ``ignore_eos`` until the long prompt has its first token. Configurations
alternate over five rounds; the medians are compared. Targets: chunked max ITL ≤ ¼ of
unchunked; long-prompt TTFT chunked/unchunked ≤ 1.5.

Prefix caching is on (the default), and every round synthesizes fresh prompts of the same lengths
(both configurations get the same ones), so no round is served from the cache; the hit rate is
printed and reported (it must stay near 0, else the TTFT would not be a prefill's).

``--quick``: one round on the tests' tiny random Llama, the long prompt the first of 400-600 tokens.
"""

from __future__ import annotations

import statistics
import time

from bench.common import arguments, bench_model, conv_trace, hit_rate, machine, pct, prompt_ids, report
from cadenza.node.frontend.llm import Engine
from cadenza.node.core.request import SamplingParams

ROUNDS = 5
LONG_PROMPT = (1900, 2100)  # tokens: the long prompt is the trace's first request in this range
QUICK_LONG_PROMPT = (400, 600)
CONFIGS = {
    "chunked": dict(token_budget=256, chunk_size=128),
    "unchunked": dict(token_budget=4096, chunk_size=None),
}


def workload(long_range: tuple[int, int] = LONG_PROMPT) -> tuple[int, list[int]]:
    trace = conv_trace()
    long_len = next(r.input_len for r in trace if long_range[0] <= r.input_len <= long_range[1])
    stream_lens = [r.input_len for r in trace if r.input_len <= 256][:4]
    return long_len, stream_lens


def run_once(engine: Engine, long_prompt: list[int], streams: list[list[int]]) -> dict:
    """Start the streams, let them reach decode, send the long prompt; measure until its first token."""
    for i, ids in enumerate(streams):  # decoding until aborted below (as long as the model allows)
        decode = SamplingParams(max_tokens=min(4000, engine.max_model_len - len(ids)), temperature=0, ignore_eos=True)
        engine.add_request(f"s{i}", ids, decode)
    while any(r.num_output_tokens < 3 for r in engine.scheduler.running) or engine.scheduler.num_waiting:
        engine.step()
    last = {f"s{i}": time.perf_counter() for i in range(len(streams))}
    arrival = time.perf_counter()
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    gaps: list[float] = []
    ttft = None
    while ttft is None:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id == "long":
                ttft = now - arrival
            else:
                gaps.append(now - last[out.request_id])
                last[out.request_id] = now
    for i in range(len(streams)):
        engine.abort_request(f"s{i}")
    assert engine.block_manager.num_used_blocks == 0
    return {"max_itl_ms": max(gaps) * 1e3, "p99_itl_ms": pct(gaps, 99) * 1e3, "ttft_ms": ttft * 1e3,
            "gaps": len(gaps), "steps": engine.scheduler.stats.num_steps}


def main() -> None:
    args = arguments(__doc__)
    model = bench_model(args.quick)
    rounds = 1 if args.quick else ROUNDS
    long_len, stream_lens = workload(QUICK_LONG_PROMPT if args.quick else LONG_PROMPT)
    print(f"workload (Azure conv trace): long prompt {long_len} tokens; streams {stream_lens} prompt tokens; "
          "fresh prompts every round, prefix caching on")
    engines = {name: Engine.from_model(model, kv_cache_bytes=256 * 2**20, prefix_caching=True, **knobs)
               for name, knobs in CONFIGS.items()}
    warm = prompt_ids(model, [64], seed=rounds + 1)
    for engine in engines.values():  # warm up allocators and kernels
        engine.generate(warm, SamplingParams(max_tokens=4, temperature=0))
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for r in range(rounds):
        long_prompt, *streams = prompt_ids(model, [long_len, *stream_lens], seed=r)
        for name, engine in engines.items():
            res = run_once(engine, long_prompt, streams)
            results[name].append(res)
            print(f"round {r + 1} {name:>9}: max ITL {res['max_itl_ms']:7.1f} ms, p99 ITL {res['p99_itl_ms']:7.1f} ms, "
                  f"TTFT {res['ttft_ms']:7.1f} ms ({res['gaps']} gaps)")
    med = {name: {k: statistics.median(x[k] for x in rs) for k in ("max_itl_ms", "p99_itl_ms", "ttft_ms")}
           for name, rs in results.items()}
    hits = {name: round(hit_rate(engine), 4) for name, engine in engines.items()}
    print(f"prefix-cache hit rate: {hits}")
    itl_ratio = med["chunked"]["max_itl_ms"] / med["unchunked"]["max_itl_ms"]
    ttft_ratio = med["chunked"]["ttft_ms"] / med["unchunked"]["ttft_ms"]
    print(f"max ITL chunked/unchunked: {itl_ratio:.3f} (target ≤ 0.25); "
          f"long-prompt TTFT chunked/unchunked: {ttft_ratio:.3f} (target ≤ 1.5)")
    report({
        "benchmark": "itl_protection",
        "ratio": round(itl_ratio, 4),
        "target": 0.25,
        "ttft_ratio": round(ttft_ratio, 4),
        "ttft_target": 1.5,
        "chunked": {k: round(v, 1) for k, v in med["chunked"].items()},
        "unchunked": {k: round(v, 1) for k, v in med["unchunked"].items()},
        "workload": {"trace": "azure2023 conv", "long_prompt_tokens": long_len, "stream_prompt_tokens": stream_lens},
        "prefix_caching": True,
        "prefix_cache_hit_rate": hits,
        "pass": itl_ratio <= 0.25 and ttft_ratio <= 1.5,
        "machine": machine(),
    }, quick=args.quick)


if __name__ == "__main__":
    main()
