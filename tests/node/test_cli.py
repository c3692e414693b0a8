"""The ``cadenza`` command fails fast, with a clear message, on configurations that cannot serve."""

from __future__ import annotations

import subprocess
import sys

from server_process import free_port


def serve(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cadenza.node.cli", "serve", "--port", str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_invalid_knob_exits_2_naming_the_field(tiny_llama_dir):
    result = serve("--model", str(tiny_llama_dir), "--token-budget", "0")
    assert result.returncode == 2
    assert "token_budget: must be >= 1" in result.stderr and "Traceback" not in result.stderr


def test_missing_model_folder_exits_2(tmp_path):
    result = serve("--model", str(tmp_path / "nope"))
    assert result.returncode == 2 and "config.json not found" in result.stderr


def test_engine_that_cannot_start_stops_the_server_with_exit_1(tiny_llama_dir):
    result = serve("--model", str(tiny_llama_dir), "--max-model-len", "999999")
    assert result.returncode == 1
    assert "max_model_len: 999999 exceeds the model's context length 1024" in result.stderr
    assert "Traceback" not in result.stderr


def test_kv_cache_too_small_for_max_model_len_is_refused(tiny_llama_dir):
    result = serve("--model", str(tiny_llama_dir), "--max-model-len", "1024", "--num-kv-blocks", "4")
    assert result.returncode == 1 and "num_kv_blocks:" in result.stderr


def test_folder_without_tokenizer_is_refused_before_loading(tiny_llama_dir, tmp_path):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for f in tiny_llama_dir.iterdir():
        if f.name != "tokenizer.json":
            (folder / f.name).write_bytes(f.read_bytes())
    result = serve("--model", str(folder))
    assert result.returncode == 2 and "tokenizer.json not found" in result.stderr


def test_unreadable_config_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    result = serve("--model", str(tmp_path))
    assert result.returncode == 2 and "config.json is not valid JSON" in result.stderr


def test_bad_chunk_size_says_what_is_expected(tiny_llama_dir):
    result = serve("--model", str(tiny_llama_dir), "--chunk-size", "abc")
    assert result.returncode == 2 and "must be a positive integer or 'none'" in result.stderr


def test_a_busy_port_is_reported_without_a_traceback(tiny_llama_dir):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "cadenza.node.cli", "serve", "--model", str(tiny_llama_dir), "--port", str(port)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "cannot listen on 127.0.0.1" in result.stderr and "Traceback" not in result.stderr


def test_policy_file_and_flags_reach_the_engine_config(tmp_path, tiny_llama_dir):
    from cadenza.node.cli import build_parser, engine_config_from_args

    policy = tmp_path / "policy.yaml"
    policy.write_text("classes:\n  batch:\n    max_prefill_tokens: 64\ntenants:\n  gold:\n    weight: 3\n")
    args = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--policy", str(policy),
                                      "--step-time-target-ms", "80", "--no-prefix-caching"])
    config = engine_config_from_args(args)
    assert config.scheduler.policy.classes["batch"].max_prefill_tokens == 64
    assert config.scheduler.policy.tenant("gold").weight == 3
    assert config.scheduler.policy.step_time_target_ms == 80 and not config.scheduler.prefix_caching


def test_an_invalid_policy_file_is_refused_naming_the_setting(tmp_path, tiny_llama_dir):
    policy = tmp_path / "policy.json"
    policy.write_text('{"classes": {"batch": {"min_share": 3}}}')
    result = serve("--model", str(tiny_llama_dir), "--policy", str(policy))
    assert result.returncode == 2 and "classes.batch.min_share" in result.stderr
