"""The ``cadenza`` command fails fast, with a clear message, on configurations that cannot serve."""

from __future__ import annotations

import subprocess
import sys

import pytest

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


def test_a_kv_transfer_port_without_the_pools_token_exits_2_saying_which_to_set(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("CADENZA_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("CADENZA_ADMIN_TOKEN_FILE", raising=False)
    result = serve("--model", str(tiny_llama_dir), "--kv-transfer-port", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "KV transfer endpoint needs the pool's token (set CADENZA_ADMIN_TOKEN or CADENZA_ADMIN_TOKEN_FILE)" in result.stderr


@pytest.mark.slow  # loads the model in a new process
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


def test_a_busy_port_is_reported_before_the_model_is_even_looked_at(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "cadenza.node.cli", "serve", "--model", str(tmp_path / "nope"), "--port", str(port)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "cannot listen on 127.0.0.1" in result.stderr and "Traceback" not in result.stderr
    assert "config.json" not in result.stderr  # the port was checked first: no model was loaded


def test_a_hugging_face_repo_id_as_model_says_how_to_get_a_folder():
    result = serve("--model", "HuggingFaceTB/SmolLM2-360M-Instruct")
    assert result.returncode == 2 and "config.json not found" in result.stderr
    assert "serve `--model hf://HuggingFaceTB/SmolLM2-360M-Instruct`" in result.stderr


def test_serve_help_shows_every_default_and_the_environment():
    from cadenza.node.cli import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for expected in ("--host HOST", "address to listen on", "(default: 127.0.0.1)", "(default: 8000)",
                     "--seed SEED", "(default: 0)", "--threads N", "(default: 512)", "(default: 256)",
                     "CADENZA_ADMIN_TOKEN ", "CADENZA_ADMIN_TOKEN_FILE", "CADENZA_CACHE_DIR", "--header-timeout-s"):
        assert expected in text, expected
    assert "(default: None)" not in text  # an option without a default says what happens instead, once
    assert "default: the model's) (default" not in " ".join(text.split())


def test_log_level_is_accepted_after_the_command_too():
    from cadenza.node.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--log-level", "DEBUG"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "ERROR", "serve"]).log_level == "ERROR"
    assert parser.parse_args(["serve"]).log_level == "INFO"
    assert parser.parse_args(["bench", "--log-level", "WARNING"]).log_level == "WARNING"
    assert parser.parse_args(["serve", "--log-level", "debug"]).log_level == "DEBUG"  # any case
    assert parser.parse_args(["--log-level", "warning", "serve"]).log_level == "WARNING"


@pytest.mark.slow  # a server process
def test_serve_logs_its_threads_and_whether_the_admin_api_is_on(tiny_llama_dir, tmp_path):
    from server_process import cadenza_server

    log = tmp_path / "serve.log"
    with cadenza_server(["--model", str(tiny_llama_dir), "--threads", "1", "--max-model-len", "256"], log,
                        env={"CADENZA_ADMIN_TOKEN": ""}) as base_url:
        import json
        import urllib.request

        body = json.dumps({"model": tiny_llama_dir.name, "prompt": "Hi", "max_tokens": 2}).encode()
        req = urllib.request.Request(f"{base_url}/completions", body, headers={"Content-Type": "application/json",
                                                                               "x-cadenza-class": "batch"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
    text = log.read_text()
    assert "torch intra-op threads: 1 (--threads)" in text
    assert "admin API off: set CADENZA_ADMIN_TOKEN" in text
    assert "POST /v1/completions 200 class=batch tenant=default id=cmpl-" in text and "tokens=" in text


def test_policy_file_and_flags_reach_the_engine_config(tmp_path, tiny_llama_dir):
    from cadenza.node.cli import build_parser, engine_config_from_args
    from cadenza.node.core.config import ConfigError

    policy = tmp_path / "policy.yaml"
    policy.write_text("classes:\n  batch:\n    max_prefill_tokens: 64\ntenants:\n  gold:\n    weight: 3\n")
    args = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--policy", str(policy),
                                      "--step-time-target-ms", "80", "--no-prefix-caching"])
    config = engine_config_from_args(args)
    assert config.scheduler.policy.classes["batch"].max_prefill_tokens == 64
    assert config.scheduler.policy.tenant("gold").weight == 3
    assert config.scheduler.policy.step_time_target_ms == 80 and not config.scheduler.prefix_caching
    args = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--kv-transfer-port", "0",
                                      "--kv-lease-s", "4", "--kv-max-hold-s", "9.5"])
    config = engine_config_from_args(args)
    assert (config.kv_transfer_port, config.kv_lease_s, config.kv_max_hold_s) == (0, 4.0, 9.5)
    args = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), "--kv-max-hold-s", "0"])
    with pytest.raises(ConfigError, match="kv_max_hold_s: must be seconds in"):
        engine_config_from_args(args)


def test_an_invalid_policy_file_is_refused_naming_the_setting(tmp_path, tiny_llama_dir):
    policy = tmp_path / "policy.json"
    policy.write_text('{"classes": {"batch": {"min_share": 3}}}')
    result = serve("--model", str(tiny_llama_dir), "--policy", str(policy))
    assert result.returncode == 2 and "classes.batch.min_share" in result.stderr


@pytest.mark.parametrize("flag, value, message", [
    ("--token-budget", "2000000", "token_budget: must be <= 1048576"),
    ("--max-num-seqs", "100000", "max_num_seqs: must be <= 65536"),
    ("--seed", str(2**64), "seed: must be <= "),
])
def test_a_knob_beyond_the_registrys_bounds_exits_2_naming_it(tiny_llama_dir, flag, value, message):
    result = serve("--model", str(tiny_llama_dir), flag, value)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
