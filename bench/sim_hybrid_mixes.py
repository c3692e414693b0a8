"""Other bursty mixes for hybrid mode, in the simulator: ``python -m bench.sim_hybrid_mixes``.

:mod:`bench.sim_hybrid` measures one mix. This script runs the same pool (eight Llama-3.1-8B
replicas, H100 profile, the same SLOs) on a mix given on the command line, so a mix where one
shape should win can be tried side by side with the others:

- interactive: the conversation trace overlaid ``--copies`` times (each copy shifted by an equal
  share of its hour);
- batch: from each ``--burst`` start, ``--burst-length`` seconds of the code trace at
  ``--burst-rate`` times its recorded rate, prompts scaled by ``--prompt-scale`` (capped at
  ``--prompt-max``) and outputs set to ``--output-len`` tokens (0: as recorded). Scaling prompts
  and outputs models a long-context batch job (repository or document summaries) whose KV stays
  resident for seconds, rather than the short code completions the trace holds.

Shapes (positional): ``colocated[:CHUNK]``, ``dedicated:K[:CHUNK]`` (K interactive replicas, their
chunk size), ``auto[:CHUNK]``, ``held:K[:CHUNK]``; CHUNK sets ``spec.engine.chunkSize`` for every
replica (for a split, the interactive replicas'). ``--controller '{...}'`` overrides
``spec.controller`` fields.

``held:K`` is an oracle for ``auto``'s reshaping, not a shape a pool can be given: the shape
``auto`` reaches after ``8 - K`` dedicates (interactive routed to every replica, batch to the K
colocated ones only), held from the first second with no controller, so no detection delay, no
transition and no cooldown is paid. Where it stays under 1.3x a static shape, no reshaping
schedule that holds one shape through a burst reaches the target either.

Last line JSON: ``ratio`` is auto's goodput over the best static shape run (null without both;
``held`` shapes are neither).
The runs are slow (0.4-0.7 s of one core per simulated second at ~165 req/s); run two
processes at most on this machine. ``make bench`` runs the 600 s mix of ``docs/benchmarks.md``.

``--quick``: without shapes, one of each kind at 128-token chunks; the defaults become 2 copies,
12 simulated seconds and a 6 s burst from 3 s (flags given still win).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from bench.common import arguments, machine, report
from bench.sim_hybrid import REPLICAS, SLO, bursty_mix, pool, run
from cadenza.sim.hardware import PROFILES
from cadenza.sim.model_dims import load_model_dims
from cadenza.sim.pool import FleetLayout, fleet_layout
from cadenza.sim.roofline import Roofline

DEFAULTS = dict(copies=20, duration=300.0, burst=None, burst_length=200.0)
QUICK = dict(shapes=["colocated:128", "dedicated:7:128", "auto:128", "held:1:128"], copies=2, duration=12.0,
             burst=[3.0], burst_length=6.0)


def shape_layout(shape: str, controller: dict, model: Roofline) -> FleetLayout:
    """The fleet layout of one shape argument (see the module docstring)."""
    kind, *rest = shape.split(":")
    split = kind in ("dedicated", "held")
    if kind not in ("colocated", "dedicated", "auto", "held") or len(rest) > (2 if split else 1):
        raise SystemExit(f"unknown shape {shape!r}: colocated[:CHUNK], dedicated:K[:CHUNK], auto[:CHUNK] "
                         "or held:K[:CHUNK]")
    numbers = [int(x) for x in rest]
    if split and (not numbers or not 1 <= numbers[0] < REPLICAS):
        raise SystemExit(f"{shape!r}: {kind} needs K replicas, 1 <= K < {REPLICAS}")
    chunk = numbers[-1] if len(numbers) > split else None
    if kind == "dedicated":
        doc = pool("dedicated", numbers[0], chunk)
    else:
        doc = pool("colocated" if kind == "held" else kind)
        if chunk:
            doc["spec"]["engine"]["chunkSize"] = chunk
    doc["spec"]["controller"].update(controller)
    layout = fleet_layout(doc, model)
    if kind == "held":
        names = layout.roles["interactive"]
        layout = dataclasses.replace(layout, roles={"interactive": list(names), "batch": names[:numbers[0]]})
    return layout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="*", help="one or more (see above)")
    p.add_argument("--copies", type=int, help=f"default {DEFAULTS['copies']}")
    p.add_argument("--duration", type=float, help=f"simulated seconds (default {DEFAULTS['duration']:g})")
    p.add_argument("--burst", type=float, action="append", help="a burst's start (s); repeatable (default 0)")
    p.add_argument("--burst-length", type=float, help=f"default {DEFAULTS['burst_length']:g}")
    p.add_argument("--burst-rate", type=float, default=3.0)
    p.add_argument("--prompt-scale", type=float, default=4.0)
    p.add_argument("--prompt-max", type=int, default=12000)
    p.add_argument("--output-len", type=int, default=400)
    p.add_argument("--controller", type=json.loads, default={}, help="JSON: spec.controller overrides")
    a = arguments(__doc__, p)
    for name, value in (QUICK if a.quick else DEFAULTS).items():
        if getattr(a, name) in (None, []):
            setattr(a, name, value)
    if not a.shapes:
        p.error("give at least one shape")
    model = Roofline(load_model_dims("llama-3.1-8b"), PROFILES["h100-sxm"])
    layouts = {s: shape_layout(s, a.controller, model) for s in a.shapes}
    bursts = a.burst if a.burst is not None else [0.0]
    trace = bursty_mix(a.copies, a.duration, bursts, a.burst_length, a.burst_rate, a.prompt_scale, a.prompt_max,
                       a.output_len)
    print(f"{len(trace)} requests over {a.duration:.0f} s, {sum(r.traffic_class == 'batch' for r in trace)} batch")
    runs = {}
    for name, layout in layouts.items():
        runs[name] = run(name, layout, trace, model)
        for x in runs[name].actions:
            if x.acted:
                print(f"    t={x.time_s:.0f} s {x.action} {x.knobs or x.move}: {x.reason}")
    static = {n: r.goodput_rps for n, r in runs.items() if n.startswith(("colocated", "dedicated"))}
    auto = [r.goodput_rps for n, r in runs.items() if n.startswith("auto")]
    best = max(static, key=static.get) if static else None
    ratio = auto[0] / static[best] if auto and best and static[best] else None
    report({
        "benchmark": "sim_hybrid_mixes", "ratio": None if ratio is None else round(ratio, 3), "target": 1.3,
        "goodput_rps": {n: round(r.goodput_rps, 2) for n, r in runs.items()}, "best_static": best,
        "interactive_slo_met": {n: r.result.by_class["interactive"].slo_attainment for n, r in runs.items()
                                if "interactive" in r.result.by_class},
        "dropped": {n: r.result.dropped for n, r in runs.items()},
        "reshapes": {n: r.reshapes for n, r in runs.items() if r.controller},
        "slo": SLO,
        "setup": {"model": "llama-3.1-8b", "hardware": "h100-sxm", "replicas": REPLICAS, "copies": a.copies,
                  "duration_s": a.duration, "bursts_s": bursts, "burst_length_s": a.burst_length,
                  "burst_rate": a.burst_rate, "prompt_scale": a.prompt_scale, "prompt_max": a.prompt_max,
                  "output_len": a.output_len, "controller": a.controller},
        "prefix_caching": True, "prefix_cache_hit_rate": 0.0, "machine": machine(),
    }, quick=a.quick)


if __name__ == "__main__":
    main()
