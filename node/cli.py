"""The ``cadenza`` command: ``serve``, ``bench``, ``gateway``, ``fetch-model``, and the
subcommands other packages register under the ``cadenza.commands`` entry-point group
(``operator``, ``up``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from functools import partial
from importlib.metadata import entry_points
from pathlib import Path

import yaml

from cadenza.node.core.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    listen_problem,
    port_argument,
)
from cadenza.node.embedded import EmbeddedModelError
from cadenza.node.core.policy import CLASSES, Policy
from cadenza.node.server.http import add_http_arguments

logger = logging.getLogger("cadenza")

_GIB = 2**30
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def chunk_size_arg(value: str) -> int | None:
    """``--chunk-size``: a positive integer, or ``none`` for no cap."""
    if value.lower() in ("none", "off"):
        return None
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'none', got {value!r}")
    return size


SERVE_EPILOG = """\
environment:
  CADENZA_ADMIN_TOKEN       bearer token that enables GET/PUT /admin/config (off when unset)
  CADENZA_ADMIN_TOKEN_FILE  file holding that token (a mounted Secret; read on every request)
  CADENZA_CACHE_DIR         cache folder for the converted embedded model
                            (default: $XDG_CACHE_HOME/cadenza, else ~/.cache/cadenza)
  OMP_NUM_THREADS           torch threads, when --threads is not given
  OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_*  export traces and metrics over OTLP/HTTP
  CADENZA_ATTENTION_BACKEND overrides --attention-backend auto (torch | triton)
"""


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine knobs shared by every command that starts an engine."""
    d_sched, d_cache = SchedulerConfig(), CacheConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", help="a local Hugging Face model folder (config.json, *.safetensors, tokenizer.json); "
                                   "default: the embedded SmolLM2-135M-Instruct")
    g.add_argument("--served-model-name", help="model id clients send (default: the folder name)")
    g.add_argument("--token-budget", type=int, default=d_sched.token_budget, help="tokens per step, decode + prefill")
    g.add_argument("--chunk-size", type=chunk_size_arg, default=d_sched.chunk_size,
                   help="most prompt tokens a request prefills per step ('none' = unlimited)")
    g.add_argument("--max-num-seqs", type=int, default=d_sched.max_num_seqs, help="most requests running at once")
    g.add_argument("--max-model-len", type=int, default=None, help="most tokens per request (default: the model's)")
    g.add_argument("--block-size", type=int, default=d_cache.block_size, help="tokens per KV block")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=int, help="KV blocks in the pool")
    kv.add_argument("--kv-cache-gib", type=float, help="KV cache size in GiB (default: 1 on CPU)")
    kv.add_argument("--kv-cache-fraction", type=float, default=d_cache.kv_cache_fraction,
                    help="fraction of free GPU memory for the KV cache (default: %(default)s)")
    g.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--device", default="auto", help="auto (cuda when a GPU is visible, else cpu), cpu or cuda[:N]")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="kernels: auto (CADENZA_ATTENTION_BACKEND, else triton on CUDA, torch elsewhere)")
    g.add_argument("--seed", type=int, default=0, help="seed of every request that brings no seed of its own")
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch intra-op threads (default: OMP_NUM_THREADS, else the CPUs this process may use: "
                        "its affinity mask capped by its cgroup CPU quota)")
    p = parser.add_argument_group("scheduling policy")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=d_sched.prefix_caching,
                   help="reuse the KV blocks of identical prompt prefixes")
    p.add_argument("--step-time-target-ms", type=float, default=None,
                   help="shrink prefill chunks so predicted steps stay within this (decode reservation in time)")
    p.add_argument("--policy", type=Path, default=None, metavar="FILE",
                   help="JSON or YAML with classes/tenants settings (the shape of GET /admin/config)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build and validate the engine configuration.

    Raises:
        ConfigError: naming the invalid field.
    """
    model = args.model
    if model is None:
        from cadenza.node.embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model

        model = str(ensure_embedded_model())
        args.served_model_name = args.served_model_name or EMBEDDED_MODEL_NAME
    kv_bytes = None if args.kv_cache_gib is None else int(args.kv_cache_gib * _GIB)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = Policy()
    if args.policy is not None:
        try:
            policy = policy.updated(yaml.safe_load(args.policy.read_text()) or {})
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"policy: cannot read {args.policy}: {exc}") from None
    if args.step_time_target_ms is not None:
        policy = policy.updated({"step_time_target_ms": args.step_time_target_ms})
    return EngineConfig(
        model=model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=device,
        attention_backend=args.attention_backend,
        seed=args.seed,
        scheduler=SchedulerConfig(
            token_budget=args.token_budget,
            chunk_size=args.chunk_size,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            prefix_caching=args.prefix_caching,
            policy=policy,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_bytes=kv_bytes,
            kv_cache_fraction=args.kv_cache_fraction,
        ),
    )


def _serve(args: argparse.Namespace) -> int:
    from cadenza.node.core.engine import Engine
    from cadenza.node.runner.models.config import check_model_folder
    from cadenza.node.server.app import serve
    from cadenza.node.server.http import http_timeouts_from_args
    from cadenza.node.runner.threads import apply_threads, choose_threads

    if problem := listen_problem(args.host, args.port):  # before minutes of model loading
        logger.error("%s", problem)
        return 1
    timeouts = http_timeouts_from_args(args)
    threads = choose_threads(args.threads)
    config = engine_config_from_args(args)
    try:
        check_model_folder(config.model)  # fail now, not in the engine thread, on a bad folder
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{exc}{_model_hint(args.model)}") from None
    if config.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"device: {config.device} requested but this torch build sees no CUDA device")
    apply_threads(threads)
    logger.info("serving %s from %s on http://%s:%d/v1", config.model_name, config.model, args.host, args.port)
    return serve(partial(Engine, config), config.model_name, args.host, args.port, args.default_class,
                 timeouts=timeouts)


def _model_hint(model: str | None) -> str:
    """How to get a model folder, when ``--model`` looks like a Hugging Face repo id."""
    if model is None or Path(model).exists():
        return ""
    parts = model.split("/")
    if len(parts) == 2 and all(parts) and not model.startswith((".", "~")):
        return (f". --model takes a local folder; {model!r} looks like a Hugging Face repo id: download it first, "
                f"e.g. `hf download {model} --local-dir ~/models/{parts[1]}` (huggingface_hub), then serve "
                f"`--model ~/models/{parts[1]}`")
    return ". --model takes a local Hugging Face model folder (config.json, *.safetensors, tokenizer.json)"


def _fetch_model(args: argparse.Namespace) -> int:
    from cadenza.node.embedded import ensure_embedded_model

    print(ensure_embedded_model())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from cadenza.node.replay import cli as bench_cli

    parser = argparse.ArgumentParser(prog="cadenza", description="Chunked-prefill LLM serving.")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="default: %(default)s")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible API", epilog=SERVE_EPILOG,
                           formatter_class=_HelpFormatter,
                           description="Serve a model over an OpenAI-compatible API (/v1/completions, "
                                       "/v1/chat/completions, /v1/models) with chunked prefill.")
    add_engine_arguments(serve)
    net = serve.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    net.add_argument("--port", type=port_argument, default=8000, help="port to listen on")
    net.add_argument("--default-class", choices=CLASSES, default="interactive",
                     help="traffic class of requests without an x-cadenza-class header")
    add_http_arguments(serve)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="replay a trace against an OpenAI-compatible endpoint")
    bench_cli.add_arguments(bench)
    bench.set_defaults(func=bench_cli.run)

    fetch = sub.add_parser("fetch-model", help="convert the embedded SmolLM2 once and print its folder")
    fetch.set_defaults(func=_fetch_model)

    from cadenza.node.gateway import cli as gateway_cli

    gateway = sub.add_parser("gateway", help="route a pool's traffic by class to its replicas")
    gateway_cli.add_arguments(gateway)
    gateway.set_defaults(func=gateway_cli.run)

    for entry in entry_points(group="cadenza.commands"):  # `operator`, `up` (cadenza.operator)
        entry.load()(sub)
    for command in sub.choices.values():  # `cadenza serve --log-level DEBUG` works too
        command.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=argparse.SUPPRESS,
                             help="log level (also accepted before the command; default: INFO)")
    return parser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown for every option that has one (once: not where the help already says it,
    nor ``None``); the epilog's layout kept."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def _enable_triton_interpreter_without_gpu() -> None:
    """Triton kernels run under its interpreter without a GPU; Triton reads the switch when it
    is first imported, which torch may do at any time, so it is set before anything runs."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("serve", "up"):
        _enable_triton_interpreter_without_gpu()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, EmbeddedModelError, FileNotFoundError, ValueError) as exc:
        print(f"cadenza: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
