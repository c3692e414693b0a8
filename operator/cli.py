"""``cadenza operator``: the kopf operator's command.

It plugs into the ``cadenza`` command through the ``cadenza.commands`` entry-point group, so the
node package (which owns the command) never imports the operator.
"""

from __future__ import annotations

import argparse
import sys


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

    from cadenza.operator import handlers  # noqa: F401 - registers kopf's handlers
    from cadenza.operator.startup import credentials_problem

    problem = credentials_problem()
    if problem:
        print(f"cadenza operator: {problem}", file=sys.stderr)
        return 2
    liveness = None if args.liveness == "none" else args.liveness
    kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
             liveness_endpoint=liveness)
    return 0
