"""`cadenza bench` end to end: trace in, report on stdout, JSON out."""

from __future__ import annotations

import argparse
import json

import pytest

from cadenza.node.bench import cli

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
    for option in ("--trace", "--base-url", "--time-scale", "--length-scale", "--max-input-len",
                   "--max-output-len", "--num-requests", "--duration", "--slo-ttft-ms",
                   "--slo-itl-ms", "--json", "--endpoint", "--model", "--tokenizer", "--seed",
                   "--request-timeout"):
        assert option in text
