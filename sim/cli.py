"""``cadenza sim``: a ServingPool and a trace through the simulator (registered through the
``cadenza.commands`` entry point, as ``cadenza up`` is).

    cadenza sim --trace T.csv --pool P.yaml --model llama-3.1-8b --hardware h100-sxm [--tp N]
                [--time-scale F | --qps-scale F] [--length-scale F] [--num-requests N]
                [--class NAME | --batch-above N]
                [--compare [POLICY ...]] [--sweep] [--json OUT] [--plot DIR]
    cadenza sim calibrate --steps STEPS.jsonl --model M --base cpu|PROFILE [--dispatch-only] --out PROFILE.json

A request goes as the class and tenant its trace names (``class`` and ``tenant`` columns), else
as ``interactive`` (the Azure traces carry neither); ``--class NAME`` sends every request as
``NAME`` and ``--batch-above N`` the prompts of ``N`` or more tokens as ``batch`` and the others
as ``interactive`` (:class:`~cadenza.loadgen.headers.ClassRule`, as ``cadenza bench`` does),
either one overriding the trace's class column. The report gives, per class, TTFT / ITL /
TPOT p50/p95/p99, SLO attainment and goodput against the pool's ``spec.slo``, throughput and
drops; per run, KV usage, preemptions and the controller's actions (``auto``). ``--compare``
runs the policies of :mod:`cadenza.sim.policies` side by side on the same trace and cost model;
``--sweep`` finds each one's capacity at SLO. Each replica runs on the pool's tensor-parallel size
(``spec.engine.tensorParallelSize``, else its GPUs per replica); ``--tp`` sets it for a pool that
says neither, and must agree with one that does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from cadenza.node.core.policy import CLASSES


# A graph replay's host time per step above this (seconds) is an eager runner's (the H200's eager
# dispatch is ~12 ms; the projection of replay, ~0.14 ms): a table taken with graphs off.
IMPLAUSIBLE_REPLAY_S = 1e-3


def register_sim(sub: argparse._SubParsersAction) -> None:
    from cadenza.sim.hardware import describe_profiles

    p = sub.add_parser("sim", help="simulate a ServingPool on a trace with GPU cost models (no GPU needed)",
                       description="Simulate a ServingPool on a trace (`cadenza sim --trace ... --pool ...`), "
                                   "or fit a hardware profile to measured steps (`cadenza sim calibrate`).")
    p.add_argument("--trace", type=Path, help="an Azure CSV or JSONL trace (required)")
    p.add_argument("--pool", type=Path, metavar="POOL.yaml", help="a ServingPool manifest (required)")
    p.add_argument("--pool-name", help="which ServingPool of the file (default: the only one)")
    p.add_argument("--model", help="a shipped model (llama-3.1-8b, ...) or a config.json path (required)")
    p.add_argument("--hardware", help=f"a profile: {describe_profiles()}; or a .json file (required)")
    p.add_argument("--tp", type=int,
                   help="tensor-parallel devices per replica (default: the pool's spec.engine.tensorParallelSize, "
                        "else its GPUs per replica, else 1; given, it must agree with the pool's)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (< 1: more load)")
    rate.add_argument("--qps-scale", type=float, help="multiply the request rate (2: twice the load)")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt and output lengths")
    p.add_argument("--num-requests", type=int, help="the first N requests of the trace")
    classes = p.add_mutually_exclusive_group()  # as `cadenza bench`'s: either overrides the trace's class column
    classes.add_argument("--class", dest="traffic_class", choices=CLASSES,
                         help="send every request as this class (default: the trace's class column, else interactive)")
    classes.add_argument("--batch-above", type=int, metavar="N",
                         help="send prompts of N or more tokens (after --length-scale) as batch, the others as "
                              "interactive")
    p.add_argument("--compare", nargs="*", metavar="POLICY",
                   help="run these policies side by side on the same trace and cost model (default: all of "
                        "prefill-first, chunked-fcfs, chunked-classes, dedicated, disaggregated, auto)")
    p.add_argument("--kv-link-gbps", type=float, default=10.0, metavar="GBIT_S",
                   help="the KV link between prefill and decode replicas, in Gbit/s (default 10: TCP; "
                        "400: RDMA; 3600: NVLink)")
    p.add_argument("--kv-link-latency-us", type=float, default=50.0, metavar="US",
                   help="per-message latency of that link in microseconds (default 50)")
    p.add_argument("--sweep", action="store_true",
                   help="find each policy's capacity at the pool's SLOs (requests/s) by bisection over the rate")
    p.add_argument("--plot", type=Path, metavar="DIR", help="write PNG figures here (needs matplotlib)")
    p.add_argument("--json", type=Path, help="write the report here as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_sim, sim_parser=p)
    commands = p.add_subparsers(dest="sim_command", metavar="{calibrate}")
    cal = commands.add_parser("calibrate", help="fit a hardware profile to a table of measured steps",
                              description="Fit a profile's efficiency factors and fixed costs to measured steps "
                                          "(the JSONL `cadenza serve --step-log` writes, or a CSV with its "
                                          "columns); method: cadenza.sim.calibrate.")
    cal.add_argument("--steps", type=Path, required=True, metavar="TABLE", help="the step table (JSONL or CSV)")
    cal.add_argument("--model", required=True, help="the model the steps ran (a shipped name or a config.json)")
    cal.add_argument("--base", required=True,
                     help="the profile to start from: a built-in GPU profile, a .json file, or `cpu` (this host)")
    cal.add_argument("--tp", type=int, default=1, help="tensor-parallel devices the steps ran on (default 1)")
    cal.add_argument("--dispatch-only", action="store_true",
                     help="fit only the runner's host time beside BASE's device (cadenza.sim.dispatch): an eager "
                          "BASE's dispatch from the steps it bounds, or, for a BASE with CUDA graphs "
                          "(h200-graphs), a graphed step's replay time from the graphed steps; the rest is BASE's")
    cal.add_argument("--name", help="the fitted profile's name (default: BASE-calibrated)")
    cal.add_argument("--out", type=Path, required=True, metavar="PROFILE.json", help="where to write the profile")
    cal.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    from cadenza.sim.calibrate import calibrate, cpu_base, load_step_table
    from cadenza.sim.hardware import ProfileError, load_profile
    from cadenza.sim.model_dims import ModelDimsError, load_model_dims
    from cadenza.sim.roofline import Roofline

    try:
        if args.out.suffix != ".json":
            raise ValueError(f"--out {args.out}: a profile is a .json file (what --hardware reads)")
        base = cpu_base() if args.base == "cpu" else load_profile(args.base)
        roofline = Roofline(load_model_dims(args.model), base, args.tp)
        steps = load_step_table(args.steps)
        if args.dispatch_only:
            return _calibrate_dispatch(args, steps, roofline)
        fit = calibrate(steps, roofline, args.name)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(fit.profile.to_dict(), indent=2) + "\n")
    except (OSError, ValueError, ProfileError, ModelDimsError) as exc:
        print(f"cadenza sim calibrate: {exc}", file=sys.stderr)
        return 2
    hw = fit.profile
    print(f"fitted {fit.steps} steps in {fit.rounds} rounds: per-step error mean {100 * fit.mean_abs_error:.1f} %, "
          f"p90 {100 * fit.p90_abs_error:.1f} %")
    print(f"  peak {hw.peak_flops / 1e12:.3g} TFLOP/s x gemm {hw.gemm_efficiency:.3f} / attention "
          f"{hw.attention_efficiency:.3f}; bandwidth {hw.memory_bandwidth / 1e9:.3g} GB/s x {hw.memory_efficiency:.3f}")
    print(f"  fixed {1e3 * hw.step_overhead_s:.3f} ms/step + {1e6 * hw.device_per_row_s:.1f} us/row on the device; "
          f"host {1e6 * hw.host_per_step_s:.0f} us/step + {1e6 * hw.host_per_row_s:.1f} us/row")
    if fit.fixed:
        print(f"  not identifiable from this table (kept from {args.base}): {', '.join(fit.fixed)}")
    if fit.free:
        print(f"  costs nothing measurable in this table (set to the full peak): {', '.join(fit.free)}")
    if fit.poor:
        print(f"cadenza sim calibrate: warning: a poor fit ({100 * fit.mean_abs_error:.0f} % mean error): the table "
              "may be too small, too noisy (a busy machine) or too alike (one step shape) to calibrate from",
              file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


def _calibrate_dispatch(args: argparse.Namespace, steps, roofline) -> int:
    """``--dispatch-only``: the base's device with the runner's host time fitted (errors raise to
    :func:`run_calibrate`)."""
    from cadenza.sim.dispatch import fit_dispatch, fit_graph_replay

    base, name = roofline.hw, args.name or f"{args.base}-calibrated"
    if base.cuda_graphs:
        fit = fit_graph_replay(steps, roofline)
        what = (f"graph replay {1e6 * fit.per_step_s:.0f} us/step + {1e6 * fit.per_row_s:.1f} us/row over "
                f"{fit.graphed_steps} graphed steps of {len(steps)} (the others keep {args.base}'s eager dispatch)")
    else:
        fit = fit_dispatch(steps, roofline)
        what = (f"eager dispatch {1e3 * fit.per_step_s:.2f} ms/step + {1e6 * fit.per_row_s:.1f} us/row; "
                f"{fit.bound_steps} of {len(steps)} steps bound by it")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fit.profile(base, name).to_dict(), indent=2) + "\n")
    print(f"fitted {what}: per-step error mean {100 * fit.mean_abs_error:.1f} %, p90 {100 * fit.p90_abs_error:.1f} %")
    if base.cuda_graphs and fit.per_step_s > IMPLAUSIBLE_REPLAY_S:
        print(f"cadenza sim calibrate: warning: {1e3 * fit.per_step_s:.1f} ms of host time per graphed step is an "
              "eager runner's: was the table taken with --no-cuda-graphs?", file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


def run_sim(args: argparse.Namespace) -> int:
    from cadenza.loadgen.headers import ClassRule
    from cadenza.loadgen.trace import load_trace, scale_trace
    from cadenza.pool.spec import Pool, PoolSpecError
    from cadenza.pool.validate import PoolValidationError, load_pools
    from cadenza.sim.disagg import KVLinkModel
    from cadenza.sim.hardware import ProfileError, load_profile
    from cadenza.sim.model_dims import ModelDimsError, load_model_dims
    from cadenza.sim.policies import POLICIES, left_out, policies
    from cadenza.sim.pool import pool_tensor_parallel_size
    from cadenza.sim.roofline import Roofline

    missing = [f"--{name}" for name in ("trace", "pool", "model", "hardware") if getattr(args, name) is None]
    if missing:
        args.sim_parser.error(f"the following arguments are required: {', '.join(missing)}")
    if args.qps_scale is not None and not args.qps_scale > 0:
        args.sim_parser.error(f"--qps-scale must be > 0, got {args.qps_scale}")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        print("cadenza sim: --plot needs matplotlib; pip install 'cadenza[plot]'", file=sys.stderr)
        return 2
    time_scale = args.time_scale / args.qps_scale if args.qps_scale else args.time_scale
    try:
        pools = load_pools(args.pool)
        if not pools:
            raise ValueError(f"{args.pool}: holds no ServingPool")
        if args.pool_name:
            pools = [p for p in pools if p["metadata"]["name"] == args.pool_name]
            if not pools:
                raise ValueError(f"{args.pool}: no ServingPool named {args.pool_name!r}")
        if len(pools) != 1:
            raise ValueError(f"{args.pool}: holds {len(pools)} ServingPools; name one with --pool-name")
        pool = pools[0]
        Pool(pool["metadata"]["name"], "default", pool["spec"]).roles()  # it runs as it is (cadenza up's check)
        tp = pool_tensor_parallel_size(pool, args.tp)
        hw = load_profile(args.hardware)
        if hw.cuda_graphs and (pool["spec"].get("engine") or {}).get("cudaGraphs") is False:
            hw = replace(hw, cuda_graphs=False)  # the pool's engines run every step eagerly
        roofline = Roofline(load_model_dims(args.model), hw, tp)
        own = {"colocated": "chunked-classes"}.get(pool["spec"].get("mode", "colocated"), pool["spec"].get("mode"))
        names = list(dict.fromkeys(args.compare or POLICIES)) if args.compare is not None else [own]
        link = KVLinkModel(args.kv_link_gbps * 1e9 / 8, args.kv_link_latency_us * 1e-6)
        runs_of = policies(pool, roofline, names, link)
        skipped = {n: why for n in names if (why := left_out(pool, n)) is not None}
        if not runs_of:
            raise ValueError(f"--compare {' '.join(names)}: nothing to run ("
                             f"{'; '.join(f'{n}: {why}' for n, why in skipped.items())})")
        trace = scale_trace(load_trace(args.trace), time_scale=time_scale, length_scale=args.length_scale,
                            num_requests=args.num_requests).requests
        if args.traffic_class is not None or args.batch_above is not None:
            rule = ClassRule(args.traffic_class, args.batch_above)
            trace = [replace(r, traffic_class=rule.class_for(r.input_len)) for r in trace]
        if args.sweep and (len(trace) < 2 or not trace[-1].arrival_s > trace[0].arrival_s):
            raise ValueError("--sweep scales the trace's request rate: it needs two or more requests spread over time")
        _writable(args.json, args.plot)
    except (OSError, ValueError, PoolValidationError, PoolSpecError, ProfileError, ModelDimsError) as exc:
        print(f"cadenza sim: {exc}", file=sys.stderr)
        return 2
    for name, why in skipped.items():
        print(f"cadenza sim: {name} skipped: {why}", file=sys.stderr)
    started = time.perf_counter()
    runs = {}
    for policy in runs_of:
        desc = f"simulating {policy.name}" if len(runs_of) > 1 else "simulating"
        with tqdm_bar(len(trace), desc, args.no_progress) as bar:
            runs[policy.name] = run_report(policy, trace, roofline, bar.update)
    report = {
        "pool": pool["metadata"]["name"], "model": roofline.dims.name, "hardware": roofline.hw.name,
        "tp": roofline.tp, "replicas": len(runs_of[0].layout.configs), "requests": len(trace),
        "time_scale": time_scale, "length_scale": args.length_scale,
    }
    if args.compare is not None:
        report["policies"] = runs
    else:
        report.update(runs[runs_of[0].name])
    if args.sweep:
        report["capacity_req_s"] = {p.name: sweep(p, trace, roofline, args.no_progress) for p in runs_of}
    report["wall_s"] = round(time.perf_counter() - started, 3)
    print_report(report)
    if args.json:  # strict JSON: a percentile of no values is null, not NaN
        args.json.write_text(json.dumps(_finite(report), indent=2, default=float, allow_nan=False) + "\n")
    if args.plot is not None:
        from cadenza.sim.plots import write_plots

        for path in write_plots(report, args.plot):
            print(f"wrote {path}")
    return 0


def _writable(json_path: Path | None, plot_dir: Path | None) -> None:
    """Make the output folders now, so a bad path fails before the run, not after it.

    Raises:
        OSError: a path that cannot be written (a folder where the report goes, a file where
            the figures go, no permission).
    """
    if json_path is not None:
        if json_path.is_dir():
            raise IsADirectoryError(f"--json {json_path}: is a folder")
        json_path.parent.mkdir(parents=True, exist_ok=True)
    if plot_dir is not None:
        if plot_dir.exists() and not plot_dir.is_dir():
            raise NotADirectoryError(f"--plot {plot_dir}: is a file, not a folder")
        plot_dir.mkdir(parents=True, exist_ok=True)


def _finite(value):
    """``value`` with every NaN or infinite float replaced by None (JSON's null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def tqdm_bar(total: int, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=disable, leave=False)


def run_report(policy, trace, roofline, on_done) -> dict:
    """One policy's run as the report's JSON-able dict."""
    from cadenza.sim.policies import run_policy

    run = run_policy(policy, trace, roofline, on_done=on_done)
    result, fleet = run.result, run.fleet
    interval = run.controller.interval_s if run.controller else 15.0
    return {
        "policy": policy.name, "simulated_s": round(fleet.clock.now, 3), "dropped": result.dropped,
        "goodput_rps": run.goodput_rps, "reshapes": run.reshapes,
        "kv_usage": result.kv_usage, "preemptions": result.preemptions, "kv_transfer": result.kv_transfer,
        "by_class": {cls: asdict(summary) for cls, summary in result.by_class.items()},
        "actions": [asdict(a) for a in run.actions],
        "attainment_over_time": fleet.attainment_over_time(max(interval, result.span_s / 60)),
    }


def sweep(policy, trace, roofline, quiet: bool) -> float:
    """Capacity at the pool's SLOs (requests/s) of ``policy`` on ``trace``, by bisection over the rate."""
    from cadenza.sim.policies import run_policy
    from cadenza.sim.sweep import at_rate, capacity_at_slo, pool_slo_met

    base = (len(trace) - 1) / (trace[-1].arrival_s - trace[0].arrival_s)
    slo = policy.layout.slo
    found = capacity_at_slo(lambda rate: run_policy(policy, at_rate(trace, rate), roofline).result, None,
                            low=base / 4, high=base / 2, tolerance=0.03, check=lambda r: pool_slo_met(r, slo))
    if not quiet:
        print(f"  {policy.name}: {found.rate:.3f} req/s at SLO ({len(found.runs)} runs)", file=sys.stderr)
    return found.rate


def print_report(report: dict) -> None:
    runs = report.get("policies") or {report["policy"]: report}
    for name, run in runs.items():
        print(f"{name}: goodput {run['goodput_rps']:.2f} req/s within SLO, {run['dropped']} dropped, "
              f"{run['reshapes']} reshapes, KV mean/peak {100 * run['kv_usage']['mean']:.0f}/"
              f"{100 * run['kv_usage']['peak']:.0f} %, {sum(run['preemptions'].values())} preempted")
        for cls, s in run["by_class"].items():
            attained = f"{100 * s['slo_attainment']:.1f} %" if s["slo_attainment"] is not None else "-"
            print(f"  {cls:>12}: {s['requests']} done, {s['rejected']} dropped, SLO met {attained}; TTFT p50/p99 "
                  f"{s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p99']:.0f} ms; ITL p50/p99 {s['itl_ms']['p50']:.1f}/"
                  f"{s['itl_ms']['p99']:.1f} ms; TPOT p99 {s['tpot_ms']['p99']:.1f} ms; "
                  f"{s['output_tokens_per_s']:.0f} output tok/s")
        if moved := run.get("kv_transfer"):
            least = moved["min_prompt_tokens"]
            print(f"  KV transfer: {moved['moved']} prompts prefilled elsewhere ({moved['bytes'] / 2**30:.2f} GiB), "
                  f"{moved['fallbacks']} prefilled where they decode for want of a prefill replica, "
                  f"{moved['kept_queued']} for its queue; threshold (idle prefill) "
                  f"{'none worth moving' if least is None else f'{least} tokens'}")
        for a in run["actions"]:
            print(f"    t={a['time_s']:.0f} s {a['action']}{' (advised)' if not a['acted'] else ''}: {a['reason']}")
    for name, rate in (report.get("capacity_req_s") or {}).items():
        print(f"capacity at SLO, {name}: {rate:.3f} req/s")
    print(f"{report['requests']} requests on {report['replicas']} x {report['tp']} {report['hardware']}, "
          f"simulated in {report['wall_s']:.1f} s")
