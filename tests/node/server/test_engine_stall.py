"""A frozen engine core is a dead one (issue 28, point 6): ``cadenza serve`` whose core process is
stopped (SIGSTOP) turns ``/health`` 503, fails the requests in flight and the ones that arrive,
kills the core and exits 1 for its supervisor to restart it, all within the stall timeout — while
an idle or busy core that keeps reporting is left alone. The in-thread core (``--engine-process
off``) cannot be stopped apart from its server, but a step that never returns is caught the same
way (``test_engine_death.py``)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_process import alive, cadenza_server_process, child_pids, http_status, post_json
from waiting import wait_until

pytestmark = pytest.mark.slow  # a real server and its core process

STALL_S = 3.0


def test_a_stopped_core_process_fails_health_and_requests_and_the_server_exits_for_a_restart(tmp_path, tiny_llama_dir):
    log = tmp_path / "serve.log"
    args = ["--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--max-model-len", "1024",
            "--num-kv-blocks", "128", "--engine-stall-timeout-s", str(STALL_S)]
    with cadenza_server_process(args, log) as (url, server):
        root = url.removesuffix("/v1")
        [core] = child_pids(server.pid)
        try:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
            time.sleep(STALL_S + 1.5)  # idle past the timeout: an idle core reports every second
            assert http_status(f"{root}/health") == 200 and post_json(f"{url}/completions", body).status == 200

            stream = post_json(f"{url}/completions", {**body, "max_tokens": 1000, "ignore_eos": True, "stream": True})
            assert stream.readline().startswith(b"data: ")  # it streams: the core is stepping
            os.kill(core, signal.SIGSTOP)
            stopped = time.monotonic()
            with ThreadPoolExecutor(1) as pool:  # a request that arrives at the frozen core
                waiting = pool.submit(post_json, f"{url}/completions", body)
                events = [line for line in stream.read().splitlines() if line.startswith(b"data: ")]
                ended = time.monotonic() - stopped
                with pytest.raises(urllib.error.HTTPError) as refused:
                    waiting.result()
            assert refused.value.code == 503 and "sent nothing" in json.loads(refused.value.read())["error"]["message"]
            last = json.loads(events[-1][len(b"data: "):])  # the stream ends in an error event, no [DONE]
            assert "sent nothing" in last["error"]["message"]
            assert STALL_S - 0.5 < ended < STALL_S + 15
            assert server.wait(timeout=30) == 1  # exits for its supervisor to restart it
            wait_until(lambda: not alive(core), timeout=10, what="the stopped core to be killed")
        finally:
            if alive(core):
                os.kill(core, signal.SIGKILL)
    text = log.read_text()
    assert "sent nothing for" in text and "exiting so that this replica is restarted" in text
