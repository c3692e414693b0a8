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
    p = sub.add_parser("sim", help="simulate a ServingPool on a trace with GPU cost models (no GPU needed)")
    p.add_argument("--trace", type=Path, required=True, help="an Azure CSV or JSONL trace")
    p.add_argument("--pool", type=Path, required=True, metavar="POOL.yaml", help="a ServingPool manifest")
    p.add_argument("--pool-name", help="which ServingPool of the file (default: the only one)")
    p.add_argument("--model", required=True, help="a shipped model (llama-3.1-8b, ...) or a config.json path")
    p.add_argument("--hardware", required=True, help="a profile (a100-80g, h100-sxm, h200, l40s) or a .json file")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices per replica (default 1)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (< 1: more load)")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt and output lengths")
    p.add_argument("--num-requests", type=int, help="the first N requests of the trace")
    p.add_argument("--json", type=Path, help="write the report here as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_sim)


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
