"""Hybrid mode over a compressed day, in the simulator: ``python -m bench.sim_hybrid_day``.

Issue 31's proof at fleet scale: on load that changes over a day, does ``auto`` (retune, dedicate,
disaggregate, and back) deliver more batch work than any static shape while holding the
interactive SLO?

**The pool.** Three replicas of Llama-3.1-8B on H100 (the data-sheet profile, as in
``bench/sim_hybrid``), 400 Gb/s RDMA between them for the KV of prompts prefilled elsewhere, 128
sequences per replica. Three, not more: the simulator costs ~0.1 s of a core per simulated
second at this load, and the whole bench must run in ~25 minutes on two cores. SLOs: interactive TTFT p99 <= 1 s and ITL p99 <= 25 ms; batch TTFT p99 <=
10 s (batch wants throughput: its target says "faster than this would be welcome").

**The day** (:mod:`cadenza.loadgen.day`, seed :data:`SEED`): one hour stands for 24. Interactive
is the conversation trace's requests at a rate that follows a diurnal curve (peak :data:`DAY`
``peak_rps`` at 15:00, a quarter of it at 03:00) with minute-scale bursts (one every 10 min on
average, 1-3 min long, x1.3-1.8); batch is the code trace's, offered against the interactive
phase (``batch_rps`` at the interactive trough, a quarter of it at the peak) with prompts up to
twice as long as recorded in its phase.

**Batch is work to be done as fast as the pool can.** A batch runner keeps :data:`BATCH_IN_FLIGHT`
requests in flight and sends the next as one ends (:class:`cadenza.sim.client.ConcurrencyLimit`);
what is offered beyond waits at the runner, never in the gateway, so nothing is refused for the
backlog and the pool's batch throughput is what its shape can deliver. The offered rate is above
what any shape delivers in the batch phase, so the runner's queue never empties there. At the
day's end the runner stops sending: what still waits is reported as unsent, not failed; tokens
count only up to the day's end.

**Shapes**, each the same pool document in another mode, every one on the same trace:
- ``colocated b``: every replica serves every class at token budget = chunk size = b, for b in
  :data:`BUDGETS` (the settings ``auto`` may retune between; the budget, not the chunk, bounds a
  step once batch is queued, since several prompts' chunks share it; 2,048 is left out: 1,024
  already misses the ITL target in every window);
- ``dedicated k+m``: k interactive-only replicas at 512 (budget and chunk) beside m batch ones at
  2,048, for every split;
- ``disaggregated p``: p prefill replicas at 2,048 and the others decoding every class at 512,
  the gateway moving prompts by the selective rule, for every p;
- ``auto``: starts colocated at the pool's 1,024; its controller (:data:`CONTROLLER`: windows
  30 s / 120 s, 15 s scrape delay, budget and chunk bounds 512-1,024, retune factor 0.5,
  hysteresis 25 %, cooldown 300 s, dwell 120 s) retunes, dedicates and disaggregates at run time,
  its prefill replicas at 2,048. The floor is 512 because a 256-token budget leaves interactive's
  own prompts too little of each step at the peak (``colocated 256`` misses its bursts); the
  hysteresis is 25 % because growing doubles the prefill part of a step, so it is safe only well
  below the ITL target (at 10 % the controller grew 512 -> 1,024 into a breach every few minutes).

**Reported** per shape: the share of one-minute windows meeting the interactive SLO (p99 TTFT
and ITL of the window's observations, as the gateway records them, within target, and no
interactive request refused), batch output tokens/s over the day, failed (refused) requests,
unsent batch, and reshapes per simulated hour. Then ``ratio``: auto's batch tokens/s over the
best static shape's among those meeting the SLO in >= 95 % of windows (chosen in hindsight);
``oracle_ratio``: auto's over a per-window oracle that takes, in each window, the most batch
tokens any static shape produced while meeting the SLO there (any static shape's most where none
met it), switching for free. Targets (issue 31): ratio >= 1.25, oracle_ratio >= 0.85, auto meets
the SLO in >= 95 % of windows, 0 failed, <= 6 reshapes per simulated hour.

``--steady`` adds the steady control: the #13 workload of ``bench/sim_hybrid`` (its functions,
its pool), auto against every static shape there (colocated at the pool's knobs and at 128-token
chunks, dedicated 7+1 at both), target auto >= 0.97x the best. ``--jobs`` runs shapes in that
many processes (default 2). ``--quick``: a 4-minute day at a tenth of the rates, three shapes.
"""

from __future__ import annotations

import argparse
import copy
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from bench.common import CONV_TRACE, ROOT, arguments, machine, report
from cadenza.loadgen.day import Day, DayRecipe
from cadenza.loadgen.trace import TraceRequest, load_trace
from cadenza.sim.client import ConcurrencyLimit
from cadenza.sim.disagg import KVLinkModel
from cadenza.sim.hardware import PROFILES
from cadenza.sim.model_dims import load_model_dims
from cadenza.sim.policies import Policy, PolicyRun, run_policy
from cadenza.sim.pool import fleet_layout
from cadenza.sim.roofline import Roofline

CODE_TRACE = ROOT / "data" / "traces" / "azure2023" / "AzureLLMInferenceTrace_code.csv"
MODEL, HARDWARE = "llama-3.1-8b", "h100-sxm"
REPLICAS = 3
SEED = 31
DAY = DayRecipe(duration_s=3600.0, peak_rps=30.0, peak_to_trough=4.0, peak_hour=15.0, burst_every_s=600.0,
                burst_s=(60.0, 180.0), burst_factor=(1.3, 1.8), batch_rps=60.0, batch_floor=0.25,
                batch_prompt_scale=2.0)
QUICK_DAY = DayRecipe(duration_s=240.0, peak_rps=4.0, peak_to_trough=4.0, peak_hour=15.0, burst_every_s=60.0,
                      burst_s=(10.0, 30.0), burst_factor=(1.3, 1.8), batch_rps=2.0, batch_floor=0.25,
                      batch_prompt_scale=2.0)
BATCH_IN_FLIGHT = 96  # the batch runner's concurrency: the pool's, not a replica's
WINDOW_S, QUICK_WINDOW_S = 60.0, 20.0
MIN_SHARE = 0.95  # of windows meeting the interactive SLO, for a static shape to count
LINK = KVLinkModel(bytes_per_s=400e9 / 8, latency_s=10e-6)  # 400 Gb/s RDMA
SLO = {"interactive": {"ttftP99Ms": 1000, "itlP99Ms": 25}, "batch": {"ttftP99Ms": 10000}}
BUDGETS = (256, 512, 1024)
SPLIT_BUDGET, BULK_BUDGET = 512, 2048  # interactive / decode replicas; batch / prefill replicas
CONTROLLER = {"fastWindowSeconds": 30, "windowSeconds": 120, "minSamples": 100, "cooldownSeconds": 300,
              "dwellSeconds": 120, "flapWindowSeconds": 1200, "retuneFactor": 0.5, "hysteresis": 0.25,
              "bounds": {"chunkSize": {"min": 512, "max": 1024}, "tokenBudget": {"min": 512, "max": 1024}}}
POOL = {
    "apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool",
    "metadata": {"name": "day", "namespace": "default"},
    "spec": {"model": {"name": "Llama-3.1-8B-Instruct", "source": {"path": "/models/llama"}},
             "replicas": REPLICAS, "mode": "colocated",
             "engine": {"tokenBudget": 1024, "chunkSize": 1024, "maxNumSeqs": 128, "maxModelLen": 16384},
             "slo": SLO, "controller": CONTROLLER},
}


def _engine(budget: int) -> dict:
    return {"tokenBudget": budget, "chunkSize": budget}


def shapes(replicas: int = REPLICAS, budgets=BUDGETS) -> dict[str, dict]:
    """Every shape's pool document, by name: colocated at each budget, dedicated at each split,
    disaggregated at each prefill count, and auto."""
    out = {}
    for b in budgets:
        doc = copy.deepcopy(POOL)
        doc["spec"]["replicas"] = replicas
        doc["spec"]["engine"].update(_engine(b))
        out[f"colocated {b}"] = doc
    for k in range(1, replicas):
        doc = copy.deepcopy(POOL)
        doc["spec"].update(replicas=replicas, mode="dedicated",
                           dedicated={"interactiveReplicas": k, "engine": _engine(SPLIT_BUDGET)})
        doc["spec"]["engine"].update(_engine(BULK_BUDGET))
        out[f"dedicated {k}+{replicas - k}"] = doc
    for p in range(1, replicas):
        doc = copy.deepcopy(POOL)
        doc["spec"].update(replicas=replicas, mode="disaggregated",
                           disaggregated={"prefillReplicas": p, "prefillEngine": _engine(BULK_BUDGET),
                                          "decodeEngine": _engine(SPLIT_BUDGET)})
        out[f"disaggregated {p}"] = doc
    doc = copy.deepcopy(POOL)
    doc["spec"].update(replicas=replicas, mode="auto", disaggregated={"prefillEngine": _engine(BULK_BUDGET)})
    out["auto"] = doc
    return out


def day_trace(recipe: DayRecipe, seed: int = SEED) -> list[TraceRequest]:
    """The day's requests (:class:`cadenza.loadgen.day.Day` on the shipped Azure traces)."""
    return Day(recipe, seed).trace(load_trace(CONV_TRACE), load_trace(CODE_TRACE))


def windows(run: PolicyRun, duration_s: float, window_s: float) -> dict:
    """Per window of ``window_s``: interactive p99 TTFT / ITL (ms, exact, of the observations the
    gateway records: TTFTs at their first token, gaps at their later token), whether the SLO was
    met (both within target and no interactive request refused), and batch output tokens."""
    fleet, n = run.fleet, int(round(duration_s / window_s))
    target = SLO["interactive"]
    obs = fleet.observations.get("interactive")
    edges = np.arange(n + 1) * window_s

    def p99(times, values) -> list[float]:
        t, v = np.asarray(times), np.asarray(values) * 1e3
        k = np.searchsorted(edges, t, side="left") - 1  # (start, end] -> window k
        return [float(np.percentile(v[k == i], 99)) if np.any(k == i) else 0.0 for i in range(n)]

    ttft = p99(obs.ttft_t, obs.ttft_s) if obs else [0.0] * n
    itl = p99(obs.itl_t, obs.itl_s) if obs else [0.0] * n
    refused = np.histogram(fleet.drop_times.get("interactive", []), bins=edges)[0]
    tokens = np.histogram([s for t in fleet.timelines("batch") for s in t.token_s], bins=edges)[0]
    met = [ttft[i] <= target["ttftP99Ms"] and itl[i] <= target["itlP99Ms"] and not refused[i] for i in range(n)]
    return {"ttft_p99_ms": ttft, "itl_p99_ms": itl, "met": met, "batch_tokens": tokens.tolist()}


def run_shape(name: str, doc: dict, recipe: DayRecipe, window_s: float) -> dict:
    """One shape over the day: its per-window figures, totals and (auto) actions."""
    started = time.process_time()
    model = Roofline(load_model_dims(MODEL), PROFILES[HARDWARE])
    trace = day_trace(recipe)
    client = ConcurrencyLimit({"batch": BATCH_IN_FLIGHT}, until_s=recipe.duration_s)
    run = run_policy(Policy(name, fleet_layout(doc, model), link=LINK), trace, model, client=client)
    per = windows(run, recipe.duration_s, window_s)
    batch = run.fleet.timelines("batch")
    hours = recipe.duration_s / 3600.0
    return {
        "name": name, **per,
        "met_share": sum(per["met"]) / len(per["met"]),
        "batch_tok_s": sum(per["batch_tokens"]) / recipe.duration_s,
        "failed": run.result.dropped,
        "unsent_batch": client.unsent()["batch"],
        "batch_finished_after_day": sum(1 for t in batch if t.finished_s is not None and t.finished_s > recipe.duration_s),
        "batch_requests": len(batch),
        "reshapes_per_hour": run.reshapes / hours,
        "actions": [(round(a.time_s), a.action, a.move or a.knobs, a.acted, a.reason) for a in run.actions],
        "kv_transfer": run.result.kv_transfer,
        "cpu_s": time.process_time() - started,
    }


def oracle(static: list[dict]) -> list[float]:
    """Per window, the most batch tokens a static shape produced while meeting the SLO there (the
    most any produced where none met it): the best shape for each window, switched for free."""
    out = []
    for i in range(len(static[0]["met"])):
        meeting = [s["batch_tokens"][i] for s in static if s["met"][i]]
        out.append(max(meeting) if meeting else max(s["batch_tokens"][i] for s in static))
    return out


def _print_row(r: dict) -> None:
    print(f"{r['name']:>18}: SLO met in {100 * r['met_share']:5.1f} % of windows; batch {r['batch_tok_s']:7.1f} "
          f"output tok/s; {r['failed']} failed, {r['unsent_batch']} batch unsent; "
          f"{r['reshapes_per_hour']:.1f} reshapes/h ({r['cpu_s']:.0f} s CPU)", flush=True)


def _timeline(auto: dict, best: list[float], window_s: float) -> None:
    """Auto window by window, its actions marked."""
    acted = {}
    for t, action, what, did, _reason in auto["actions"]:
        if did:
            acted.setdefault(int(t // window_s), []).append(f"{action} {what}")
    print("auto, window by window (p99 TTFT / ITL ms, SLO met, batch tok/s, oracle's; actions):")
    for i, met in enumerate(auto["met"]):
        print(f"  {i * window_s:6.0f} s  {auto['ttft_p99_ms'][i]:6.0f} / {auto['itl_p99_ms'][i]:5.1f}  "
              f"{'met ' if met else 'MISS'}  {auto['batch_tokens'][i] / window_s:7.1f} / {best[i] / window_s:7.1f}"
              f"  {'; '.join(acted.get(i, []))}")


def _steady(jobs: int, quick: bool) -> dict:
    """The #13 workload (``bench/sim_hybrid``): auto against every static shape there."""
    from bench import sim_hybrid as steady

    shape = steady.QUICK if quick else dict(duration_s=steady.DURATION_S, copies=steady.CONV_COPIES,
                                             bursts=steady.BURSTS, burst_s=steady.BURST_S)
    colocated_128 = steady.pool("colocated")
    colocated_128["spec"]["engine"]["chunkSize"] = steady.DEDICATED_CHUNK
    docs = {"colocated": steady.pool("colocated"), f"colocated, chunk {steady.DEDICATED_CHUNK}": colocated_128,
            "dedicated 7+1": steady.pool("dedicated", 7),
            f"dedicated 7+1, chunk {steady.DEDICATED_CHUNK}": steady.pool("dedicated", 7, steady.DEDICATED_CHUNK),
            "auto": steady.pool("auto")}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {name: pool.submit(_steady_run, name, doc, shape) for name, doc in docs.items()}
        goodput = {name: f.result() for name, f in futures.items()}
    static = {n: g for n, g in goodput.items() if n != "auto"}
    best = max(static, key=static.get)
    ratio = goodput["auto"] / static[best] if static[best] else float("inf")
    print(f"steady control (#13 workload): auto {goodput['auto']:.2f} req/s goodput, best static {best} "
          f"{static[best]:.2f}: {ratio:.3f}x (target >= 0.97)")
    return {"goodput_rps": {n: round(g, 2) for n, g in goodput.items()}, "best_static": best,
            "ratio": round(ratio, 3), "target": 0.97}


def _steady_run(name: str, doc: dict, shape: dict) -> float:
    from bench import sim_hybrid as steady

    model = Roofline(load_model_dims("llama-3.1-8b"), PROFILES["h100-sxm"])
    trace = steady.workload(True, shape["duration_s"], shape["copies"], shape["bursts"], shape["burst_s"])
    return steady.run(name, doc, trace, model).goodput_rps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="shapes run at once, each in its own process")
    parser.add_argument("--steady", action="store_true", help="also run the steady control (the #13 workload)")
    args = arguments(__doc__, parser)
    recipe, window_s = (QUICK_DAY, QUICK_WINDOW_S) if args.quick else (DAY, WINDOW_S)
    docs = shapes(budgets=(512,), replicas=2) if args.quick else shapes()
    if args.quick:
        docs = {n: d for n, d in docs.items() if n in ("colocated 512", "disaggregated 1", "auto")}
    trace = day_trace(recipe)
    print(f"{len(trace)} requests over a {recipe.duration_s:.0f} s day (seed {SEED}): "
          f"{sum(r.traffic_class == 'interactive' for r in trace)} interactive, "
          f"{sum(r.traffic_class == 'batch' for r in trace)} batch offered; windows of {window_s:.0f} s", flush=True)
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {name: pool.submit(run_shape, name, doc, recipe, window_s) for name, doc in docs.items()}
        runs = {}
        for name, future in futures.items():
            runs[name] = future.result()
            _print_row(runs[name])
    auto = runs.pop("auto")
    static = list(runs.values())
    holding = [r for r in static if r["met_share"] >= MIN_SHARE]
    best = max(holding or static, key=lambda r: r["batch_tok_s"])
    ratio = auto["batch_tok_s"] / best["batch_tok_s"] if best["batch_tok_s"] else float("inf")
    per_window = oracle(static)
    oracle_tok_s = sum(per_window) / recipe.duration_s
    oracle_ratio = auto["batch_tok_s"] / oracle_tok_s if oracle_tok_s else float("inf")
    _timeline(auto, per_window, window_s)
    for t, action, what, did, reason in auto["actions"]:
        print(f"    t={t} s {action} {what}{'' if did else ' (not acted)'}: {reason}")
    print(f"best static shape holding the SLO in >= {MIN_SHARE:.0%} of windows: "
          f"{best['name'] if holding else 'none (best of all shown)'} at {best['batch_tok_s']:.1f} tok/s")
    print(f"auto / best static: {ratio:.3f}x (target >= 1.25); auto / per-window oracle ({oracle_tok_s:.1f} tok/s): "
          f"{oracle_ratio:.3f}x (target >= 0.85); auto meets the SLO in {100 * auto['met_share']:.1f} % of windows, "
          f"{auto['failed']} failed, {auto['reshapes_per_hour']:.1f} reshapes per simulated hour (target <= 6); "
          f"{time.perf_counter() - started:.0f} s wall", flush=True)
    steady = _steady(max(1, args.jobs), args.quick) if args.steady else None
    passed = (bool(holding) and ratio >= 1.25 and oracle_ratio >= 0.85 and auto["met_share"] >= MIN_SHARE
              and auto["failed"] == 0 and auto["reshapes_per_hour"] <= 6
              and (steady is None or steady["ratio"] >= 0.97))
    all_runs = [*static, auto]
    report({
        "benchmark": "sim_hybrid_day",
        "ratio": round(ratio, 3),
        "target": 1.25,
        "oracle_ratio": round(oracle_ratio, 3), "oracle_target": 0.85,
        "best_static": best["name"] if holding else None,
        "shapes": {r["name"]: {"slo_windows": round(r["met_share"], 3), "batch_tok_s": round(r["batch_tok_s"], 1),
                               "failed": r["failed"], "unsent_batch": r["unsent_batch"],
                               "reshapes_per_hour": round(r["reshapes_per_hour"], 1)} for r in all_runs},
        "oracle_tok_s": round(oracle_tok_s, 1),
        "auto_actions": [(t, a, w) for t, a, w, did, _ in auto["actions"] if did],
        "steady": steady,
        "slo": SLO,
        "setup": {"model": MODEL, "hardware": HARDWARE, "replicas": 2 if args.quick else REPLICAS,
                  "link_gbps": LINK.bytes_per_s * 8 / 1e9, "seed": SEED, "day": {
                      k: getattr(recipe, k) for k in recipe.__dataclass_fields__}, "window_s": window_s,
                  "batch_in_flight": BATCH_IN_FLIGHT, "controller": CONTROLLER},
        "prefix_caching": True, "prefix_cache_hit_rate": 0.0,
        "pass": passed,
        "machine": machine(),
    }, quick=args.quick)


if __name__ == "__main__":
    main()
