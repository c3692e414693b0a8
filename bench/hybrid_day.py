"""Hybrid mode on a compressed day, on this machine: ``python -m bench.hybrid_day``.

Issue 31's local proof: ``cadenza up`` with three replicas of SmolLM2-135M-Instruct (one core
each, on however many cores the machine has: on the recorded 2-core machine they share two) on a
scaled version of the compressed day of :mod:`cadenza.loadgen.day` — the shape of its default
recipe (interactive peak/trough 4, peak at hour 15, bursts of 1.3-1.8x, batch phased against it
with a floor of 25 % and prompts twice as long at the interactive trough), with its clock, rates
and lengths scaled for SmolLM2 on CPU (:class:`Sizing`): a day of 300 s, interactive up to 0.7
requests/s (the conversation trace, prompts /8 capped at 256 tokens, outputs /8 capped at 32,
at least 8), batch up to 2 requests/s (the code trace, prompts /4 capped at 512 before the
day doubles them, outputs capped at 32, at least 8), bursts every 50 s on average lasting 5-15 s.
The batch client keeps at most 6 requests in flight (a batch system soaking up spare capacity;
the others wait in its queue, their TTFT counted from when they are sent), and at the day's end
its unfinished requests are cut (not failures); interactive requests are all awaited.
Why these sizes: on one free core a SmolLM2 decode step takes ~200 ms and every 256 prefill tokens
in it add ~1 s (``bench/hybrid.py``), and three replicas on two cores are slower still, so chunks
of 256 beside interactive decodes break a 600 ms ITL while chunks of 32 keep it at half the
prefill rate; 0.7 requests/s at the peak is more interactive load than one replica serves within
4 s TTFT (``bench/hybrid.py``'s dedicated run missed at 0.63 on a free core), 0.175 at the trough
is less; batch offers more prompt tokens than any shape computes, at the trough and (a quarter of
it) at the peak, so a backlog waits at the batch client all day and batch throughput is the
shape's (at 0.4 requests/s, on 2026-12-05, every shape delivered the same 3.98 tok/s: the offer); a 300 s day with 20 s windows (3 requests at the trough) gives the controller
(10 s / 30 s windows, 45 s cooldown) room for a few moves and keeps the seven runs near 40 minutes.

Same day, same seed, one run after another (``--shapes`` picks): static ``colocated`` at chunk
32 and 256; ``dedicated`` 1+2 and 2+1 (interactive replicas + batch replicas; the interactive
ones at chunk 32, the batch ones at 256); ``disaggregated`` with 1 and 2 prefill replicas
(prompts of 384 tokens or more prefilled there at chunk 512; the decode replicas at chunk 32);
and ``auto`` (starts colocated at chunk 256; the controller retunes within chunk 32-256, dedicates
with the dedicated shape's settings, disaggregates with the disaggregated shape's; windows 10 s /
30 s from 5 requests, cooldown 45 s, dwell 30 s).

Per run: per 20 s window the interactive TTFT p99 and ITL p99 and whether the interactive SLO
(TTFT p99 <= 4 s, ITL p99 <= 600 ms) held (a window with fewer than 3 interactive requests is not
judged); the windows held and their share of the judged ones; batch output tokens/s (tokens
streamed within the day over its length); failed requests; the controller's actions and
reshapes per hour (of the run's clock). The best static shape: the one holding the SLO in the
most windows, ties broken by batch tokens/s. Targets: ``auto`` holds the SLO in at least as many
windows as the best static shape and delivers >= 1.1x its batch tokens/s (``ratio``); no failed
request in any run. ``--plot`` writes ``docs/img/hybrid_day.png``: each run's windows over the
day's rates, with the controller's actions (retune / dedicate / disaggregate / merge / aggregate).

``--quick``: the tests' tiny random Llama on an 8 s day in 4 s windows judged from one request,
two of the shapes: disaggregated 1 and auto (``bench/hybrid.py``'s quick run takes the other paths).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from bench import pool_runs
from bench.common import CONV_TRACE, ROOT, arguments, machine, prompt_ids, quick_model, report
from bench.pool_runs import Job
from cadenza.loadgen.day import Day, DayRecipe
from cadenza.loadgen.trace import TraceRequest, load_trace
from cadenza.node.embedded import ensure_embedded_model

CODE_TRACE = ROOT / "data" / "traces" / "azure2023" / "AzureLLMInferenceTrace_code.csv"
SLO = {"interactive": {"ttftP99Ms": 4000, "itlP99Ms": 600}, "batch": {"ttftP99Ms": 60000}}
FIGURE = ROOT / "docs" / "img" / "hybrid_day.png"
BEST_STATIC_RULE = "the static shape holding the interactive SLO in the most windows, ties broken by batch tokens/s"


@dataclass(frozen=True)
class Sizing:
    """The day and the pools, scaled to the machine: the defaults are the recorded run's,
    :data:`QUICK` is ``--quick``'s.

    A day of ``duration_s`` seconds with the default :class:`DayRecipe`'s shape (its bursts'
    timing scaled with the day), interactive at ``peak_rps`` at its peak and batch at
    ``batch_rps`` at the interactive trough; prompts scaled by ``*_prompt_scale`` and capped at
    ``*_prompt_cap`` tokens, outputs scaled and capped at ``output_cap`` (at least
    ``min_output``); at most ``batch_in_flight`` batch requests in flight. Judged in windows of
    ``window_s`` seconds from ``min_window_requests`` interactive requests. Replicas at
    ``chunks`` (smallest: the interactive-serving replicas of the split shapes and auto's lower
    bound; largest: the batch-serving ones and auto's start); prompts of ``min_prompt_tokens`` or
    more prefilled on the prefill replicas. The pool serves ``model_path`` (None: the embedded
    model) as ``model_name``.
    """

    duration_s: float = 300.0
    window_s: float = 20.0
    min_window_requests: int = 3
    peak_rps: float = 0.7
    batch_rps: float = 2.0
    batch_in_flight: int = 6
    chat_prompt_scale: float = 1 / 8
    chat_prompt_cap: int = 256
    chat_output_scale: float = 1 / 8
    code_prompt_scale: float = 1 / 4
    code_prompt_cap: int = 512
    code_output_scale: float = 1.0
    output_cap: int = 32
    min_output: int = 8
    chunks: tuple[int, ...] = (32, 256)
    prefill_chunk: int = 512
    min_prompt_tokens: int = 384
    max_model_len: int = 2048
    model_name: str = "SmolLM2-135M-Instruct"
    model_path: str | None = None

    def recipe(self) -> DayRecipe:
        """:class:`DayRecipe`'s shape on this day's clock, rates and model length."""
        base, k = DayRecipe(), self.duration_s / DayRecipe().duration_s
        return replace(base, duration_s=self.duration_s, peak_rps=self.peak_rps, batch_rps=self.batch_rps,
                       burst_every_s=base.burst_every_s * k, burst_s=(base.burst_s[0] * k, base.burst_s[1] * k),
                       max_model_len=self.max_model_len)

    def shapes(self) -> list[str]:
        """Every run's name: each static shape, then ``auto``."""
        return ([f"colocated:{c}" for c in self.chunks] + ["dedicated:1+2", "dedicated:2+1", "disaggregated:1",
                                                            "disaggregated:2", "auto"])


FULL = Sizing()
QUICK = Sizing(duration_s=8.0, window_s=4.0, min_window_requests=1, peak_rps=3.0, batch_rps=2.0, batch_in_flight=4,
               chat_prompt_cap=128, code_prompt_cap=192, output_cap=12, min_output=4, chunks=(32, 128),
               prefill_chunk=256, min_prompt_tokens=160, max_model_len=1024, model_name="tiny")
QUICK_SHAPES = ("disaggregated:1", "auto")  # the paths hybrid's quick run does not take


def scaled(trace: list[TraceRequest], prompt_scale: float, prompt_cap: int, output_scale: float, sizing: Sizing
           ) -> list[TraceRequest]:
    """``trace`` with each prompt scaled by ``prompt_scale`` and capped at ``prompt_cap`` tokens,
    each output scaled by ``output_scale`` and held within ``sizing``'s ``min_output`` and
    ``output_cap`` (lengths rounded, at least 1)."""
    out = []
    for r in trace:
        prompt = min(prompt_cap, max(1, round(r.input_len * prompt_scale)))
        output = min(sizing.output_cap, max(sizing.min_output, round(r.output_len * output_scale)))
        out.append(TraceRequest(r.arrival_s, prompt, output, r.traffic_class, r.tenant))
    return out


def workload(model: Path, sizing: Sizing, seed: int) -> tuple[list[Job], Day]:
    """The day's requests as jobs (prompts synthesized at their lengths from ``model``'s
    tokenizer), and the day they come from."""
    conv = scaled(load_trace(CONV_TRACE), sizing.chat_prompt_scale, sizing.chat_prompt_cap,
                  sizing.chat_output_scale, sizing)
    code = scaled(load_trace(CODE_TRACE), sizing.code_prompt_scale, sizing.code_prompt_cap,
                  sizing.code_output_scale, sizing)
    day = Day(sizing.recipe(), seed)
    requests = day.trace(conv, code)
    prompts = prompt_ids(model, [r.input_len for r in requests], seed=seed)
    return [Job(r.arrival_s, r.traffic_class, p, r.output_len) for r, p in zip(requests, prompts)], day


def pool_doc(name: str, sizing: Sizing) -> dict:
    """The ServingPool of a run: ``colocated:CHUNK``, ``dedicated:I+B``, ``disaggregated:P`` or
    ``auto`` (module docstring), three replicas of one core each.

    Raises:
        ValueError: an unknown name.
    """
    mode, _, arg = name.partition(":")
    small, big = min(sizing.chunks), max(sizing.chunks)
    engine = {"tokenBudget": max(512, big), "chunkSize": big, "maxNumSeqs": 16, "maxModelLen": sizing.max_model_len,
              "blockSize": 16}
    dedicated = {"engine": {"chunkSize": small}}
    disaggregated = {"minPromptTokens": sizing.min_prompt_tokens,
                     "prefillEngine": {"chunkSize": sizing.prefill_chunk, "tokenBudget": sizing.prefill_chunk}}
    spec: dict = {"replicas": 3, "mode": mode}
    if mode == "colocated":
        engine["chunkSize"] = int(arg)
    elif mode == "dedicated":
        interactive, batch = (int(n) for n in arg.split("+"))
        if interactive + batch != 3:
            raise ValueError(f"{name}: a split of the 3 replicas")
        spec["dedicated"] = dedicated | {"interactiveReplicas": interactive}
    elif mode == "disaggregated":
        spec["disaggregated"] = disaggregated | {"prefillReplicas": int(arg), "decodeEngine": {"chunkSize": small}}
    elif mode == "auto" and not arg:
        spec |= {"dedicated": dedicated, "disaggregated": disaggregated, "controller": {
            "fastWindowSeconds": 10, "windowSeconds": 30, "minSamples": 5, "staleSeconds": 20,
            "cooldownSeconds": 45, "dwellSeconds": 30, "retuneFactor": 0.5, "disaggregate": True,
            "bounds": {"chunkSize": {"min": small, "max": big}}}}
    else:
        raise ValueError(f"unknown shape {name!r} (colocated:CHUNK, dedicated:I+B, disaggregated:P or auto)")
    model = {"name": sizing.model_name} | ({"source": {"path": sizing.model_path}} if sizing.model_path else {})
    spec |= {"model": model, "engine": engine, "slo": SLO,
             "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}}}
    return {"apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool",
            "metadata": {"name": "day-" + name.replace(":", "-").replace("+", "-"), "namespace": "default"},
            "spec": spec}


def run_shape(name: str, jobs: list[Job], workdir: Path, sizing: Sizing, stop_at_s: float) -> dict:
    """One run of the day (to ``stop_at_s``) on the shape ``name``, judged."""
    run = pool_runs.run_pool(name.replace(":", "-"), pool_doc(name, sizing), [j for j in jobs if j.at < stop_at_s],
                             workdir, sizing.model_name, in_flight={"batch": sizing.batch_in_flight},
                             cut_at_s=stop_at_s, cut=("batch",))
    out = pool_runs.summarize(name, run, slo=SLO, duration_s=stop_at_s, window_s=sizing.window_s,
                              min_window_requests=sizing.min_window_requests, batch_over_s=stop_at_s)
    out["slo_windows"] = sum(w["slo_met"] is True for w in out["windows"])
    out["batch_cut"] = sum(r.cut for r in run.results if r.cls == "batch")
    out["reshapes_per_hour"] = round(out["reshapes"] * 3600 / stop_at_s, 1)
    return out


def best_static(runs: dict) -> str | None:
    """The best static shape (:data:`BEST_STATIC_RULE`) among ``runs``; None without one."""
    static = [n for n in runs if n != "auto"]
    return max(static, key=lambda n: (runs[n]["slo_windows"], runs[n]["batch_output_tokens_per_s"]), default=None)


def plot(runs: dict, day: Day, sizing: Sizing, path: Path = FIGURE) -> None:
    """Each run's windows over the day's offered rates (interactive and batch, each over its
    largest), with the controller's actions marked."""
    t = np.linspace(0.0, sizing.duration_s, 600)
    inter, batch = day.interactive_rps(t), day.batch_rps(t)

    def rates(ax) -> None:
        twin = ax.twinx()
        twin.fill_between(t, inter / inter.max(), color="tab:cyan", alpha=0.15, lw=0)
        twin.plot(t, batch / batch.max(), color="tab:orange", alpha=0.5, lw=1)
        twin.set_ylim(0, 1.05)
        twin.set_yticks([])
        ax.set_zorder(twin.get_zorder() + 1)  # the windows' bars over the rates
        ax.patch.set_visible(False)

    pool_runs.plot(runs, path, slo=SLO, window_s=sizing.window_s, background=rates,
                   note="; shaded: interactive rate, orange line: batch rate (each over its peak)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", action="store_true", help=f"write {FIGURE.relative_to(ROOT)}")
    parser.add_argument("--replot", type=Path, metavar="LOG",
                        help="only redraw the figure from a saved run's output (its last line)")
    parser.add_argument("--shapes", help="runs to make, comma-separated (default: every static shape and auto; "
                                         "the ratio needs auto and at least one static shape)")
    parser.add_argument("--seed", type=int, default=0, help="the day's seed (default 0)")
    parser.add_argument("--stop-at", type=float, metavar="S",
                        help="end each run S seconds into the day (a partial run: judged to there)")
    args = arguments(__doc__, parser)
    if args.quick and (args.plot or args.replot):
        parser.error(f"--plot redraws {FIGURE.relative_to(ROOT)} from a recorded run, not from a --quick one")
    if args.quick:
        sizing = replace(QUICK, model_path=str(quick_model()))
        default_shapes = list(QUICK_SHAPES)
    else:
        sizing, default_shapes = FULL, FULL.shapes()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()] if args.shapes else default_shapes
    for name in shapes:
        pool_doc(name, sizing)  # an unknown name fails now, not after an hour of runs
    if args.replot:
        line = json.loads(args.replot.read_text().strip().splitlines()[-1])
        recipe = DayRecipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in line["recipe"].items()})
        plot(line["runs"], Day(recipe, line["seed"]), replace(sizing, duration_s=recipe.duration_s))
        return
    jobs, day = workload(Path(sizing.model_path) if sizing.model_path else ensure_embedded_model(), sizing, args.seed)
    stop_at = min(args.stop_at or sizing.duration_s, sizing.duration_s)
    n_batch = sum(j.cls == "batch" for j in jobs)
    print(f"day: {len(jobs) - n_batch} interactive + {n_batch} batch requests over {sizing.duration_s:.0f} s "
          f"(seed {args.seed}, {len(day.bursts)} bursts; recipe {asdict(sizing.recipe())}); SLO {SLO['interactive']}"
          + (f"; each run stops at {stop_at:.0f} s" if stop_at < sizing.duration_s else ""))
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench-hybrid-day-") as tmp:
        for name in shapes:
            started = time.monotonic()
            runs[name] = r = run_shape(name, jobs, Path(tmp), sizing, stop_at)
            print(f"{name:>15}: windows (TTFT p99 / ITL p99 ms): "
                  + " ".join(f"{w['ttft_p99_ms']}/{w['itl_p99_ms']}"
                             f"{'' if w['slo_met'] else '!' if w['slo_met'] is False else '?'}" for w in r["windows"]))
            print(f"{name:>15}: SLO held in {r['slo_windows']} of {r['windows_judged']} judged windows; batch "
                  f"{r['batch_output_tokens_per_s']} tok/s ({r['batch_cut']} cut at the end); failed {r['failed']}; "
                  f"actions {[(a['at_s'], a['move'] or a['knobs']) for a in r['actions']]}; "
                  f"{time.monotonic() - started:.0f} s wall", flush=True)
    best = best_static(runs)
    auto = runs.get("auto")
    ratio = (auto["batch_output_tokens_per_s"] / runs[best]["batch_output_tokens_per_s"]
             if auto and best and runs[best]["batch_output_tokens_per_s"] else 0.0)
    if args.plot:
        plot(runs, day, sizing)
    report({
        "benchmark": "hybrid_day",
        "ratio": round(ratio, 3),
        "target": 1.1,
        "best_static": best,
        "best_static_rule": BEST_STATIC_RULE,
        "slo_windows": {n: r["slo_windows"] for n, r in runs.items()},
        "windows_judged": {n: r["windows_judged"] for n, r in runs.items()},
        "batch_output_tokens_per_s": {n: r["batch_output_tokens_per_s"] for n, r in runs.items()},
        "failed": {n: r["failed"] for n, r in runs.items()},
        "auto_reshapes_per_hour": auto and auto["reshapes_per_hour"],
        "pass": bool(auto and best and auto["slo_windows"] >= runs[best]["slo_windows"] and ratio >= 1.1
                     and not any(r["failed"] for r in runs.values())),
        "seed": args.seed,
        "stopped_at_s": stop_at,
        "recipe": asdict(sizing.recipe()),
        "runs": runs,
        "machine": machine(),
    }, quick=args.quick)


if __name__ == "__main__":
    main()
