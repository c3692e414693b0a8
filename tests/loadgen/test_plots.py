"""Figures drawn from a replay's JSON-able result (hand-made here; end to end in test_cli.py)."""

from __future__ import annotations

import pytest
from matplotlib.image import imread

from cadenza.loadgen.plots import (
    DPI, FIGSIZE, itl_points, long_prompt_threshold, plot_ttft_itl_over_time,
    plot_ttft_vs_prompt_length, step_rates, write_plots)

ALL_FOUR = ["ttft_itl_over_time.png", "ttft_vs_prompt_length.png", "tokens_per_step.png",
            "kv_blocks.png"]


def _request(i: int, cls: str | None, prompt: int, ttft: float | None = 50.0,
             itl: tuple[float, ...] = (10.0, 20.0)) -> dict:
    return {"index": i, "arrival_s": 0.1 * i, "start_s": 0.1 * i + 0.001, "input_len": prompt,
            "output_len": len(itl) + 1, "ok": ttft is not None, "ttft_ms": ttft,
            "itl_ms": list(itl) if ttft is not None else [], "class": cls}


def _samples(n: int = 6) -> list[dict]:
    return [{"t": 0.5 * k, "num_steps": 4 * k, "prefill_tokens_admitted": 100 * k,
             "decode_tokens": 8 * k, "kv_blocks_used": k, "kv_blocks_cached": k // 2,
             "kv_blocks_total": 32, "num_running": 1, "num_waiting": 0} for k in range(n)]


def _result(samples: list[dict] | None = None) -> dict:
    requests = [_request(i, "interactive" if i % 3 else "batch", 10 + 50 * i) for i in range(10)]
    requests.append(_request(10, "batch", 20, ttft=None))  # a failed request
    return {"model": "m", "base_url": "http://h/v1", "requests": requests,
            "server_samples": samples if samples is not None else _samples()}


def test_write_plots_writes_four_readable_pngs_with_server_samples(tmp_path, capsys):
    paths = write_plots(_result(), tmp_path / "figs", long_prompt_tokens=None)
    assert [p.name for p in paths] == ALL_FOUR
    for path in paths:
        assert path.parent == tmp_path / "figs" and path.stat().st_size > 5000
        image = imread(path)
        assert image.shape[1] == round(FIGSIZE[0] * DPI) and image.shape[0] >= FIGSIZE[1] * DPI
    assert imread(paths[0]).shape[0] > imread(paths[1]).shape[0]  # two stacked panels
    assert "skipped" not in capsys.readouterr().out


def test_without_server_samples_only_the_client_side_figures_are_written(tmp_path, capsys):
    result = _result(samples=[])
    paths = write_plots(result, tmp_path, long_prompt_tokens=100)
    assert [p.name for p in paths] == ALL_FOUR[:2]
    assert not (tmp_path / "kv_blocks.png").exists()
    assert "no server samples: skipped tokens_per_step.png and kv_blocks.png" in capsys.readouterr().out
    del result["server_samples"]  # a file written before server samples existed
    assert len(write_plots(result, tmp_path, None)) == 2


def test_an_idle_engine_skips_only_the_tokens_per_step_figure(tmp_path, capsys):
    idle = [{**s, "num_steps": 7} for s in _samples()]
    assert [p.name for p in write_plots(_result(idle), tmp_path, None)] == [
        "ttft_itl_over_time.png", "ttft_vs_prompt_length.png", "kv_blocks.png"]
    assert "skipped tokens_per_step.png" in capsys.readouterr().out


def test_tokens_per_step_divide_token_deltas_by_step_deltas_at_interval_middles():
    samples = _samples(3)
    samples.insert(2, {**samples[1], "t": 0.75})  # no step in this interval: left out
    assert step_rates(samples) == [(0.25, 25.0, 2.0), (0.875, 25.0, 2.0)]
    assert step_rates(samples[:1]) == []


def test_itl_gaps_are_placed_at_the_time_each_gap_ended():
    times, gaps = itl_points(_request(0, None, 10, ttft=100.0, itl=(10.0, 30.0)))
    assert gaps == [10.0, 30.0]
    assert times == pytest.approx([0.001 + 0.110, 0.001 + 0.140])
    assert itl_points(_request(0, None, 10, ttft=None)) == ([], [])


def test_long_prompts_default_to_the_90th_percentile_of_prompt_lengths():
    assert long_prompt_threshold(list(range(1, 101)), None) == 91
    assert long_prompt_threshold([5, 6], 1000) == 1000
    assert long_prompt_threshold([], None) is None


def test_the_timeline_marks_long_prompt_arrivals_on_both_panels_with_one_legend_entry():
    result = _result()
    fig = plot_ttft_itl_over_time(result, long_prompt_tokens=400)
    top, bottom = fig.axes
    long_arrivals = [r["arrival_s"] for r in result["requests"] if r["input_len"] >= 400]
    for ax in (top, bottom):
        marks = [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == "-"]
        assert marks == pytest.approx(long_arrivals)
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert labels == ["interactive (6 requests)", "batch (4 requests)",
                      "arrival of a prompt\n>= 400 tokens"]
    assert top.get_ylabel() == "TTFT (ms)" and bottom.get_ylabel() == "ITL gap (ms)"
    assert bottom.get_xlabel() == "time since replay start (s)"
    assert top.get_shared_x_axes().joined(top, bottom)


def _dashed_levels(ax) -> list[float]:
    """The y of every dashed horizontal line on ``ax`` (axhline: constant y over the axes)."""
    return [line.get_ydata()[0] for line in ax.lines if line.get_linestyle() == "--"]


def _labels(ax) -> list[str]:
    legend = ax.get_legend()
    return [] if legend is None else [t.get_text() for t in legend.get_texts()]


def test_the_ttft_and_itl_panels_draw_the_given_slos_as_dashed_lines_in_the_legend():
    result = {**_result(), "slo": {"ttft_ms": 500.0, "itl_p99_ms": 40.0}}
    top, bottom = plot_ttft_itl_over_time(result, long_prompt_tokens=10_000).axes
    assert _dashed_levels(top) == [500.0] and _dashed_levels(bottom) == [40.0]
    assert "TTFT SLO (500 ms)" in _labels(top)
    assert _labels(bottom) == ["p99 ITL SLO (40 ms)"]
    (scatter,) = plot_ttft_vs_prompt_length(result).axes
    assert _dashed_levels(scatter) == [500.0] and "TTFT SLO (500 ms)" in _labels(scatter)


def test_only_the_slos_given_are_drawn():
    result = {**_result(), "slo": {"ttft_ms": None, "itl_p99_ms": 40.0}}
    top, bottom = plot_ttft_itl_over_time(result, long_prompt_tokens=10_000).axes
    assert _dashed_levels(top) == [] and _dashed_levels(bottom) == [40.0]
    for old in (_result(), {**_result(), "slo": None}):  # a result without SLOs, or an old file
        top, bottom = plot_ttft_itl_over_time(old, long_prompt_tokens=10_000).axes
        assert _dashed_levels(top) == _dashed_levels(bottom) == [] and bottom.get_legend() is None


def test_requests_without_a_class_make_one_series_with_no_class_legend():
    result = _result()
    for r in result["requests"]:
        r["class"] = None
    top, bottom = plot_ttft_itl_over_time(result, long_prompt_tokens=10_000).axes
    assert top.get_legend() is None and bottom.get_legend() is None
    assert plot_ttft_vs_prompt_length(result).axes[0].get_legend() is None
    top, _ = plot_ttft_itl_over_time({**result, "slo": {"ttft_ms": 500.0, "itl_p99_ms": None}},
                                     long_prompt_tokens=400).axes
    assert _labels(top) == ["arrival of a prompt\n>= 400 tokens", "TTFT SLO (500 ms)"]
    assert top.get_legend().get_title().get_text() == ""
