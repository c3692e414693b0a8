"""``cadenza bench``: replay a request trace against an OpenAI-compatible endpoint.

Loads a trace (:mod:`cadenza.loadgen.trace`), scales it, synthesizes prompts of the trace's
lengths (:mod:`cadenza.loadgen.prompts`), replays it with streaming
(:mod:`cadenza.loadgen.client`) while sampling a cadenza server's counters
(:mod:`cadenza.loadgen.server_samples`), prints a report (:mod:`cadenza.loadgen.report`),
optionally writes everything, per-request records included, to JSON, and draws figures
(:mod:`cadenza.loadgen.plots`). Requests can be sent as traffic classes (``--class``,
``--batch-above``); each carries a W3C ``traceparent`` whose trace id is in its record.

Usage::

    cadenza bench --trace data/traces/azure2023/AzureLLMInferenceTrace_conv.csv \\
        --base-url http://localhost:8000 --time-scale 4 --length-scale 0.25 \\
        --duration 120 --slo-ttft-ms 500 --slo-itl-ms 100 --json bench-results/run.json \\
        --batch-above 2048 --plot bench-results/figures
    cadenza bench --plot-only bench-results/run.json --plot bench-results/figures
    python -m cadenza.loadgen.cli --help
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from cadenza.loadgen.client import (
    ReplayConfig, ReplayResult, RequestRecord, api_base_url, fetch_model, replay)
from cadenza.loadgen.headers import ClassRule, request_headers
from cadenza.loadgen.report import SLO, format_summary, summarize
from cadenza.loadgen.server_samples import ServerSampler
from cadenza.loadgen.trace import ScaledTrace, TraceRequest, load_trace, scale_trace
from cadenza.node.embedded import embedded_model_dir
from cadenza.node.core.policy import CLASSES

if TYPE_CHECKING:  # tokenizers and tqdm are imported when a replay runs: `cadenza gateway` needs neither
    from cadenza.loadgen.prompts import PromptSynthesizer

OUTPUT_DIR = "bench-results"  # the folder the help suggests for --json and --plot (git-ignored)
DESCRIPTION = (
    "Replay a request trace (Azure CSV or JSONL) against an OpenAI-compatible endpoint with "
    "streaming; report TTFT, ITL, TPOT, throughput and goodput."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``cadenza bench`` options to ``parser``."""
    io = parser.add_argument_group("trace and endpoint")
    io.add_argument("--trace", type=Path, metavar="PATH",
                    help="(required unless --plot-only) Azure CSV (TIMESTAMP, ContextTokens, "
                         "GeneratedTokens) or JSONL (timestamp in ms, input_length, "
                         "output_length) trace file")
    io.add_argument("--base-url", metavar="URL",
                    help="(required unless --plot-only) API root, with or without the /v1 "
                         "suffix: http://localhost:8000 and http://localhost:8000/v1 are the "
                         "same (/v1 is added unless the path ends in a version such as /v1); a "
                         "cadenza server's counters are polled at its origin's /ready every "
                         "0.5 s")
    io.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                    help="POST {base}/completions with a prompt (default) or "
                         "{base}/chat/completions with one user message")
    io.add_argument("--model", default=None,
                    help="model name to send (default: the first id from GET {base}/models)")
    io.add_argument("--api-key", default=None, metavar="KEY",
                    help="sent as 'Authorization: Bearer KEY'")
    io.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                    help="per-request limit in seconds, send to end of stream (default 600)")

    scale = parser.add_argument_group("trace scaling (reported with the results)")
    scale.add_argument("--time-scale", type=float, default=1.0, metavar="F",
                       help="multiply every arrival offset by F: F=2 halves the request rate, "
                            "F=0.5 doubles it, F=0 sends every request at once (default 1)")
    scale.add_argument("--length-scale", type=float, default=1.0, metavar="F",
                       help="multiply prompt and output lengths by F, at least 1 token (default 1)")
    scale.add_argument("--max-input-len", type=int, default=None, metavar="N",
                       help="cap prompt lengths at N tokens (after --length-scale)")
    scale.add_argument("--max-output-len", type=int, default=None, metavar="N",
                       help="cap output lengths at N tokens (after --length-scale)")
    scale.add_argument("--num-requests", type=int, default=None, metavar="N",
                       help="replay only the first N requests")
    scale.add_argument("--duration", type=float, default=None, metavar="S",
                       help="replay only requests arriving in the first S seconds (after "
                            "--time-scale)")

    classes = parser.add_argument_group("traffic classes (x-cadenza-class header; either option overrides a "
                                        "trace's class column, and a trace's tenant column is sent as "
                                        "x-cadenza-tenant)")
    pick = classes.add_mutually_exclusive_group()
    pick.add_argument("--class", dest="traffic_class", choices=CLASSES, default=None,
                      metavar="NAME", help=f"send every request as class NAME ({', '.join(CLASSES)}); "
                                           "default: the trace's class column, else no class header")
    pick.add_argument("--batch-above", type=int, default=None, metavar="N",
                      help="send prompts of N or more tokens as 'batch', the others as "
                           "'interactive'")

    prompts = parser.add_argument_group("prompt synthesis")
    prompts.add_argument("--tokenizer", type=Path, default=None, metavar="PATH",
                         help="tokenizer.json, or a folder holding one, used to make prompts of "
                              "the trace's lengths (default: the embedded model's)")
    prompts.add_argument("--seed", type=int, default=0, help="seed for prompt synthesis")

    out = parser.add_argument_group("objectives and output")
    out.add_argument("--slo-ttft-ms", type=float, default=None, metavar="X",
                     help="goodput counts requests with TTFT <= X ms")
    out.add_argument("--slo-itl-ms", type=float, default=None, metavar="Y",
                     help="goodput counts requests whose own p99 ITL is <= Y ms")
    out.add_argument("--json", type=Path, default=None, metavar="OUT",
                     help="write the summary, the scaling and per-request records to OUT; a "
                          f"relative path is under the current folder, e.g. {OUTPUT_DIR}/run.json")
    out.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    out.add_argument("--plot", type=Path, default=None, metavar="DIR",
                     help="write PNG figures (TTFT/ITL over time, TTFT vs prompt length, tokens "
                          "per step, KV blocks) into DIR, created if needed; a relative path is "
                          f"under the current folder, e.g. {OUTPUT_DIR}/figures")
    out.add_argument("--plot-only", type=Path, default=None, metavar="RESULT",
                     help="replay nothing: draw the --plot figures from a saved --json file")
    out.add_argument("--long-prompt-tokens", type=int, default=None, metavar="N",
                     help="mark arrivals of prompts of N or more tokens in the figures "
                          "(default: the 90th percentile of the replayed prompt lengths)")


def _fail(message: str, code: int = 2) -> int:
    print(f"cadenza bench: {message}", file=sys.stderr)
    return code


def _tokenizer_path(given: Path | None) -> Path:
    return given if given is not None else embedded_model_dir()


def _synthesize(requests: list[TraceRequest], synth: PromptSynthesizer, quiet: bool) -> list[str]:
    from tqdm import tqdm

    return [synth.prompt(r.input_len)
            for r in tqdm(requests, desc="synthesizing prompts", unit="req", disable=quiet)]


async def _replay(args: argparse.Namespace, requests: list[TraceRequest],
                  prompts: list[str]) -> tuple[str, ReplayResult, ServerSampler]:
    model = args.model
    if model is None:
        async with aiohttp.ClientSession() as session:
            model = await fetch_model(session, args.base_url, args.api_key)
    config = ReplayConfig(base_url=args.base_url, model=model, endpoint=args.endpoint,
                          timeout_s=args.request_timeout, api_key=args.api_key,
                          classes=ClassRule(args.traffic_class, args.batch_above))
    sampler = ServerSampler(args.base_url, headers=request_headers(args.api_key))
    failed = 0
    from tqdm import tqdm

    with tqdm(total=len(requests), desc="replaying", unit="req",
              disable=args.no_progress) as bar:

        def on_done(record: RequestRecord) -> None:
            nonlocal failed
            failed += not record.ok
            bar.set_postfix_str(f"failed={failed}", refresh=False)
            bar.update(1)

        result = await replay(requests, prompts, config, on_done, sampler)
    return model, result, sampler


def _document(args: argparse.Namespace, model: str, scaled: ScaledTrace, summary: dict[str, Any],
              result: ReplayResult, sampler: ServerSampler, started: str) -> dict[str, Any]:
    return {
        "benchmark": "trace_replay",
        "started_at": started,
        "trace": str(args.trace),
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "seed": args.seed,
        "scaling": scaled.scaling.as_dict(),
        "scaling_description": scaled.scaling.describe(),
        "traffic_classes": {"class": args.traffic_class, "batch_above": args.batch_above},
        **summary,
        "server_samples_url": sampler.url,
        "server_samples_note": sampler.note,
        "server_samples": sampler.samples,
        "requests": [r.as_dict() for r in result.records],
    }


def _plot(document: dict[str, Any], out_dir: Path, long_prompt_tokens: int | None) -> int:
    from cadenza.loadgen.plots import write_plots

    try:
        paths = write_plots(document, out_dir, long_prompt_tokens)
    except ImportError as exc:
        return _fail(f"--plot needs matplotlib ({exc}); pip install matplotlib")
    for path in paths:
        print(f"Wrote {path}")
    return 0


def _plot_only(args: argparse.Namespace) -> int:
    if args.plot is None:
        return _fail("--plot-only needs --plot DIR")
    try:
        document = json.loads(args.plot_only.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return _fail(f"cannot read {args.plot_only}: {exc}")
    if not isinstance(document, dict) or not isinstance(document.get("requests"), list):
        return _fail(f"{args.plot_only} is not a 'cadenza bench --json' result")
    return _plot(document, args.plot, args.long_prompt_tokens)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``; returns the process exit code.

    Exit codes: 0 when at least one request completed, 1 when none did or the model could not
    be listed, 2 for bad options, an unreadable trace or a missing tokenizer. With
    ``--plot-only``, 0 when the figures were written, else 2.
    """
    from cadenza.loadgen.prompts import PromptSynthesizer, load_tokenizer

    if args.plot_only is not None:
        return _plot_only(args)
    missing = [o for o, v in (("--trace", args.trace), ("--base-url", args.base_url)) if v is None]
    if missing:
        return _fail(f"the following arguments are required: {', '.join(missing)}")
    try:
        args.base_url = api_base_url(args.base_url)
    except ValueError as exc:
        return _fail(f"--base-url: {exc}")
    if args.batch_above is not None and args.batch_above < 1:
        return _fail(f"--batch-above must be >= 1 token, got {args.batch_above}")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        return _fail("--plot needs matplotlib; pip install matplotlib")
    try:
        scaled = scale_trace(
            load_trace(args.trace),
            time_scale=args.time_scale, length_scale=args.length_scale,
            max_input_len=args.max_input_len, max_output_len=args.max_output_len,
            num_requests=args.num_requests, duration_s=args.duration,
        )
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    if not scaled.requests:
        return _fail("no requests left after scaling; raise --duration or --num-requests")

    tokenizer_path = _tokenizer_path(args.tokenizer)
    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except Exception as exc:  # tokenizers raises its own exception types for bad files
        return _fail(f"cannot load a tokenizer from {tokenizer_path} ({exc}); pass --tokenizer "
                     "PATH (a tokenizer.json or a folder holding one), or convert the embedded "
                     "model first")

    print(scaled.scaling.describe())
    prompts = _synthesize(scaled.requests, PromptSynthesizer(tokenizer, args.seed),
                          args.no_progress)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        model, result, sampler = asyncio.run(_replay(args, scaled.requests, prompts))
    except RuntimeError as exc:
        return _fail(str(exc), code=1)

    summary = summarize(result.records, result.duration_s,
                        SLO(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms), sampler.samples)
    print(format_summary(summary, title=f"Trace replay: {model} at {args.base_url}"))
    print(scaled.scaling.describe())
    print(sampler.note or f"{len(sampler.samples)} server samples from {sampler.url}")
    document = _document(args, model, scaled, summary, result, sampler, started)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        print(f"Wrote {args.json}")
    if args.plot is not None and _plot(document, args.plot, args.long_prompt_tokens):
        return 2
    return 0 if summary["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m cadenza.loadgen.cli``."""
    parser = argparse.ArgumentParser(prog="cadenza bench", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


def register_bench(sub: argparse._SubParsersAction) -> None:
    """Add ``cadenza bench`` (the ``cadenza.commands`` entry point)."""
    parser = sub.add_parser("bench", help="replay a trace against an OpenAI-compatible endpoint")
    add_arguments(parser)
    parser.set_defaults(func=run)
