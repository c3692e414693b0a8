"""`cadenza bench` end to end: trace in, report on stdout, JSON out."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cadenza.loadgen import cli

# Output lengths 3, 1, 4, 7 (7 makes the fake server answer 500), prompts 12..40 bytes.
ROWS = [(0, 12, 3), (20, 40, 1), (40, 25, 4), (60, 30, 7), (5000, 10, 2)]


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o,
                                        "hash_ids": []}) + "\n" for t, i, o in ROWS))
    return path


def _argv(trace_path, base_url, tokenizer, *extra) -> list[str]:
    return ["--trace", str(trace_path), "--base-url", f"{base_url}/v1",
            "--tokenizer", str(tokenizer), "--no-progress", *extra]


def test_cli_replays_the_trace_and_writes_the_json_report(
        trace_path, threaded_base_url, byte_tokenizer_path, tmp_path, capsys):
    out = tmp_path / "out" / "bench.json"
    code = cli.main(_argv(trace_path, threaded_base_url, byte_tokenizer_path,
                          "--duration", "1", "--slo-ttft-ms", "5000", "--slo-itl-ms", "1000",
                          "--json", str(out)))
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "trace_replay"
    assert doc["model"] == "fake-model"
    assert (doc["completed"], doc["failed"]) == (3, 1)  # the 5 s arrival is past --duration
    for key in ("ttft_ms", "itl_ms", "tpot_ms"):
        assert set(doc[key]) >= {"mean", "p50", "p95", "p99"}
        assert doc[key]["p50"] > 0
    assert doc["output_tokens_per_s"] > 0 and doc["goodput"] > 0
    assert doc["slo"] == {"ttft_ms": 5000.0, "itl_p99_ms": 1000.0}
    assert doc["scaling"]["duration_s"] == 1.0 and doc["scaling"]["kept_requests"] == 4
    assert "first 1 s after scaling" in doc["scaling_description"]

    records = doc["requests"]
    assert [r["output_len"] for r in records] == [3, 1, 4, 7]
    for record in records:
        assert set(record) >= {"arrival_s", "ttft_ms", "itl_ms", "e2e_ms", "prompt_tokens",
                               "completion_tokens", "ok", "error"}
        if record["ok"]:
            assert len(record["itl_ms"]) == record["completion_tokens"] - 1
            assert record["prompt_tokens"] == record["input_len"]  # prompts of exact length
    assert records[3]["error"] == "HTTP 500: boom"

    stdout = capsys.readouterr().out
    assert "Trace scaled:" in stdout and "Goodput (req/s)" in stdout and "TTFT (ms)" in stdout


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_cli_accepts_the_api_root_with_or_without_v1_and_a_trailing_slash(
        suffix, trace_path, threaded_base_url, byte_tokenizer_path, tmp_path):
    out = tmp_path / "bench.json"
    argv = _argv(trace_path, threaded_base_url, byte_tokenizer_path, "--num-requests", "1",
                 "--json", str(out))
    argv[argv.index("--base-url") + 1] = threaded_base_url + suffix
    assert cli.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["base_url"] == f"{threaded_base_url}/v1"
    assert doc["model"] == "fake-model" and doc["completed"] == 1
    assert doc["server_samples_url"] == f"{threaded_base_url}/ready"


def test_cli_refuses_a_base_url_that_is_not_an_http_url(trace_path, byte_tokenizer_path, capsys):
    code = cli.main(["--trace", str(trace_path), "--base-url", "127.0.0.1:8000",
                     "--tokenizer", str(byte_tokenizer_path), "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--base-url: not an http(s) URL" in err and "http://127.0.0.1:8000/v1" in err


def test_cli_scales_time_and_lengths_as_asked(
        trace_path, threaded_base_url, byte_tokenizer_path, tmp_path):
    out = tmp_path / "bench.json"
    code = cli.main(_argv(trace_path, threaded_base_url, byte_tokenizer_path,
                          "--time-scale", "0.5", "--length-scale", "2", "--max-output-len", "5",
                          "--num-requests", "2", "--endpoint", "chat", "--json", str(out)))
    assert code == 0
    doc = json.loads(out.read_text())
    assert [r["arrival_s"] for r in doc["requests"]] == [0.0, 0.01]
    assert [(r["input_len"], r["output_len"]) for r in doc["requests"]] == [(24, 5), (80, 2)]
    assert [r["completion_tokens"] for r in doc["requests"]] == [5, 2]
    assert doc["endpoint"] == "chat" and doc["scaling"]["time_scale"] == 0.5


def test_cli_fails_when_every_request_fails(trace_path, threaded_base_url, byte_tokenizer_path):
    argv = _argv(trace_path, threaded_base_url, byte_tokenizer_path, "--num-requests", "1")
    argv[argv.index("--base-url") + 1] = f"{threaded_base_url}/busy/v1"
    assert cli.main(argv) == 1


def test_cli_without_a_tokenizer_says_to_pass_one(trace_path, tmp_path, capsys):
    code = cli.main(["--trace", str(trace_path), "--base-url", "http://127.0.0.1:9/v1",
                     "--tokenizer", str(tmp_path / "no-model"), "--no-progress"])
    assert code == 2
    assert "pass --tokenizer" in capsys.readouterr().err


def test_cli_reports_a_malformed_trace_without_a_traceback(tmp_path, byte_tokenizer_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert cli.main(["--trace", str(bad), "--base-url", "http://127.0.0.1:9/v1"]) == 2
    assert "bad.jsonl:1: missing key(s)" in capsys.readouterr().err


def test_cli_help_says_how_time_scale_changes_the_rate():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "F=2 halves the request rate" in text
    assert "with or without the /v1 suffix" in text
    assert "bench-results/run.json" in text and "bench-results/figures" in text
    for option in ("--trace", "--base-url", "--time-scale", "--length-scale", "--max-input-len",
                   "--max-output-len", "--num-requests", "--duration", "--slo-ttft-ms",
                   "--slo-itl-ms", "--json", "--endpoint", "--model", "--tokenizer", "--seed",
                   "--request-timeout", "--class", "--batch-above", "--plot", "--plot-only",
                   "--long-prompt-tokens"):
        assert option in text


TRACEPARENT = r"00-[0-9a-f]{32}-[0-9a-f]{16}-01"


def test_cli_batch_above_classes_requests_by_prompt_length_and_reports_per_class(
        trace_path, threaded_base_url, fake_app, fake, byte_tokenizer_path, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = cli.main(_argv(trace_path, threaded_base_url, byte_tokenizer_path, "--duration", "1",
                          "--batch-above", "30", "--json", str(out)))
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["traffic_classes"] == {"class": None, "batch_above": 30}
    # Prompts of 12, 40, 25 and 30 tokens; the last one fails (HTTP 500).
    assert [r["class"] for r in doc["requests"]] == ["interactive", "batch", "interactive", "batch"]
    sent = {len(h["prompt"]): h["headers"]["x-cadenza-class"] for h in fake_app[fake.RECEIVED_HEADERS]}
    assert sent == {12: "interactive", 40: "batch", 25: "interactive", 30: "batch"}
    per = doc["per_class"]
    assert list(per) == ["interactive", "batch"]
    assert (per["interactive"]["completed"], per["batch"]["completed"], per["batch"]["failed"]) == (2, 1, 1)
    for stats in per.values():
        assert stats["ttft_ms"]["p50"] > 0 and set(stats["itl_ms"]) >= {"p50", "p95", "p99"}
    assert "Per class" in capsys.readouterr().out


def test_cli_records_the_trace_id_each_request_was_sent_with(
        trace_path, threaded_base_url, fake_app, fake, byte_tokenizer_path, tmp_path):
    out = tmp_path / "bench.json"
    assert cli.main(_argv(trace_path, threaded_base_url, byte_tokenizer_path, "--duration", "1",
                          "--class", "background", "--json", str(out))) == 0
    doc = json.loads(out.read_text())
    received = fake_app[fake.RECEIVED_HEADERS]
    assert {h["headers"]["x-cadenza-class"] for h in received} == {"background"}
    assert all(re.fullmatch(TRACEPARENT, h["headers"]["traceparent"]) for h in received)
    sent_ids = {h["headers"]["traceparent"].split("-")[1] for h in received}
    assert {r["trace_id"] for r in doc["requests"]} == sent_ids and len(sent_ids) == 4
    assert {r["class"] for r in doc["requests"]} == {"background"}


def test_cli_keeps_server_samples_from_a_cadenza_ready_endpoint(
        trace_path, threaded_base_url, byte_tokenizer_path, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli.main(_argv(trace_path, threaded_base_url, byte_tokenizer_path, "--duration", "1",
                          "--json", str(out))) == 0
    doc = json.loads(out.read_text())
    assert doc["server_samples_url"] == f"{threaded_base_url}/ready"
    assert doc["server_samples_note"] is None
    samples = doc["server_samples"]
    assert len(samples) >= 2  # one at the start, one after the last request
    assert set(samples[0]) == {"t", "num_steps", "prefill_tokens_admitted", "decode_tokens",
                               "kv_blocks_used", "kv_blocks_cached", "kv_blocks_total",
                               "num_running", "num_waiting", "prefix_cache_queried_tokens",
                               "prefix_cache_hit_tokens"}
    assert samples[0]["t"] < samples[-1]["t"]
    stdout = capsys.readouterr().out
    assert f"server samples from {threaded_base_url}/ready" in stdout
    intervals = len(samples) - 1  # poll n reports 10n hits of 40n tokens looked up
    assert doc["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert (doc["prefix_cache_hit_tokens"], doc["prefix_cache_queried_tokens"]) == (
        10 * intervals, 40 * intervals)
    assert f"25.0% of prompt tokens ({10 * intervals} of {40 * intervals})" in stdout
    assert all(r["class"] is None for r in doc["requests"]) and doc["per_class"] == {}


def test_cli_against_a_server_without_ready_reports_no_samples_and_skips_those_plots(
        trace_path, threaded_server, fake, byte_tokenizer_path, tmp_path, capsys):
    base = threaded_server(fake.make_app(ready="missing"))
    out, figs = tmp_path / "bench.json", tmp_path / "figs"
    code = cli.main(_argv(trace_path, base, byte_tokenizer_path, "--duration", "1",
                          "--json", str(out), "--plot", str(figs)))
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["server_samples"] == [] and "HTTP 404" in doc["server_samples_note"]
    assert doc["prefix_cache_hit_rate"] is None
    assert sorted(p.name for p in figs.iterdir()) == ["ttft_itl_over_time.png",
                                                      "ttft_vs_prompt_length.png"]
    stdout = capsys.readouterr().out
    assert stdout.count("not a cadenza server") == 1
    assert re.search(r"^Prefix cache hits +n/a$", stdout, re.MULTILINE)
    assert "skipped tokens_per_step.png and kv_blocks.png" in stdout


def test_cli_plot_writes_four_figures_and_plot_only_redraws_them_from_the_json(
        trace_path, threaded_base_url, byte_tokenizer_path, tmp_path, capsys):
    from matplotlib.image import imread

    out, figs, again = tmp_path / "bench.json", tmp_path / "figs", tmp_path / "again"
    assert cli.main(_argv(trace_path, threaded_base_url, byte_tokenizer_path, "--duration", "1",
                          "--batch-above", "30", "--json", str(out), "--plot", str(figs),
                          "--long-prompt-tokens", "40")) == 0
    names = ["ttft_itl_over_time.png", "ttft_vs_prompt_length.png", "tokens_per_step.png",
             "kv_blocks.png"]
    assert sorted(p.name for p in figs.iterdir()) == sorted(names)
    stdout = capsys.readouterr().out
    for name in names:
        assert (figs / name).stat().st_size > 0 and imread(figs / name).ndim == 3
        assert f"Wrote {figs / name}" in stdout

    assert cli.main(["--plot-only", str(out), "--plot", str(again)]) == 0
    assert sorted(p.name for p in again.iterdir()) == sorted(names)


def test_cli_figures_draw_the_slos_from_the_json_result(
        trace_path, threaded_base_url, byte_tokenizer_path, tmp_path):
    from cadenza.loadgen.plots import plot_ttft_itl_over_time

    out = tmp_path / "bench.json"
    assert cli.main(_argv(trace_path, threaded_base_url, byte_tokenizer_path, "--num-requests", "2",
                          "--slo-ttft-ms", "5000", "--slo-itl-ms", "1000", "--json", str(out))) == 0
    top, bottom = plot_ttft_itl_over_time(json.loads(out.read_text()), None).axes
    for ax, level, label in ((top, 5000.0, "TTFT SLO (5000 ms)"),
                             (bottom, 1000.0, "p99 ITL SLO (1000 ms)")):
        assert [ln.get_ydata()[0] for ln in ax.lines if ln.get_linestyle() == "--"] == [level]
        assert label in [t.get_text() for t in ax.get_legend().get_texts()]
        assert "(no class)" not in " ".join(t.get_text() for t in ax.get_legend().get_texts())


def test_cli_plot_only_needs_a_plot_folder_and_a_bench_result(tmp_path, capsys):
    not_a_result = tmp_path / "x.json"
    not_a_result.write_text("[]")
    assert cli.main(["--plot-only", str(not_a_result)]) == 2
    assert "--plot-only needs --plot DIR" in capsys.readouterr().err
    assert cli.main(["--plot-only", str(not_a_result), "--plot", str(tmp_path)]) == 2
    assert "is not a 'cadenza bench --json' result" in capsys.readouterr().err


def test_cli_without_plot_only_still_needs_a_trace_and_a_base_url(capsys):
    assert cli.main([]) == 2
    assert "required: --trace, --base-url" in capsys.readouterr().err


def test_cli_class_and_batch_above_cannot_be_combined(trace_path):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--trace", str(trace_path), "--base-url", "http://h/v1", "--class", "batch",
                  "--batch-above", "10"])
    assert exc.value.code == 2


REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("git") is None or not (REPO_ROOT / ".git").exists(),
                    reason="needs git and a checkout")
def test_bench_output_written_in_the_repository_root_is_git_ignored():
    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO_ROOT,
                              check=False).returncode == 0

    for path in ("bench.json", "bench-azure-conv.json", f"{cli.OUTPUT_DIR}/run.json",
                 f"{cli.OUTPUT_DIR}/figures/kv_blocks.png"):
        assert ignored(path), path
    for path in ("bench/classes.py", "loadgen/cli.py", "docs/img/ttft_itl_over_time.png"):
        assert not ignored(path), path


def test_cli_sends_the_traces_class_and_tenant_columns(
        tmp_path, threaded_base_url, fake_app, fake, byte_tokenizer_path):
    trace = tmp_path / "classes.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "class": c,
                                         "tenant": n}) + "\n"
                             for t, i, o, c, n in [(0, 12, 3, "batch", "etl"), (50, 25, 2, "interactive", "chat")]))
    out = tmp_path / "bench.json"
    assert cli.main(_argv(trace, threaded_base_url, byte_tokenizer_path, "--json", str(out))) == 0
    sent = {len(h["prompt"]): (h["headers"]["x-cadenza-class"], h["headers"]["x-cadenza-tenant"])
            for h in fake_app[fake.RECEIVED_HEADERS]}
    assert sent == {12: ("batch", "etl"), 25: ("interactive", "chat")}
    assert [(r["class"], r["tenant"]) for r in json.loads(out.read_text())["requests"]] == [
        ("batch", "etl"), ("interactive", "chat")]
    # a --class given on the command line wins over the trace's
    assert cli.main(_argv(trace, threaded_base_url, byte_tokenizer_path, "--class", "background",
                          "--json", str(out))) == 0
    assert {r["class"] for r in json.loads(out.read_text())["requests"]} == {"background"}


def test_cli_against_a_cadenza_gateway_samples_its_whole_pool_and_draws_every_figure(
        trace_path, threaded_server, fake, byte_tokenizer_path, tmp_path, capsys):
    from cadenza.gateway.app import create_gateway_app
    from cadenza.gateway.upstreams import Upstreams

    one, two = threaded_server(fake.make_app()), threaded_server(fake.make_app())
    gateway = threaded_server(create_gateway_app(Upstreams({"interactive": [one], "batch": [two]}),
                                                 health_interval_s=0))
    out, figs = tmp_path / "bench.json", tmp_path / "figs"
    assert cli.main(_argv(trace_path, gateway, byte_tokenizer_path, "--duration", "1",
                          "--json", str(out), "--plot", str(figs))) == 0
    doc = json.loads(out.read_text())
    assert doc["server_samples_note"] is None
    assert doc["server_samples_url"] == f"{gateway}/gateway/stats"
    samples = doc["server_samples"]
    assert len(samples) >= 2
    # each replica's poll n reports 3n steps and 64 KV blocks: the pool's are their sums
    assert all(s["kv_blocks_total"] == 2 * fake.KV_BLOCKS_TOTAL for s in samples)
    assert all(s["num_steps"] % 3 == 0 and s["num_steps"] >= 6 for s in samples)
    assert doc["prefix_cache_hit_rate"] == pytest.approx(0.25)  # 10n of 40n on both replicas
    assert sorted(p.name for p in figs.iterdir()) == ["kv_blocks.png", "tokens_per_step.png",
                                                      "ttft_itl_over_time.png", "ttft_vs_prompt_length.png"]
    stdout = capsys.readouterr().out
    assert "not a cadenza server" not in stdout and "skipped" not in stdout
