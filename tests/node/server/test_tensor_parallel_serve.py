"""``cadenza serve --tensor-parallel-size 2`` over HTTP (issue 32): the same greedy completions as
one rank, and a worker killed mid-stream ends the replica cleanly — the stream ends in an error
event, ``/health`` turns 503 and the server exits 1 for its supervisor to restart it, with no
process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from server_process import (alive, cadenza_server, cadenza_server_process, child_pids, free_port, http_status,
                            post_json)
from waiting import wait_until

pytestmark = pytest.mark.slow  # real servers, their core and worker processes

PROMPTS = [[5, 17, 99, 3, 250], list(range(10, 90)), [300] * 3, list(range(3, 200, 7))]


def completions(url: str) -> list[str]:
    out = []
    for prompt in PROMPTS:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        with post_json(f"{url}/completions", body) as resp:
            out.append(json.loads(resp.read())["choices"][0]["text"])
    return out


def test_greedy_completions_at_size_2_equal_size_1_over_http(tmp_path, tiny_llama_dir):
    args = ["--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--max-model-len", "320",
            "--token-budget", "32", "--chunk-size", "16"]
    with cadenza_server(args, tmp_path / "tp1.log") as url:
        expected = completions(url)
    with cadenza_server([*args, "--tensor-parallel-size", "2", "--threads", "2"], tmp_path / "tp2.log") as url:
        assert completions(url) == expected
    assert "tensor-parallel rank 1 of 2" in (tmp_path / "tp2.log").read_text()


def test_a_worker_killed_mid_stream_ends_the_replica_cleanly(tmp_path, tiny_llama_dir):
    log = tmp_path / "serve.log"
    args = ["--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--max-model-len", "1024",
            "--tensor-parallel-size", "2", "--threads", "2"]
    with cadenza_server_process(args, log) as (url, server):
        root = url.removesuffix("/v1")
        [core] = child_pids(server.pid)
        [worker] = child_pids(core)
        try:
            stream = post_json(f"{url}/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 900,
                                                 "ignore_eos": True, "stream": True})
            assert stream.readline().startswith(b"data: ")  # it streams: the ranks are stepping
            os.kill(worker, signal.SIGKILL)
            killed = time.monotonic()
            events = [line for line in stream.read().splitlines() if line.startswith(b"data: ")]
            assert "error" in json.loads(events[-1][len(b"data: "):])  # an error event ends it, no [DONE]
            wait_until(lambda: http_status(f"{root}/health") != 200, timeout=10, what="/health to fail")
            assert server.wait(timeout=30) == 1  # exits for its supervisor to restart it
            assert time.monotonic() - killed < 30
            wait_until(lambda: not alive(core), timeout=10, what="the core process to exit")
        finally:
            for pid in (core, worker):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert "tensor-parallel worker rank 1" in text and "died (signal 9)" in text


def test_a_size_the_model_cannot_split_is_refused_at_start_with_the_reason(tiny_llama_dir):
    proc = subprocess.run([sys.executable, "-m", "cadenza.node.cli", "serve", "--model", str(tiny_llama_dir),
                           "--port", str(free_port()), "--tensor-parallel-size", "3"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "tensor_parallel_size: 3 does not divide" in proc.stderr and "4 attention heads" in proc.stderr
