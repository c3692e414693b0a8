"""The ``cadenza`` command: ``serve`` and ``fetch-model``, and the subcommands the packages above
the node register under the ``cadenza.commands`` entry-point group (``bench``, ``gateway``,
``up``, ``operator``, ``sim``)."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

import yaml

from cadenza.node.core.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
    check_chunk_within_budget,
    listen_problem,
    port_argument,
)
from cadenza.node.core.knobs import KNOBS, Knob
from cadenza.node.core.parallel import check_tensor_parallel
from cadenza.node.core.policy import CLASSES, Policy
from cadenza.node import hub
from cadenza.node.credentials import require_kv_token
from cadenza.node.embedded import EmbeddedModelError
from cadenza.node.frontend.tool_parsers import TOOL_PARSERS
from cadenza.node.http.hardening import add_http_arguments

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


def _stall_seconds(value: str) -> float:
    """``--engine-stall-timeout-s``: seconds >= 0 (0: no watch)."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not (math.isfinite(seconds) and seconds >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value!r}")
    return seconds


def _knob_type(knob: Knob):
    """The argparse ``type`` of a knob: its kind, ``none`` for a nullable knob's None."""
    def parse(value: str):
        if knob.nullable and value.lower() in ("none", "off"):
            return None
        try:
            return knob.kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {'an integer' if knob.kind is int else 'a number'}"
                f"{' or none' if knob.nullable else ''}, got {value!r}") from None
    parse.__name__ = knob.kind.__name__
    return parse


def _add_knob(group, knob: Knob) -> None:
    help_text = knob.help.rstrip(".")
    if knob.kind is bool:
        group.add_argument(knob.cli, action=argparse.BooleanOptionalAction, default=knob.default, help=help_text)
    elif knob.kind is str:
        group.add_argument(knob.cli, choices=knob.choices, default=knob.default, help=help_text)
    else:
        group.add_argument(knob.cli, type=chunk_size_arg if knob.name == "chunk_size" else _knob_type(knob),
                           default=knob.default, help=help_text)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine knobs shared by every command that starts an engine (the flags of
    :data:`cadenza.node.core.knobs.KNOBS`, plus the model, device, threads and policy file)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", help="a local Hugging Face model folder (config.json, *.safetensors, tokenizer.json), "
                                   "or hf://org/name[@revision] from the Hub (downloaded once into its cache; "
                                   "HF_ENDPOINT, HF_TOKEN); default: the embedded SmolLM2-135M-Instruct")
    g.add_argument("--served-model-name", help="model id clients send (default: the folder name)")
    kv = g.add_mutually_exclusive_group()
    p = parser.add_argument_group("scheduling policy")
    for knob in KNOBS:
        if knob.cli is None:
            continue
        if knob.name in ("num_kv_blocks", "kv_cache_fraction"):
            _add_knob(kv, knob)
            if knob.name == "num_kv_blocks":
                kv.add_argument("--kv-cache-gib", type=float, help="KV cache size in GiB (default: 1 on CPU)")
        else:
            _add_knob(p if knob.section == "policy" or knob.name == "prefix_caching" else g, knob)
    g.add_argument("--device", default="auto", help="auto (cuda when a GPU is visible, else cpu), cpu or cuda[:N]")
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch intra-op threads (default: OMP_NUM_THREADS, else the CPUs this process may use: "
                        "its affinity mask capped by its cgroup CPU quota)")
    g.add_argument("--kv-transfer-port", type=int, default=None, metavar="PORT",
                   help="serve prompt KV to, and pull it from, peer replicas over TCP on this port (disaggregated "
                        "pools; 0: a free port; off by default); needs the pool's token in CADENZA_ADMIN_TOKEN "
                        "or CADENZA_ADMIN_TOKEN_FILE, which peers prove they hold")
    g.add_argument("--kv-transfer-host", default="127.0.0.1", metavar="HOST",
                   help="address the KV transfer endpoint binds and peers reach it at (the pod IP in a cluster)")
    g.add_argument("--kv-lease-s", type=float, default=30.0, metavar="SECONDS",
                   help="how long published KV waits for a decode replica's next sign of life (the same on every "
                        "replica of a pool; default 30)")
    g.add_argument("--kv-max-hold-s", type=float, default=120.0, metavar="SECONDS",
                   help="how long a request queued here keeps a prefill replica's KV leased; past it the source is "
                        "released and the prompt computed here (default 120)")
    g.add_argument("--engine-process", choices=("on", "off"), default="on",
                   help="run the engine core in its own process (on), or in a thread of the server (off)")
    g.add_argument("--engine-stall-timeout-s", type=_stall_seconds, default=None, metavar="SECONDS",
                   help="a ready engine core that sends nothing this long (it reports every step, and every second "
                        "when idle) is stopped or stuck: /health turns 503, requests in flight fail, the core process "
                        "is killed and the server exits 1 for its supervisor to restart it; keep it above the longest "
                        "step (first-run kernel compiles, the largest prefill chunk on a CPU); 0: never "
                        "(default: 300, SGLang's watchdog timeout)")
    p.add_argument("--policy", type=Path, default=None, metavar="FILE",
                   help="JSON or YAML with classes/tenants settings (the shape of GET /admin/config)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build and validate the engine configuration.

    Raises:
        ConfigError: naming the invalid field.
    """
    model = args.model
    if hub.is_hub(model):  # downloaded once into the Hub cache; served from the snapshot
        args.served_model_name = args.served_model_name or hub.parse(model)[0]
        model = str(hub.fetch(model))
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
            raise ConfigError("policy", f"cannot read {args.policy}: {exc}") from None
    sections: dict[str, dict] = {"engine": {}, "scheduler": {}, "cache": {}, "policy": {}}
    for knob in KNOBS:
        if knob.cli is not None and (knob.section != "policy" or getattr(args, knob.name) is not None):
            knob.check(getattr(args, knob.name))  # the registry's bounds, named: "token_budget: must be <= ..."
            sections[knob.section][knob.name] = getattr(args, knob.name)
    if sections["policy"]:
        policy = policy.updated(sections["policy"])
    check_chunk_within_budget(args.token_budget, args.chunk_size)  # as a pool's settings and a live change are
    return EngineConfig(
        model=model,
        served_model_name=args.served_model_name,
        device=device,
        kv_transfer_port=args.kv_transfer_port,
        kv_transfer_host=args.kv_transfer_host,
        kv_lease_s=args.kv_lease_s,
        kv_max_hold_s=args.kv_max_hold_s,
        **sections["engine"],
        scheduler=SchedulerConfig(**sections["scheduler"], policy=policy),
        cache=CacheConfig(**sections["cache"], kv_cache_bytes=kv_bytes),
    )


def _serve(args: argparse.Namespace) -> int:
    from cadenza.node.frontend.client import STALL_TIMEOUT_S
    from cadenza.node.runner.models.config import check_model_folder
    from cadenza.node.server.app import serve
    from cadenza.node.http.hardening import http_timeouts_from_args
    from cadenza.node.runner.threads import apply_threads, choose_threads

    if problem := listen_problem(args.host, args.port):  # before minutes of model loading
        logger.error("%s", problem)
        return 1
    if args.step_log is not None:  # a bad path fails now, not once the server is up
        from cadenza.node.frontend.step_log import StepLog

        StepLog(args.step_log).close()
    timeouts = http_timeouts_from_args(args)
    threads = choose_threads(args.threads)
    config = engine_config_from_args(args)
    require_kv_token(config.kv_transfer_port)  # now, not once the model has loaded
    try:
        shape = check_model_folder(config.model)  # fail now, not in the engine core, on a bad folder
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{exc}{_model_hint(args.model)}") from None
    check_tensor_parallel(config.tensor_parallel_size, shape.num_attention_heads, shape.num_key_value_heads,
                          shape.intermediate_size, config.model_name)
    if config.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("device", f"{config.device} requested but this torch build sees no CUDA device")
    engine_process = args.engine_process == "on"
    if not engine_process:
        apply_threads(threads)
    logger.info("serving %s from %s on http://%s:%d/v1 (engine core %s)", config.model_name, config.model,
                args.host, args.port, "in its own process" if engine_process else "in a thread")
    stall = args.engine_stall_timeout_s
    return serve(config, args.host, args.port, args.default_class, timeouts=timeouts,
                 engine_process=engine_process, threads=threads, step_log=args.step_log,
                 stall_timeout_s=STALL_TIMEOUT_S if stall is None else stall, tool_parser=args.tool_parser)


def _model_hint(model: str | None) -> str:
    """How to get a model folder, when ``--model`` looks like a Hugging Face repo id."""
    if model is None or Path(model).exists() or hub.is_hub(model):
        return ""
    parts = model.split("/")
    if len(parts) == 2 and all(parts) and not model.startswith((".", "~")):
        return (f". --model takes a local folder or a Hub model: {model!r} looks like a Hugging Face repo id, "
                f"serve `--model hf://{model}`")
    return ". --model takes a local Hugging Face model folder (config.json, *.safetensors, tokenizer.json)"


def _fetch_model(args: argparse.Namespace) -> int:
    if args.model is not None:  # a Hub model, into its cache (an engine pod's init container)
        print(hub.fetch(args.model))
        return 0
    from cadenza.node.embedded import ensure_embedded_model

    print(ensure_embedded_model())
    return 0


def build_parser() -> argparse.ArgumentParser:
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
    net.add_argument("--step-log", type=Path, metavar="FILE.jsonl",
                     help="append each step's composition and seconds here (the table `cadenza sim calibrate` fits)")
    net.add_argument("--tool-parser", choices=("auto", *TOOL_PARSERS), default="auto",
                     help="the format of the model's tool calls: auto reads it from the chat template (<tool_call> "
                          "blocks: hermes; <|python_tag|> or ipython: llama3_json; a template without tools: hermes, "
                          "with the tools in the system prompt)")
    add_http_arguments(serve)
    serve.set_defaults(func=_serve)

    fetch = sub.add_parser("fetch-model", help="convert the embedded SmolLM2 once, or download hf://org/name[@rev], "
                                               "and print its folder")
    fetch.add_argument("model", nargs="?", metavar="hf://org/name[@revision]",
                       help="a Hub model to download into the Hub cache (default: the embedded model)")
    fetch.set_defaults(func=_fetch_model)

    # `bench` (cadenza.loadgen), `gateway` (cadenza.gateway), `up` (cadenza.local), `operator`,
    # `sim`: the packages above the node add their commands; the node imports none of them
    for entry in entry_points(group="cadenza.commands"):
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
