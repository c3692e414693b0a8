"""``cadenza gateway``: options and the serving loop of the reverse proxy in front of a pool.

Wiring (in the ``cadenza`` CLI)::

    gateway = sub.add_parser("gateway", help="route requests to a pool's replicas by class")
    gateway_cli.add_arguments(gateway)
    gateway.set_defaults(func=gateway_cli.run)

Upstreams come from a config file (``--config``, re-read on change and on SIGHUP) or from the
Kubernetes API (``--kubernetes --namespace NS --pool NAME``). Command-line ``--default-class`` and
``--max-outstanding`` override the file's values. ``--header-timeout-s``, ``--idle-timeout-s`` and
``--body-timeout-s`` bound slow clients (:mod:`cadenza.node.http.hardening`).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from aiohttp import web

from cadenza.gateway.app import UpstreamSource, create_gateway_app
from cadenza.gateway.config import GatewayConfigError
from cadenza.gateway.file_source import FileSource
from cadenza.gateway.kubernetes_source import KubernetesConfigError, KubernetesSource, kubernetes_list_slices
from cadenza.gateway.state import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_HEALTH_INTERVAL_S, DEFAULT_MAX_OUTSTANDING
from cadenza.gateway.upstreams import Upstreams
from cadenza.node.core.policy import CLASSES
from cadenza.node.http.hardening import HttpTimeouts, add_http_arguments, http_timeouts_from_args
from cadenza.node.http.runner import run_app


# The namespace of the pod we run in (the service account's), when --namespace is not given.
_POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _threshold(value: str) -> int | str:
    return "auto" if value.strip().lower() == "auto" else _positive_int(value)


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return number


def _targets(value: str) -> tuple[float, ...]:
    try:
        targets = tuple(float(v) / 1e3 for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds separated by commas, got {value!r}") from None
    if any(not t > 0 for t in targets):
        raise argparse.ArgumentTypeError(f"SLO targets must be positive, got {value!r}")
    return targets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the gateway's options to ``parser`` (a ``cadenza gateway`` subparser)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, metavar="PATH",
                        help="JSON or YAML: {roles: {interactive: [urls], batch: [urls], prefill: [urls]}, default_class, "
                             "max_outstanding}; re-read when it changes and on SIGHUP")
    source.add_argument("--kubernetes", action="store_true",
                        help="read the ready endpoints of Services <pool>-interactive and <pool>-batch")
    parser.add_argument("--namespace", help="with --kubernetes: the pool's namespace (default: this pod's, "
                                            "else 'default')")
    parser.add_argument("--pool", help="with --kubernetes: the ServingPool name")
    parser.add_argument("--default-class", type=str.lower, choices=CLASSES, default=None,
                        help="class of requests without an x-cadenza-class header (default: the config "
                             "file's, else interactive)")
    parser.add_argument("--max-outstanding", type=_positive_int, default=None, metavar="N",
                        help="requests in flight through the gateway that make a replica full (default: "
                             f"the config file's, else {DEFAULT_MAX_OUTSTANDING})")
    parser.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S, metavar="SECONDS",
                        help="seconds to connect to a replica before trying another (default: %(default)s)")
    parser.add_argument("--health-interval", type=float, default=DEFAULT_HEALTH_INTERVAL_S, metavar="SECONDS",
                        help="seconds between health checks (GET /health) of every replica; 0 turns them off "
                             "(default: %(default)s)")
    parser.add_argument("--slo-targets-ms", type=_targets, default=(), metavar="MS[,MS...]",
                        help="the pool's SLO targets: the TTFT / ITL histograms at /metrics get dense buckets "
                             "around each (default: none, coarse buckets only)")
    parser.add_argument("--disagg-min-prompt-tokens", type=_threshold, default=None, metavar="N|auto",
                        help="prompts of at least N tokens are prefilled on a replica of the prefill role, whose KV "
                             "the decode replica pulls; auto: the threshold the decode replicas compute from their "
                             "step-time model and measured transfer bandwidth (needs $CADENZA_ADMIN_TOKEN, the "
                             "replicas' token; default: off)")
    add_http_arguments(parser)


def _default_namespace() -> str:
    try:
        return _POD_NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


def build_gateway(args: argparse.Namespace) -> tuple[web.Application, UpstreamSource]:
    """The app and its upstream source from parsed options.

    Raises:
        GatewayConfigError: a bad config file.
        KubernetesConfigError: no cluster credentials.
        ValueError: inconsistent options.
    """
    upstreams = Upstreams()
    default_class, max_outstanding = args.default_class, args.max_outstanding
    if args.kubernetes:
        if not args.pool:
            raise ValueError("--kubernetes needs --pool NAME")
        source = KubernetesSource(args.namespace or _default_namespace(), args.pool, kubernetes_list_slices())
    else:
        if args.namespace or args.pool:
            raise ValueError("--namespace and --pool go with --kubernetes, not --config")
        source = FileSource(args.config)
        config = source.load()
        upstreams.replace(config.roles)
        default_class = default_class or config.default_class
        max_outstanding = max_outstanding or config.max_outstanding
    app = create_gateway_app(upstreams, default_class or "interactive", max_outstanding or DEFAULT_MAX_OUTSTANDING,
                             source=source, connect_timeout_s=args.connect_timeout,
                             health_interval_s=args.health_interval, slo_targets_s=args.slo_targets_ms,
                             disagg_min_prompt_tokens=args.disagg_min_prompt_tokens)
    return app, source


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; the exit code: 0, 2 for a bad configuration, 1 if it cannot listen."""
    try:
        app, source = build_gateway(args)
    except (GatewayConfigError, KubernetesConfigError, ValueError) as exc:
        print(f"cadenza gateway: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(app, source, args.host, args.port, http_timeouts_from_args(args)))


async def _serve(app: web.Application, source: UpstreamSource, host: str, port: int, timeouts: HttpTimeouts) -> int:
    reload = {signal.SIGHUP: source.request_reload} if isinstance(source, FileSource) else {}
    return await run_app(app, host, port, "gateway", extra_signals=reload, timeouts=timeouts)


def register_gateway(sub: argparse._SubParsersAction) -> None:
    """Add ``cadenza gateway`` (the ``cadenza.commands`` entry point)."""
    parser = sub.add_parser("gateway", help="route a pool's traffic by class to its replicas")
    add_arguments(parser)
    parser.set_defaults(func=run)
