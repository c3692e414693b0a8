"""Class policy and decode reservation versus one FCFS class: ``python -m bench.classes``.

SmolLM2-135M-Instruct on CPU, in process, replayed in real time. Interactive requests are the
first 30 of the Azure 2023 conversation trace, batch requests the first 12 of the Azure 2023 code
trace (long prompts, short outputs, arriving in a burst) — both slowed 3x, so they arrive over
about a minute, with lengths scaled for a CPU (conversation: prompts /16, outputs /2 capped at
96; code: prompts /4 capped at 1,024, outputs capped at 64).

- **FCFS**: one class for everything (token budget 512, chunk 256).
- **policy**: conversation requests in ``interactive``, code requests in ``batch``; decodes of
  interactive streams are protected in time (``step_time_target_ms``: batch prefill chunks shrink
  while an interactive stream is decoding) and interactive prefill goes first.

The workload arrives at fixed times, so how loaded the engine is depends on the machine: the run
first measures, and reports, the median time of a step that decodes eight streams and prefills
nothing (``decode_step_ms``). The 160 ms target was chosen where that step took about 65 ms; where
it takes much longer, batch chunks are held near the floor for longer and the batch ratio falls.

Reports interactive ITL p99 (target: policy >= 2x lower than FCFS) and batch output throughput
(target: policy >= 80 % of FCFS's), measured in one run, same workload; last line JSON. Prefix
caching is on, as by default; each engine replays the workload once (its warm-up uses other
prompts), and the synthesized prompts share no prefix, so the hit rate (reported) is about 0.

``--quick``: the tests' tiny random Llama, 6 interactive and 3 batch requests arriving 10x faster
than recorded, code prompts capped at 256 tokens.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from bench.common import CONV_TRACE, ROOT, arguments, bench_model, hit_rate, machine, pct, prompt_ids, report
from cadenza.loadgen.trace import TraceRequest, load_trace, scale_trace
from cadenza.node.frontend.llm import Engine
from cadenza.node.core.request import SamplingParams

CODE_TRACE = ROOT / "data" / "traces" / "azure2023" / "AzureLLMInferenceTrace_code.csv"
TIME_SCALE, NUM_INTERACTIVE, NUM_BATCH, MAX_CODE_PROMPT = 3.0, 30, 12, 1024
QUICK = dict(time_scale=0.1, num_interactive=6, num_batch=3, max_code_prompt=256)
STEP_TIME_TARGET_MS = 160.0
KNOBS = dict(token_budget=512, chunk_size=256, max_num_seqs=32, kv_cache_bytes=512 * 2**20, prefix_caching=True)


@dataclass
class Job:
    request_id: str
    arrival_s: float
    prompt: list[int]
    output_len: int
    traffic_class: str


@dataclass
class Run:
    token_times: dict[str, list[float]] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)


def workload(model_dir, time_scale: float = TIME_SCALE, num_interactive: int = NUM_INTERACTIVE,
             num_batch: int = NUM_BATCH, max_code_prompt: int = MAX_CODE_PROMPT) -> list[Job]:
    conv, _ = scale_trace(load_trace(CONV_TRACE), time_scale=time_scale, length_scale=1 / 16,
                          num_requests=num_interactive)
    code, _ = scale_trace(load_trace(CODE_TRACE), time_scale=time_scale, length_scale=1 / 4,
                          max_input_len=max_code_prompt, num_requests=num_batch)
    # Outputs: conversation /2 (the /16 above, times 8), at least 8 tokens so ITL is measured; code as is.
    conv = [TraceRequest(r.arrival_s, r.input_len, min(96, max(8, r.output_len * 8))) for r in conv]
    code = [TraceRequest(r.arrival_s, r.input_len, min(64, r.output_len * 4)) for r in code]
    prompts = prompt_ids(model_dir, [r.input_len for r in conv + code], seed=3)
    jobs = [Job(f"i{i}", r.arrival_s, prompts[i], r.output_len, "interactive") for i, r in enumerate(conv)]
    jobs += [Job(f"b{i}", r.arrival_s, prompts[len(conv) + i], r.output_len, "batch") for i, r in enumerate(code)]
    return sorted(jobs, key=lambda j: j.arrival_s)


def decode_step_ms(engine: Engine, model, tokens: int = 40) -> float:
    """Median time of a step that decodes eight streams and prefills nothing (milliseconds)."""
    prompts = prompt_ids(model, [64] * 8, seed=98)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"calibrate{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        if engine.core.last_step_tokens == 8:  # all eight streams decoding, no prompt tokens in the step
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def replay(engine: Engine, jobs: list[Job], classes: bool) -> Run:
    run = Run()
    start = time.perf_counter()
    pending = list(jobs)
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            job = pending.pop(0)
            engine.add_request(job.request_id, job.prompt, SamplingParams(max_tokens=job.output_len, temperature=0,
                                                                            ignore_eos=True),
                               traffic_class=job.traffic_class if classes else "interactive")
            run.started[job.request_id] = start + job.arrival_s
            run.token_times[job.request_id] = []
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.05, pending[0].arrival_s - now)))
            continue
        for out in engine.step():
            run.token_times[out.request_id].append(time.perf_counter())
    return run


def summarize(run: Run, jobs: list[Job]) -> dict:
    gaps, ttfts = [], []
    batch_tokens, batch_first, batch_last = 0, float("inf"), 0.0
    for job in jobs:
        times = run.token_times[job.request_id]
        if job.traffic_class == "interactive":
            ttfts.append(times[0] - run.started[job.request_id])
            gaps += [b - a for a, b in zip(times, times[1:])]
        else:
            batch_tokens += len(times)
            batch_first = min(batch_first, run.started[job.request_id])
            batch_last = max(batch_last, times[-1])
    return {
        "interactive_itl_p99_ms": round(pct(gaps, 99) * 1e3, 1),
        "interactive_itl_p50_ms": round(pct(gaps, 50) * 1e3, 1),
        "interactive_ttft_p99_ms": round(pct(ttfts, 99) * 1e3, 1),
        "batch_output_tokens_per_s": round(batch_tokens / (batch_last - batch_first), 3),
    }


def main() -> None:
    args = arguments(__doc__)
    model = bench_model(args.quick)
    shape = QUICK if args.quick else dict(time_scale=TIME_SCALE, num_interactive=NUM_INTERACTIVE,
                                          num_batch=NUM_BATCH, max_code_prompt=MAX_CODE_PROMPT)
    jobs = workload(model, **shape)
    n_inter = sum(j.traffic_class == "interactive" for j in jobs)
    print(f"workload: {n_inter} interactive (Azure conv), {len(jobs) - n_inter} batch (Azure code) requests "
          f"arriving over {jobs[-1].arrival_s:.0f} s (traces slowed {shape['time_scale']:g}x; conv prompts /16, "
          f"outputs /2 capped 96; code prompts /4 capped {shape['max_code_prompt']}, outputs capped 64)")
    fcfs = Engine.from_model(model, **KNOBS)
    policy = Engine.from_model(model, **KNOBS)
    warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for engine in (fcfs, policy):  # warm up, and calibrate the cost model on a few mixed steps
        engine.generate(prompt_ids(model, [60, 300, 700], seed=99), warm)
    decode_ms = decode_step_ms(fcfs, model, tokens=8 if args.quick else 40)
    policy.reconfigure({"step_time_target_ms": STEP_TIME_TARGET_MS})
    print(f"a decode-only step of 8 streams takes {decode_ms:.1f} ms here (step-time target {STEP_TIME_TARGET_MS:g} ms)")
    results = {}
    for name, engine, classes in (("fcfs", fcfs, False), ("policy", policy, True)):
        results[name] = summarize(replay(engine, jobs, classes), jobs)
        print(f"{name:>6}: interactive ITL p99 {results[name]['interactive_itl_p99_ms']} ms "
              f"(p50 {results[name]['interactive_itl_p50_ms']} ms), TTFT p99 {results[name]['interactive_ttft_p99_ms']} ms; "
              f"batch {results[name]['batch_output_tokens_per_s']} output tok/s")
    itl_ratio = results["fcfs"]["interactive_itl_p99_ms"] / results["policy"]["interactive_itl_p99_ms"]
    batch_ratio = results["policy"]["batch_output_tokens_per_s"] / results["fcfs"]["batch_output_tokens_per_s"]
    error = policy.stats().cost_model_error
    hits = {"fcfs": round(hit_rate(fcfs), 4), "policy": round(hit_rate(policy), 4)}
    preempted = {name: e.scheduler.stats.num_preemptions for name, e in (("fcfs", fcfs), ("policy", policy))}
    print(f"prefix caching on; hit rate {hits}; preemptions {preempted}")
    print(f"interactive ITL p99 FCFS/policy: {itl_ratio:.2f}x (target >= 2); batch throughput policy/FCFS: "
          f"{batch_ratio:.2f} (target >= 0.8); cost-model error {error}")
    report({
        "benchmark": "classes",
        "ratio": round(itl_ratio, 3),
        "target": 2.0,
        "batch_throughput_ratio": round(batch_ratio, 3),
        "batch_throughput_target": 0.8,
        "fcfs": results["fcfs"],
        "policy": results["policy"],
        "step_time_target_ms": STEP_TIME_TARGET_MS,
        "decode_step_ms": round(decode_ms, 1),
        "cost_model_error": error,
        "prefix_caching": True,
        "prefix_cache_hit_rate": hits,
        "preemptions": preempted,
        "pass": itl_ratio >= 2 and batch_ratio >= 0.8,
        "machine": machine(),
    }, quick=args.quick)


if __name__ == "__main__":
    main()
