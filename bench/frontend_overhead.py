"""The engine core in its own process versus in a thread: ``python -m bench.frontend_overhead``.

A tiny random Llama (2 layers, 64 wide, the test suite's 384-token BPE tokenizer), so the forward
pass and the LM head cost next to nothing and what the host does per token — HTTP, SSE, detokenizing, stop
strings, telemetry — decides the throughput. 256 streaming clients in a closed loop over HTTP
against ``cadenza serve``, each sending 4 requests back to back (so 256 streams run at once until
the end, and a round lasts seconds, not one); prompts and output lengths are the first 1,024
requests of the Azure 2023 conversation trace (prompts /8, capped at 256 tokens; outputs doubled,
at least 32, capped at 128, EOS ignored). ``--engine-process on`` and ``off`` run the same
workload, interleaved, five rounds each, each server first warmed up by a wave of 256 other
requests (no prefix-cache hits for the timed ones); per round: output tokens/s (all tokens / wall
time from the first request to the last
answer) and the step loop's share of that wall time (the summed model time of its steps, from the
server's ``cadenza.step.duration`` histogram). Target: tokens/s with the core in its own process ≥
1.5× in a thread (median of the per-round ratios); last line JSON. ``--quick``: one round, 8 clients
sending one request each.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import arguments, conv_trace, machine, prompt_ids, quick_model, report, serving, tiny_random_llama
from cadenza.loadgen.trace import scale_trace

CLIENTS, WAVES, ROUNDS = 256, 4, 5  # a round: each client streams WAVES requests back to back
QUICK_CLIENTS, QUICK_WAVES, QUICK_ROUNDS = 8, 1, 1
SERVE_ARGS = ["--token-budget", "1024", "--chunk-size", "256", "--kv-cache-gib", "0.25", "--max-model-len", "1024",
              "--threads", "1"]


async def replay(url: str, prompts: list[list[int]], outputs: list[int], clients: int) -> tuple[int, float]:
    """``clients`` streaming clients in a closed loop: client ``i`` sends requests ``i``,
    ``i + clients``, ... one after another, so ``clients`` streams run at once until the end;
    (output tokens, wall seconds)."""
    async def one(session: aiohttp.ClientSession, prompt: list[int], n: int) -> int:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            events = await resp.read()  # the whole stream; the client does as little as it can per token
        usage = events.rsplit(b"data: {", 1)[1].split(b"\n", 1)[0]  # the last chunk carries usage
        return json.loads(b"{" + usage)["usage"]["completion_tokens"]

    async def client(session: aiohttp.ClientSession, i: int) -> int:
        return sum([await one(session, p, n) for p, n in zip(prompts[i::clients], outputs[i::clients])])

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=1800)) as session:
        started = time.perf_counter()
        counts = await asyncio.gather(*(client(session, i) for i in range(min(clients, len(prompts)))))
        return sum(counts), time.perf_counter() - started


def step_seconds(url: str) -> float:
    """The server's summed step model time so far (``cadenza_step_duration_seconds_sum``)."""
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("cadenza_step_duration_seconds_sum"))


def run_mode(model: Path, mode: str, prompts, outputs, warmup: list[list[int]], workdir: Path,
             clients: int = CLIENTS) -> dict:
    args = ["--model", str(model), "--served-model-name", "tiny", "--engine-process", mode, *SERVE_ARGS,
            "--max-num-seqs", str(clients)]
    with serving(args, workdir / f"serve-{mode}.log") as url:
        # Warm up at full concurrency on other prompts (no prefix-cache hits for the timed wave):
        # every batch shape's first allocations, and the front end's first pass over all streams.
        asyncio.run(replay(url, warmup, [8] * len(warmup), clients))
        before = step_seconds(url)
        tokens, wall = asyncio.run(replay(url, prompts, outputs, clients))
        busy = step_seconds(url) - before
    return {"tokens_per_s": tokens / wall, "step_share": busy / wall, "tokens": tokens, "wall_s": wall}


def main() -> None:
    args = arguments(__doc__)
    clients, waves, rounds = (QUICK_CLIENTS, QUICK_WAVES, QUICK_ROUNDS) if args.quick else (CLIENTS, WAVES, ROUNDS)
    workdir = Path(tempfile.mkdtemp(prefix="cadenza-frontend-"))
    model = quick_model() if args.quick else tiny_random_llama(workdir / "tiny-llama")
    timed = waves * clients
    trace, scaling = scale_trace(conv_trace(), length_scale=1 / 8, num_requests=timed + clients)
    lengths = [min(256, max(4, r.input_len)) for r in trace]
    prompts, warmup = prompt_ids(model, lengths[:timed]), prompt_ids(model, lengths[timed:], seed=1)
    outputs = [min(128, max(32, 2 * r.output_len)) for r in trace[:timed]]
    results: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(rounds):
        for mode in ("on", "off"):
            results[mode].append(run_mode(model, mode, prompts, outputs, warmup, workdir, clients))
            last = results[mode][-1]
            print(f"round {r + 1} engine process {mode:>3}: {last['tokens_per_s']:7.1f} output tok/s, "
                  f"step loop {last['step_share']:.0%} of wall time ({last['tokens']} tokens in {last['wall_s']:.1f} s)")
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(results["on"], results["off"])]
    ratio = statistics.median(ratios)
    med = {m: {k: round(statistics.median(x[k] for x in v), 3) for k in ("tokens_per_s", "step_share")}
           for m, v in results.items()}
    print(f"output tok/s, core in its own process / in a thread: {ratio:.2f}x (target >= 1.5); step loop share "
          f"{med['on']['step_share']:.0%} vs {med['off']['step_share']:.0%}")
    report({
        "benchmark": "frontend_overhead",
        "ratio": round(ratio, 3),
        "target": 1.5,
        "per_round_ratios": [round(x, 3) for x in ratios],
        "median": med,
        "workload": {"trace": "azure2023 conv", "clients": clients, "length_scale": scaling.length_scale,
                     "requests": timed, "prompts": "capped at 256", "outputs": "x2, 32 to 128"},
        "model": "random Llama, 2 layers x 64, 384-token vocabulary",
        "pass": ratio >= 1.5,
        "machine": machine(),
    }, quick=args.quick)


if __name__ == "__main__":
    main()
