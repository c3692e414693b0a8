"""PNG figures of a replay, drawn from its JSON-able result (the ``cadenza bench --json`` file).

:func:`write_plots` writes up to four figures into a folder:

- ``ttft_itl_over_time.png``: TTFT of each request at its send time (top) and every ITL gap at
  the time it ended (bottom), one colour per traffic class, with a vertical line at the arrival
  of every long prompt (at least ``long_prompt_tokens`` tokens; default: the 90th percentile of
  the replayed prompt lengths), so stalls can be matched to the prefills that caused them;
- ``ttft_vs_prompt_length.png``: TTFT against prompt length, coloured by class;
- ``tokens_per_step.png``: prefill and decode tokens per engine step over time, from consecutive
  server samples (Δtokens / Δsteps over each interval in which the engine stepped);
- ``kv_blocks.png``: KV cache blocks used and cached over time, the pool's total as a line.

The last two need server samples (``server_samples``, see
:mod:`cadenza.loadgen.server_samples`) and are skipped, with a printed note, without them.
Figures are drawn on matplotlib's Agg canvas through ``Figure`` objects (no pyplot, no display).

The TTFT and ITL panels draw the SLOs the replay was given (the result's ``slo``:
``ttft_ms``, ``itl_p99_ms``) as dashed horizontal lines. A legend names the classes only when
there are several (a replay sent without classes has one series and no class legend).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cadenza.loadgen.report import NO_CLASS

FIGSIZE = (10.0, 4.0)  # inches, one panel
DPI = 110
CLASS_COLOURS = {"interactive": "tab:blue", "batch": "tab:orange", "background": "tab:green",
                 NO_CLASS: "tab:gray"}
LONG_PROMPT_COLOUR = "tab:red"
LONG_PROMPT_PERCENTILE = 90
SLO_COLOUR = "black"


def _figure(height_in: float = FIGSIZE[1], rows: int = 1, sharex: bool = False):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIGSIZE[0], height_in), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, 1, sharex=sharex, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, axes


def _legend(ax, **kw) -> None:
    """A legend outside the plot, on the right, so it never hides data; none without labels."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small",
                  borderaxespad=0, **kw)


def _class_name(record: dict[str, Any]) -> str:
    return record.get("class") or NO_CLASS


def _colour(name: str) -> str:
    return CLASS_COLOURS.get(name, "tab:purple")


def _by_class(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(_class_name(r), []).append(r)
    order = list(CLASS_COLOURS)
    return dict(sorted(groups.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order
                                                       else len(order), kv[0])))


def _class_label(groups: dict[str, list[dict[str, Any]]], name: str, count: int) -> str | None:
    """The legend label of a class's series; None (no entry) when it is the only series."""
    return f"{name} ({count} requests)" if len(groups) > 1 else None


def _slo_line(ax, result: dict[str, Any], key: str, what: str) -> None:
    """A dashed horizontal line at the SLO ``result["slo"][key]`` (ms), when one was given."""
    value = (result.get("slo") or {}).get(key)
    if value is not None:
        ax.axhline(value, color=SLO_COLOUR, linestyle="--", linewidth=1, zorder=3,
                   label=f"{what} SLO ({value:g} ms)")


def _send_s(record: dict[str, Any]) -> float:
    """When the request was sent, seconds since the start (the schedule for old files)."""
    return record.get("start_s", record["arrival_s"])


def long_prompt_threshold(prompt_lens: Sequence[int], given: int | None) -> int | None:
    """``given``, or else the 90th percentile of ``prompt_lens`` rounded up; None without prompts."""
    if given is not None:
        return given
    if not prompt_lens:
        return None
    return int(np.ceil(np.percentile(prompt_lens, LONG_PROMPT_PERCENTILE)))


def itl_points(record: dict[str, Any]) -> tuple[list[float], list[float]]:
    """``(times_s, gaps_ms)``: each ITL gap of ``record`` at the time it ended (s since start)."""
    if record.get("ttft_ms") is None or not record.get("itl_ms"):
        return [], []
    first = _send_s(record) + record["ttft_ms"] / 1e3
    ends = first + np.cumsum(record["itl_ms"]) / 1e3
    return ends.tolist(), list(record["itl_ms"])


def step_rates(samples: Sequence[dict[str, Any]]) -> list[tuple[float, float, float]]:
    """``(t_mid_s, prefill_tokens_per_step, decode_tokens_per_step)`` per sample interval.

    Only intervals in which ``num_steps`` grew count (an idle server, or a restart that reset
    the counters, gives none); ``t_mid_s`` is the interval's middle, seconds since the start.
    """
    out = []
    for a, b in zip(samples, samples[1:]):
        steps = b["num_steps"] - a["num_steps"]
        if steps > 0:
            out.append(((a["t"] + b["t"]) / 2,
                        (b["prefill_tokens_admitted"] - a["prefill_tokens_admitted"]) / steps,
                        (b["decode_tokens"] - a["decode_tokens"]) / steps))
    return out


def _title(result: dict[str, Any], what: str) -> str:
    where = " at ".join(str(result[k]) for k in ("model", "base_url") if result.get(k))
    return f"{what}: {where}" if where else what


def plot_ttft_itl_over_time(result: dict[str, Any], long_prompt_tokens: int | None):
    """Two panels sharing time (s): TTFT per request and ITL gaps, by class; long-prompt marks
    and the SLO lines."""
    records = result.get("requests", [])
    fig, (top, bottom) = _figure(height_in=6.5, rows=2, sharex=True)
    groups = _by_class(records)
    for name, group in groups.items():
        done = [r for r in group if r.get("ttft_ms") is not None]
        top.plot([_send_s(r) for r in done], [r["ttft_ms"] for r in done], linestyle="none",
                 marker="o", markersize=3.5, alpha=0.8, color=_colour(name),
                 label=_class_label(groups, name, len(done)))
        times, gaps = [], []
        for r in done:
            t, g = itl_points(r)
            times += t
            gaps += g
        bottom.plot(times, gaps, linestyle="none", marker=".", markersize=3, alpha=0.6,
                    color=_colour(name))
    threshold = long_prompt_threshold([r["input_len"] for r in records], long_prompt_tokens)
    arrivals = [r["arrival_s"] for r in records
                if threshold is not None and r["input_len"] >= threshold]
    for i, t in enumerate(arrivals):
        top.axvline(t, color=LONG_PROMPT_COLOUR, linewidth=0.8, alpha=0.4, zorder=0,
                    label=f"arrival of a prompt\n>= {threshold} tokens" if i == 0 else None)
        bottom.axvline(t, color=LONG_PROMPT_COLOUR, linewidth=0.8, alpha=0.4, zorder=0)
    _slo_line(top, result, "ttft_ms", "TTFT")
    _slo_line(bottom, result, "itl_p99_ms", "p99 ITL")
    top.set_title(_title(result, "TTFT and inter-token latency over time"))
    top.set_ylabel("TTFT (ms)")
    bottom.set_ylabel("ITL gap (ms)")
    bottom.set_xlabel("time since replay start (s)")
    classes = {"title": "class (both panels)", "title_fontsize": "small"} if len(groups) > 1 else {}
    _legend(top, **classes)
    _legend(bottom)
    fig.align_ylabels([top, bottom])
    return fig


def plot_ttft_vs_prompt_length(result: dict[str, Any]):
    """TTFT (ms) of each completed request against its prompt length (tokens), by class, with
    the TTFT SLO line."""
    fig, (ax,) = _figure()
    groups = _by_class(result.get("requests", []))
    for name, group in groups.items():
        done = [r for r in group if r.get("ttft_ms") is not None]
        ax.scatter([r["input_len"] for r in done], [r["ttft_ms"] for r in done], s=14,
                   alpha=0.7, color=_colour(name), label=_class_label(groups, name, len(done)))
    _slo_line(ax, result, "ttft_ms", "TTFT")
    ax.set_title(_title(result, "TTFT against prompt length"))
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    _legend(ax)
    return fig


def plot_tokens_per_step(result: dict[str, Any]):
    """Prefill and decode tokens per engine step over time (s), from the server samples."""
    rates = step_rates(result["server_samples"])
    fig, (ax,) = _figure()
    t, prefill, decode = (list(col) for col in zip(*rates))
    ax.plot(t, prefill, marker="o", markersize=3, color="tab:red", label="prefill tokens / step")
    ax.plot(t, decode, marker="o", markersize=3, color="tab:blue", label="decode tokens / step")
    ax.set_title(_title(result, "Tokens per engine step"))
    ax.set_xlabel("time since replay start (s)")
    ax.set_ylabel("tokens per step")
    ax.set_ylim(bottom=0)
    _legend(ax)
    return fig


def plot_kv_blocks(result: dict[str, Any]):
    """KV cache blocks used and cached over time (s), with the pool's total as a line."""
    samples = result["server_samples"]
    fig, (ax,) = _figure()
    t = [s["t"] for s in samples]
    ax.plot(t, [s["kv_blocks_used"] for s in samples], marker="o", markersize=3,
            color="tab:blue", label="used")
    ax.plot(t, [s["kv_blocks_cached"] for s in samples], marker="o", markersize=3,
            color="tab:green", label="cached (free, reusable by prefix)")
    total = max(s["kv_blocks_total"] for s in samples)
    ax.axhline(total, color="black", linestyle="--", linewidth=1, label=f"total ({total})")
    ax.set_title(_title(result, "KV cache blocks"))
    ax.set_xlabel("time since replay start (s)")
    ax.set_ylabel("blocks")
    ax.set_ylim(0, total * 1.08 if total else None)
    _legend(ax)
    return fig


def write_plots(result: dict[str, Any], out_dir: Path, long_prompt_tokens: int | None,
                log: Callable[[str], None] = print) -> list[Path]:
    """Write the module's figures for ``result`` into ``out_dir`` (created if needed).

    Args:
        result: the replay's JSON document (``requests`` and, optionally, ``slo`` and
            ``server_samples``).
        out_dir: folder for the PNG files.
        long_prompt_tokens: prompts of at least this many tokens are marked; None for the 90th
            percentile of the replayed prompt lengths.
        log: where the notes about skipped figures go.

    Returns:
        The paths written, in the order listed in the module docstring.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib  # noqa: F401  (fail early and clearly when it is missing)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = [("ttft_itl_over_time.png", plot_ttft_itl_over_time(result, long_prompt_tokens)),
               ("ttft_vs_prompt_length.png", plot_ttft_vs_prompt_length(result))]
    samples = result.get("server_samples") or []
    if not samples:
        log("no server samples: skipped tokens_per_step.png and kv_blocks.png")
    else:
        if step_rates(samples):
            figures.append(("tokens_per_step.png", plot_tokens_per_step(result)))
        else:
            log("the engine took no steps between server samples: skipped tokens_per_step.png")
        figures.append(("kv_blocks.png", plot_kv_blocks(result)))
    written = []
    for name, fig in figures:
        path = out_dir / name
        fig.savefig(path)
        written.append(path)
    return written
