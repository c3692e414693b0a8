"""``cadenza up``: a ServingPool YAML run on this machine, replicas and gateway as local processes.

It plugs into the ``cadenza`` command through the ``cadenza.commands`` entry-point group.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from cadenza.node.core.config import port_argument


def register_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run a ServingPool YAML on this machine: replicas + gateway")
    p.add_argument("pool_file", type=Path, metavar="POOL.yaml", help="a ServingPool manifest")
    p.add_argument("--pool", help="which ServingPool of the file (default: the only one)")
    p.add_argument("--host", default="127.0.0.1", help="gateway address (default %(default)s)")
    p.add_argument("--port", type=port_argument, default=8000, help="gateway port, 1-65535 (default %(default)s)")
    p.add_argument("--state-file", type=Path,
                   help="write replica ports and pids here (JSON) while the pool runs; removed when it stops")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for replicas to load")
    p.set_defaults(func=run_up)


def run_up(args: argparse.Namespace) -> int:
    from cadenza.local.up import run_local
    from cadenza.pool.validate import KIND, PoolValidationError, document_kinds, load_pools

    try:
        pools = load_pools(args.pool_file)
    except (OSError, PoolValidationError) as exc:
        print(f"cadenza up: {exc}", file=sys.stderr)
        return 2
    names = [p["metadata"]["name"] for p in pools]
    if not pools:
        kinds = ", ".join(document_kinds(args.pool_file)) or "an empty file"
        print(f"cadenza up: {args.pool_file} holds no {KIND} (serving.cadenza.dev/v1alpha1); found: {kinds}",
              file=sys.stderr)
        return 2
    if args.pool:
        pools = [p for p in pools if p["metadata"]["name"] == args.pool]
        if not pools:
            print(f"cadenza up: {args.pool_file} holds no {KIND} named {args.pool!r} (it has: {', '.join(names)})",
                  file=sys.stderr)
            return 2
    if len(pools) != 1:
        print(f"cadenza up: {args.pool_file} holds {len(pools)} {KIND}s ({', '.join(names)}); choose one with "
              "--pool NAME", file=sys.stderr)
        return 2
    if args.state_file is not None and (args.state_file.is_dir() or not (
            args.state_file.parent.is_dir() and os.access(args.state_file.parent, os.W_OK))):
        print(f"cadenza up: --state-file {args.state_file}: must be a file in an existing, writable folder",
              file=sys.stderr)
        return 2
    logging.getLogger("cadenza").info("running ServingPool %s locally", pools[0]["metadata"]["name"])
    return run_local(pools[0], args.host, args.port, state_file=args.state_file, ready_timeout=args.ready_timeout)
