"""``cadenza operator`` and ``cadenza up``: the control plane's commands.

They plug into the ``cadenza`` command through the ``cadenza.commands`` entry-point group, so the
node package (which owns the command) never imports the operator.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from cadenza.node.core.config import port_argument


def register_operator(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("operator", help="run the ServingPool operator (kopf)")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (default)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                   help="kopf's liveness endpoint (default %(default)s; 'none' to disable)")
    p.set_defaults(func=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    import kopf

    from cadenza.operator import handlers

    problem = handlers.credentials_problem()
    if problem:
        print(f"cadenza operator: {problem}", file=sys.stderr)
        return 2
    liveness = None if args.liveness == "none" else args.liveness
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=liveness)
    return 0


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
    from cadenza.operator.local import run_local
    from cadenza.operator.validate import KIND, PoolValidationError, document_kinds, load_pools

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
