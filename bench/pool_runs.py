"""Runs of a ``cadenza up`` pool under timed requests, judged per window: the shared half of
``bench/hybrid.py`` and ``bench/hybrid_day.py``.

:func:`run_pool` starts ``cadenza up`` on a ServingPool document with a state file, sends each
:class:`Job` at its time as a streamed completion through the gateway (:func:`drive`: every
token's arrival recorded in a :class:`Result`), keeps every decision the SLO controller shows in
the state file while it runs (the state keeps only its last ``MAX_LOG``), and stops the pool.
:func:`summarize` judges the interactive SLO per window; :func:`plot` draws the windows of several
runs with the controller's actions marked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import aiohttp
import yaml

from bench.common import pct

# The colour of each kind of controller action in the figures: a retune, or one of the moves.
ACTION_COLOURS = {"retune": "tab:blue", "dedicate": "tab:purple", "merge": "tab:pink",
                  "disaggregate": "tab:brown", "aggregate": "tab:olive"}


@dataclass
class Job:
    """A request to send ``at`` seconds after the start: ``prompt`` (token ids) of class ``cls``,
    ``max_tokens`` out (EOS ignored, so exactly that many unless cut)."""

    at: float
    cls: str
    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    """What a :class:`Job` got: sent at ``start`` (monotonic seconds), its first token ``ttft``
    seconds later, then ``gaps`` (seconds between tokens), ``tokens`` in all, done at ``end``;
    ``error`` when it failed (an HTTP status other than 200, a connection error); ``cut`` when
    the run ended before it finished (not a failure)."""

    cls: str
    start: float
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    end: float = 0.0
    error: str | None = None
    cut: bool = False


class Run(NamedTuple):
    """A pool's run: every job's result, the monotonic and wall-clock starts (the controller's
    decisions carry RFC 3339 times), and every decision the state file showed, in order."""

    results: list[Result]
    t0: float
    wall0: float
    decisions: list[dict]


async def one(session: aiohttp.ClientSession, url: str, job: Job, t0: float, model_name: str,
              gate: asyncio.Semaphore | None = None) -> Result:
    """Send ``job`` at ``t0 + job.at`` (once ``gate``, when given, lets it: a client's own limit on
    requests in flight) and stream its tokens. Cancelled, it returns what it got, marked cut."""
    res = Result(job.cls, t0 + job.at)
    try:
        await asyncio.sleep(max(0.0, t0 + job.at - time.monotonic()))
        async with gate or contextlib.nullcontext():
            res.start = time.monotonic()
            await _stream(session, url, job, model_name, res)
    except asyncio.CancelledError:
        res.cut = True
    except (aiohttp.ClientError, TimeoutError) as exc:
        res.error = repr(exc)
    res.end = time.monotonic()
    return res


async def _stream(session: aiohttp.ClientSession, url: str, job: Job, model_name: str, res: Result) -> None:
    body = {"model": model_name, "prompt": job.prompt, "max_tokens": job.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body, headers={"x-cadenza-class": job.cls}) as resp:
        if resp.status != 200:
            res.error = f"HTTP {resp.status}"
            return
        last = None
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now = time.monotonic()
            if res.ttft is None:
                res.ttft = now - res.start
            elif last is not None:
                res.gaps.append(now - last)
            last = now
            res.tokens += 1


async def drive(url: str, jobs: list[Job], model_name: str, *, in_flight: dict[str, int] | None = None,
                cut_at_s: float | None = None, cut: Iterable[str] = ()) -> tuple[list[Result], float, float]:
    """Every job's result (in ``jobs``' order), the monotonic start and the wall-clock start.

    ``in_flight``: class -> most of its requests this client keeps in flight (the others wait
    here, in order, and their TTFT counts from when they are sent). ``cut_at_s``: seconds after
    the start when the requests of the classes in ``cut`` still running or waiting are cancelled
    (marked cut); the others are awaited to the end.
    """
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        gates = {cls: asyncio.Semaphore(n) for cls, n in (in_flight or {}).items()}
        t0, wall0 = time.monotonic(), time.time()
        tasks = [asyncio.create_task(one(session, url, j, t0, model_name, gates.get(j.cls))) for j in jobs]
        if cut_at_s is not None:
            await asyncio.wait(tasks, timeout=max(0.0, t0 + cut_at_s - time.monotonic()))
            cut = set(cut)
            for job, task in zip(jobs, tasks):
                if job.cls in cut:
                    task.cancel()
        results = await asyncio.gather(*tasks)
    return list(results), t0, wall0


def run_pool(name: str, pool: dict, jobs: list[Job], workdir: Path, model_name: str, **drive_args) -> Run:
    """Start ``cadenza up`` on the ServingPool document ``pool`` (its files and log in ``workdir``,
    named after ``name``), :func:`drive` ``jobs`` through its gateway (``drive_args`` passed on),
    and stop it (SIGINT, as a user's Ctrl-C).

    Raises:
        RuntimeError: the pool did not start within 300 s (the log's tail in the message).
    """
    port = _free_port()
    pool_file, state, log_path = workdir / f"{name}.yaml", workdir / f"{name}.state.json", workdir / f"{name}.log"
    pool_file.write_text(yaml.safe_dump(pool))
    log = open(log_path, "w")
    up = subprocess.Popen([sys.executable, "-m", "cadenza.node.cli", "up", str(pool_file), "--port", str(port),
                           "--state-file", str(state)], stdout=log, stderr=subprocess.STDOUT,
                          env={**os.environ, "TMPDIR": str(workdir)})
    try:
        deadline = time.monotonic() + 300
        while not state.exists():
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cadenza up ({name}) did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.5)
        (results, t0, wall0), decisions = asyncio.run(
            _watching(state, drive(f"http://127.0.0.1:{port}", jobs, model_name, **drive_args)))
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)
        log.close()
    return Run(results, t0, wall0, decisions)


async def _watching(state: Path, work):
    """``work``'s result and every controller decision ``state`` showed while it ran."""
    seen: dict[str, dict] = {}

    async def watch() -> None:
        while True:
            _collect(state, seen)
            await asyncio.sleep(1.0)

    watcher = asyncio.create_task(watch())
    try:
        out = await work
    finally:
        watcher.cancel()
    _collect(state, seen)
    return out, list(seen.values())


def _collect(state: Path, seen: dict[str, dict]) -> None:
    try:
        decisions = json.loads(state.read_text()).get("controller", {}).get("decisions", [])
    except (OSError, ValueError):  # between two writes, or gone at shutdown
        return
    for d in decisions:
        seen.setdefault(json.dumps(d, sort_keys=True), d)


def summarize(name: str, run: Run, *, slo: dict, duration_s: float, window_s: float, min_window_requests: int,
              batch_over_s: float | None = None) -> dict:
    """A run judged: per window of ``window_s`` seconds (those that start within ``duration_s``)
    the interactive requests sent in it, their TTFT p99 and ITL p99 (ms) and whether the
    interactive SLO held (both within ``slo["interactive"]``'s ``ttftP99Ms`` and ``itlP99Ms``;
    None: fewer than ``min_window_requests`` requests, not judged); the share of judged windows
    that held; batch output tokens/s (over ``batch_over_s`` seconds, else from the first batch
    request sent to the last done); goodput (requests/s within every target of their class in
    ``slo``); failed requests; the controller's acted decisions with their times from the start.
    """
    inter = slo["interactive"]
    t0, results, windows = run.t0, run.results, []
    for w in range(int(duration_s // window_s)):
        lo, hi = t0 + w * window_s, t0 + (w + 1) * window_s
        mine = [r for r in results if r.cls == "interactive" and lo <= r.start < hi and r.ttft is not None]
        ttft = pct([r.ttft for r in mine], 99) * 1e3 if mine else None
        gaps = [g for r in mine for g in r.gaps]
        itl = pct(gaps, 99) * 1e3 if gaps else None
        held = None if len(mine) < min_window_requests else (  # too few to judge: neither held nor missed
            ttft <= inter["ttftP99Ms"] and (itl is None or itl <= inter["itlP99Ms"]))
        windows.append({"start_s": w * window_s, "requests": len(mine), "ttft_p99_ms": ttft and round(ttft, 1),
                        "itl_p99_ms": itl and round(itl, 1), "slo_met": held})
    judged = [w for w in windows if w["slo_met"] is not None]
    batch = [r for r in results if r.cls == "batch" and r.error is None]
    span = batch_over_s if batch_over_s is not None else (
        (max(r.end for r in batch) - min(r.start for r in batch)) if batch else 0.0)
    good = sum(1 for r in results if r.error is None and not r.cut and r.ttft is not None
               and r.ttft * 1e3 <= slo[r.cls]["ttftP99Ms"]
               and (r.cls != "interactive" or not r.gaps or pct(r.gaps, 99) * 1e3 <= inter["itlP99Ms"]))
    actions = [d for d in run.decisions if d.get("acted")]
    return {
        "mode": name,
        "windows": windows,
        "slo_windows_share": round(sum(w["slo_met"] is True for w in windows) / max(1, len(judged)), 3),
        "windows_judged": len(judged),
        "batch_output_tokens_per_s": round(sum(r.tokens for r in batch) / span, 2) if span else 0.0,
        "batch_ttft_p99_s": round(pct([r.ttft for r in batch if r.ttft is not None], 99), 1) if batch else None,
        "batch_done_at_s": round(max(r.end for r in batch) - t0, 1) if batch else None,
        "goodput_req_per_s": round(good / duration_s, 3),
        "failed": sum(1 for r in results if r.error is not None),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "actions": [{"at_s": round(_epoch(a["time"]) - run.wall0, 1), "action": a["action"], "move": a.get("move"),
                     "knobs": a.get("knobs"), "reason": a["reason"]} for a in actions],
        "reshapes": sum(1 for a in actions if a["action"] == "reshape"),
    }


def plot(runs: dict, path: Path, *, slo: dict, window_s: float, background: Callable | None = None,
         note: str = "") -> None:
    """One panel per run: each window's worse interactive figure as a share of its target (TTFT
    p99 or ITL p99 over ``slo["interactive"]``'s: over 1 is a miss), coloured by the verdict, and
    the controller's actions as dotted lines coloured by kind (:data:`ACTION_COLOURS`), labelled
    with the move or the knobs. ``background(ax)``, when given, draws under each panel (the
    workload's shape); ``note`` ends the x-axis label (what ``background`` drew)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    inter = slo["interactive"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.3 * len(runs)), sharex=True, squeeze=False)
    axes = axes[:, 0]
    kinds = set()
    for ax, (mode, run) in zip(axes, runs.items()):
        if background is not None:
            background(ax)
        xs = [w["start_s"] + window_s / 2 for w in run["windows"]]
        worst = [max((w["ttft_p99_ms"] or 0) / inter["ttftP99Ms"], (w["itl_p99_ms"] or 0) / inter["itlP99Ms"])
                 for w in run["windows"]]
        ax.bar(xs, worst, width=window_s * 0.8,
               color=[{True: "tab:green", False: "tab:red", None: "tab:gray"}[w["slo_met"]] for w in run["windows"]])
        ax.axhline(1.0, ls="--", color="k", lw=1)
        for a in run["actions"]:
            kind = a["move"] or a["action"]
            kinds.add(kind)
            ax.axvline(a["at_s"], color=ACTION_COLOURS.get(kind, "tab:gray"), lw=1.5, ls=":")
            label = a["move"] or "retune " + ",".join(f"{k.split('_')[0]}={v:g}" for k, v in (a["knobs"] or {}).items())
            ax.annotate(label, (a["at_s"], ax.get_ylim()[1]), rotation=90, va="top", ha="right", fontsize=6)
        ax.set_ylabel(f"{mode}\np99 / target")
        ax.set_title(f"{mode}: interactive SLO held in {run['slo_windows_share']:.0%} of judged windows", fontsize=9)
    if kinds:
        axes[0].legend([Line2D([], [], color=ACTION_COLOURS.get(k, "tab:gray"), ls=":") for k in sorted(kinds)],
                       sorted(kinds), fontsize=6, loc="upper left", ncol=len(kinds))
    axes[-1].set_xlabel("time (s); bar: the worse of TTFT and ITL p99 over its target; green/red/grey: held / "
                        f"missed / too few requests;\ndotted: controller actions{note}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _epoch(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
