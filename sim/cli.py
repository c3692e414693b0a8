"""``cadenza sim``: a ServingPool and a trace through the simulator (registered through the
``cadenza.commands`` entry point, as ``cadenza up`` is).

    cadenza sim --trace T.csv --pool P.yaml --model llama-3.1-8b --hardware h100-sxm [--tp N]
                [--time-scale F] [--length-scale F] [--num-requests N] [--json OUT]

Every request of the trace is ``interactive`` (the Azure traces carry no class column). The
report gives, per class, TTFT / ITL / TPOT p50/p95/p99, throughput, drops, and the controller's
actions for an ``auto`` pool.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path


def register_sim(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="simulate a ServingPool on a trace with GPU cost models (no GPU needed)",
                       description="Simulate a ServingPool on a trace (`cadenza sim --trace ... --pool ...`), "
                                   "or fit a hardware profile to measured steps (`cadenza sim calibrate`).")
    p.add_argument("--trace", type=Path, help="an Azure CSV or JSONL trace (required)")
    p.add_argument("--pool", type=Path, metavar="POOL.yaml", help="a ServingPool manifest (required)")
    p.add_argument("--pool-name", help="which ServingPool of the file (default: the only one)")
    p.add_argument("--model", help="a shipped model (llama-3.1-8b, ...) or a config.json path (required)")
    p.add_argument("--hardware", help="a profile (a100-80g, h100-sxm, h200, l40s) or a .json file (required)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices per replica (default 1)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (< 1: more load)")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt and output lengths")
    p.add_argument("--num-requests", type=int, help="the first N requests of the trace")
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
    cal.add_argument("--name", help="the fitted profile's name (default: BASE-calibrated)")
    cal.add_argument("--out", type=Path, required=True, metavar="PROFILE.json", help="where to write the profile")
    cal.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    from cadenza.sim.calibrate import calibrate, cpu_base, load_step_table
    from cadenza.sim.hardware import ProfileError, load_profile
    from cadenza.sim.model_dims import ModelDimsError, load_model_dims
    from cadenza.sim.roofline import Roofline

    try:
        base = cpu_base() if args.base == "cpu" else load_profile(args.base)
        roofline = Roofline(load_model_dims(args.model), base, args.tp)
        fit = calibrate(load_step_table(args.steps), roofline, args.name)
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
    print(f"wrote {args.out}")
    return 0


def run_sim(args: argparse.Namespace) -> int:
    from cadenza.node.replay.trace import load_trace, scale_trace
    from cadenza.operator.pool import PoolSpecError
    from cadenza.operator.validate import PoolValidationError, load_pools
    from cadenza.sim.control import SimController
    from cadenza.sim.fleet import Fleet
    from cadenza.sim.hardware import ProfileError, load_profile
    from cadenza.sim.model_dims import ModelDimsError, load_model_dims
    from cadenza.sim.pool import fleet_layout
    from cadenza.sim.roofline import Roofline
    from tqdm import tqdm

    missing = [f"--{name}" for name in ("trace", "pool", "model", "hardware") if getattr(args, name) is None]
    if missing:
        args.sim_parser.error(f"the following arguments are required: {', '.join(missing)}")
    try:
        pools = load_pools(args.pool)
        if args.pool_name:
            pools = [p for p in pools if p["metadata"]["name"] == args.pool_name]
        if len(pools) != 1:
            raise ValueError(f"{args.pool}: name one ServingPool with --pool-name (found {len(pools)})")
        roofline = Roofline(load_model_dims(args.model), load_profile(args.hardware), args.tp)
        layout = fleet_layout(pools[0], roofline)
        trace = scale_trace(load_trace(args.trace), time_scale=args.time_scale, length_scale=args.length_scale,
                            num_requests=args.num_requests).requests
    except (OSError, ValueError, PoolValidationError, PoolSpecError, ProfileError, ModelDimsError) as exc:
        print(f"cadenza sim: {exc}", file=sys.stderr)
        return 2
    fleet = Fleet(layout.roles, layout.configs, roofline, block_size=layout.block_size)
    controller = SimController(layout.controller) if layout.controller is not None else None
    if controller is not None:
        controller.attach(fleet)
    started = time.perf_counter()
    with tqdm(total=len(trace), desc="simulating", unit="req", disable=args.no_progress) as bar:
        result = fleet.run(trace, on_done=bar.update)
    wall = time.perf_counter() - started
    report = {
        "pool": pools[0]["metadata"]["name"], "model": roofline.dims.name, "hardware": roofline.hw.name,
        "tp": roofline.tp, "replicas": len(layout.configs), "requests": len(trace),
        "simulated_s": round(fleet.clock.now, 3), "wall_s": round(wall, 3), "dropped": result.dropped,
        "by_class": {cls: asdict(summary) for cls, summary in result.by_class.items()},
        "actions": [asdict(a) for a in controller.actions] if controller else [],
    }
    for cls, s in result.by_class.items():
        print(f"{cls:>12}: {s.requests} done, {s.rejected} dropped; TTFT p50/p99 {s.ttft_ms['p50']:.0f}/"
              f"{s.ttft_ms['p99']:.0f} ms; ITL p50/p99 {s.itl_ms['p50']:.1f}/{s.itl_ms['p99']:.1f} ms; "
              f"TPOT p99 {s.tpot_ms['p99']:.1f} ms; {s.output_tokens_per_s:.0f} output tok/s")
    for a in report["actions"]:
        print(f"  t={a['time_s']:.0f} s {a['action']}{' (advised)' if not a['acted'] else ''}: {a['reason']}")
    print(f"{len(trace)} requests on {len(layout.configs)} x {roofline.tp} {roofline.hw.name}, "
          f"{fleet.clock.now:.0f} simulated s in {wall:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=float) + "\n")
    return 0
