"""PNG figures of a ``cadenza sim`` report (its JSON-able dict), for a person to read at a glance.

- ``goodput_by_policy.png`` (``--compare``): goodput per policy, one bar each, split by class;
- ``capacity_by_policy.png`` (``--sweep``): the highest request rate each policy holds its SLOs
  at;
- ``slo_attainment_over_time.png``: per class, the share of requests finishing in each window
  that met their SLO, with the controller's acted decisions as vertical lines (retunes dotted,
  reshapes solid) — of ``auto`` when the report compared policies.

Drawn on matplotlib's Agg canvas through ``Figure`` objects (no pyplot, no display); matplotlib is
the ``plot`` extra.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

FIGSIZE = (9.0, 4.0)
DPI = 110
CLASS_COLOURS = {"interactive": "tab:blue", "batch": "tab:orange", "background": "tab:green"}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def goodput_by_policy(runs: Mapping[str, Mapping[str, Any]], path: Path) -> Path:
    """Stacked bars: each policy's goodput (req/s within SLO) by class."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE)
    ax = fig.add_subplot()
    names = list(runs)
    bottom = [0.0] * len(names)
    classes = list(dict.fromkeys(c for r in runs.values() for c in r["by_class"]))
    for cls in classes:
        heights = [runs[n]["by_class"].get(cls, {}).get("goodput_rps") or 0.0 for n in names]
        ax.bar(names, heights, bottom=bottom, label=cls, color=CLASS_COLOURS.get(cls))
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, n in enumerate(names):
        dropped = runs[n]["dropped"]
        ax.annotate(f"{bottom[i]:.2f}" + (f"\n{dropped} dropped" if dropped else ""), (i, bottom[i]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("goodput (requests/s within SLO)")
    ax.set_title("Goodput by policy (same trace, same cost model)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def capacity_by_policy(capacity: Mapping[str, float], path: Path) -> Path:
    """One bar per policy: the request rate it holds its SLOs at."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE)
    ax = fig.add_subplot()
    names = list(capacity)
    ax.bar(names, [capacity[n] for n in names], color="tab:blue")
    for i, n in enumerate(names):
        ax.annotate(f"{capacity[n]:.2f}", (i, capacity[n]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("capacity at SLO (requests/s)")
    ax.set_title("Capacity at SLO by policy")
    return _save(fig, path)


def slo_attainment_over_time(attainment: Mapping[str, Sequence[tuple[float, float]]],
                             actions: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """Per class, ``(window end s, share met)`` points, with acted decisions marked."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE)
    ax = fig.add_subplot()
    for cls, points in attainment.items():
        if points:
            ax.plot([t for t, _ in points], [100 * a for _, a in points], marker=".", label=cls,
                    color=CLASS_COLOURS.get(cls))
    for a in actions:
        if a["acted"]:
            ax.axvline(a["time_s"], color="black", alpha=0.5, linestyle="-" if a["action"] == "reshape" else ":")
    ax.set_ylim(0, 105)
    ax.set_xlabel("simulated time (s); lines: controller actions (solid: reshape, dotted: retune)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def write_plots(report: Mapping[str, Any], folder: Path) -> list[Path]:
    """Every figure the report has data for, into ``folder`` (created).

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib  # noqa: F401  (fail early and clearly when it is missing)

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    runs = report.get("policies")
    if runs:
        out.append(goodput_by_policy(runs, folder / "goodput_by_policy.png"))
    if report.get("capacity_req_s"):
        out.append(capacity_by_policy(report["capacity_req_s"], folder / "capacity_by_policy.png"))
    shown = runs.get("auto", next(iter(runs.values()))) if runs else report
    if shown.get("attainment_over_time"):
        name = shown.get("policy") or report.get("pool", "")
        out.append(slo_attainment_over_time(shown["attainment_over_time"], shown.get("actions", []),
                                            folder / "slo_attainment_over_time.png", f"SLO attainment over time ({name})"))
    return out
