"""What telemetry costs: ``python -m bench.telemetry_overhead``.

SmolLM2-135M-Instruct on CPU, in process. The same workload — 16 requests shaped like the first
16 of the Azure conversation trace (prompts /8, outputs /4, 4 to 32 tokens; all submitted at once,
so steps mix prefill chunks and up to 16 decodes) — runs with telemetry off and on, back to back,
seven rounds. "On" is everything a server does per request and per step: a SERVER span with
its events, the per-step metrics in the engine thread, and TTFT/ITL/TPOT/usage histograms per
output. Exporters are the Prometheus reader (scraped once per round) — OTLP export runs in the
SDK's background threads and is not on this path. Each round's on/off pair runs back to back, so
both see the same machine; the reported ratio is the median of the per-round ratios of mean step
time on/off (target ≤ 1.05); last line JSON. ``--quick``: one round of 4 requests on the tests' tiny
random Llama.
"""

from __future__ import annotations

import statistics
import time

from bench.common import arguments, bench_model, conv_trace, hit_rate, machine, prompt_ids, report
from cadenza.loadgen.trace import scale_trace
from cadenza.node.frontend.llm import Engine
from cadenza.node.core.request import SamplingParams
from cadenza.node.frontend.telemetry import Telemetry

ROUNDS, NUM_REQUESTS = 7, 16
QUICK_ROUNDS, QUICK_REQUESTS = 1, 4


def run(engine: Engine, prompts: list[list[int]], outputs: list[int], telemetry: Telemetry | None, tag: str) -> float:
    """Run the workload; return the mean wall time per engine step (seconds)."""
    engine.observer = telemetry
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, prompt, n in zip(ids, prompts, outputs):
        if telemetry is not None:
            telemetry.start_request(rid, "text_completion", {}, max_tokens=n, temperature=0.0, top_p=1.0,
                                    traffic_class="interactive", tenant="default", arrival=time.monotonic())
        engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        outputs_ = engine.step()
        steps += 1
        if telemetry is not None:
            for out in outputs_:
                telemetry.on_output(out)
    if telemetry is not None:
        telemetry.prometheus_text()  # one scrape per round
    return (time.perf_counter() - start) / steps


def main() -> None:
    args = arguments(__doc__)
    model = bench_model(args.quick)
    rounds, num_requests = (QUICK_ROUNDS, QUICK_REQUESTS) if args.quick else (ROUNDS, NUM_REQUESTS)
    trace, scaling = scale_trace(conv_trace(), length_scale=1 / 8, num_requests=num_requests)
    prompts = prompt_ids(model, [r.input_len for r in trace])
    outputs = [min(32, max(4, r.output_len * 2)) for r in trace]
    # Prefix caching off: every round recomputes the same prompts, so rounds stay comparable.
    engine = Engine.from_model(model, token_budget=512, chunk_size=256, kv_cache_bytes=512 * 2**20,
                               prefix_caching=False)
    telemetry = Telemetry(engine.config.model_name, stats=engine.stats, otlp=False)
    run(engine, prompts[:4], outputs[:4], None, "warm")
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds):
        times["off"].append(run(engine, prompts, outputs, None, f"off{r}"))
        times["on"].append(run(engine, prompts, outputs, telemetry, f"on{r}"))
        print(f"round {r + 1}: step {times['off'][-1] * 1e3:.1f} ms off, {times['on'][-1] * 1e3:.1f} ms on")
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    ratio = statistics.median(b / a for a, b in zip(times["off"], times["on"]))
    print(f"mean step time with telemetry / without: {ratio:.3f} (target <= 1.05); prefix caching off, "
          f"hit rate {hit_rate(engine):.1%}")
    report({
        "benchmark": "telemetry_overhead",
        "ratio": round(ratio, 4),
        "target": 1.05,
        "step_ms": {"off": round(off * 1e3, 2), "on": round(on * 1e3, 2)},
        "workload": {"trace": "azure2023 conv", "requests": num_requests, "length_scale": scaling.length_scale,
                     "outputs": "x2 of the scaled trace, 4 to 32 tokens"},
        "prefix_caching": False,
        "prefix_cache_hit_rate": round(hit_rate(engine), 4),
        "pass": ratio <= 1.05,
        "machine": machine(),
    }, quick=args.quick)


if __name__ == "__main__":
    main()
