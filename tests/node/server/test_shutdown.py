"""SIGTERM drains: the server stops listening at once and lets streams in flight finish."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from server_process import free_port
from waiting import wait_until


def test_sigterm_stops_new_connections_and_finishes_the_stream_in_flight(tmp_path, tiny_llama_dir):
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "cadenza.node.cli", "serve", "--port", str(port), "--model",
                             str(tiny_llama_dir), "--served-model-name", "tiny", "--shutdown-timeout-s", "120"],
                            stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: urllib.request.urlopen(f"{url}/ready", timeout=2).status == 200, 120, "ready",
                   interval=0.2, ignore=(OSError,))
        body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 40, "temperature": 0, "stream": True,
                           "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body, headers={"Content-Type": "application/json"})
        events, done, refused, usage = 0, False, None, None
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: "):
                    events += 1
                    usage = json.loads(line[6:]).get("usage") or usage
                    if events == 3:
                        proc.send_signal(signal.SIGTERM)
                        deadline = time.monotonic() + 10
                        while refused is None and time.monotonic() < deadline:
                            try:
                                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                                time.sleep(0.05)  # not yet closed: the signal is being handled
                            except OSError:
                                refused = True
        assert refused, "the server kept accepting connections after SIGTERM"
        assert done and usage["completion_tokens"] == 40  # the stream in flight finished whole
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
