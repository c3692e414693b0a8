"""End to end on SmolLM2: the engine core in its own process versus in a thread,
``python -m bench.engine_process``.

``cadenza serve`` with the embedded SmolLM2-135M-Instruct, ``--engine-process on`` and ``off``,
each replaying the same slice of the Azure 2023 conversation trace with ``cadenza bench`` (the
first 32 requests, arrivals slowed 1.5x, lengths x1/4, prompts capped at 512 tokens and outputs at
48), four interleaved rounds per mode. Reported per mode (median of the rounds): output tok/s and
p99 TTFT and ITL; the ratios say process over thread for throughput and thread over process for
the latencies, so >= 1 is "no regression" for all three (target: each >= 0.95, within this
machine's run-to-run noise). Last line JSON (``ratio``: the throughput ratio). ``--quick``: one
round of the first 4 requests (outputs capped at 8) on the tests' tiny random Llama.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import CONV_TRACE, arguments, bench_model, machine, report, serving

ROUNDS = 4
REPLAY = ["--num-requests", "32", "--time-scale", "1.5", "--length-scale", "0.25", "--max-input-len", "512",
          "--max-output-len", "48", "--no-progress"]
QUICK_ROUNDS = 1
QUICK_REPLAY = ["--num-requests", "4", "--time-scale", "0.1", "--length-scale", "0.25", "--max-input-len", "256",
                "--max-output-len", "8", "--no-progress"]


def run_mode(model: Path, mode: str, workdir: Path, r: int, replay: list[str] = REPLAY, quick: bool = False) -> dict:
    out = workdir / f"replay-{mode}-{r}.json"
    with serving(["--model", str(model), "--engine-process", mode], workdir / f"serve-{mode}-{r}.log", quick) as url:
        subprocess.run([sys.executable, "-m", "cadenza.node.cli", "bench", "--trace", str(CONV_TRACE),
                        "--base-url", url, "--json", str(out), *replay], check=True, capture_output=True, text=True)
    summary = json.loads(out.read_text())
    return {"output_tok_s": summary["output_tokens_per_s"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "itl_p99_ms": summary["itl_ms"]["p99"], "failed": summary["failed"]}


def main() -> None:
    args = arguments(__doc__)
    model = bench_model(args.quick)
    rounds, replay = (QUICK_ROUNDS, QUICK_REPLAY) if args.quick else (ROUNDS, REPLAY)
    workdir = Path(tempfile.mkdtemp(prefix="cadenza-engine-process-"))
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(rounds):
        for mode in ("on", "off"):
            runs[mode].append(run_mode(model, mode, workdir, r, replay, args.quick))
            last = runs[mode][-1]
            print(f"round {r + 1} engine process {mode:>3}: {last['output_tok_s']:.1f} output tok/s, "
                  f"TTFT p99 {last['ttft_p99_ms']:.0f} ms, ITL p99 {last['itl_p99_ms']:.0f} ms, {last['failed']} failed")
    med = {m: {k: statistics.median(x[k] for x in v) for k in ("output_tok_s", "ttft_p99_ms", "itl_p99_ms")}
           for m, v in runs.items()}
    ratios = {"throughput": med["on"]["output_tok_s"] / med["off"]["output_tok_s"],
              "ttft_p99": med["off"]["ttft_p99_ms"] / med["on"]["ttft_p99_ms"],
              "itl_p99": med["off"]["itl_p99_ms"] / med["on"]["itl_p99_ms"]}
    print("process vs thread: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) + " (>= 1: no regression)")
    report({
        "benchmark": "engine_process",
        "ratio": round(ratios["throughput"], 3),
        "target": 0.95,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "median": {m: {k: round(v, 1) for k, v in d.items()} for m, d in med.items()},
        "failed": sum(x["failed"] for v in runs.values() for x in v),
        "workload": {"trace": "azure2023 conv", "replay": " ".join(replay)},
        "pass": all(v >= 0.95 for v in ratios.values()),
        "machine": machine(),
    }, quick=args.quick)


if __name__ == "__main__":
    main()
