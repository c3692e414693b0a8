"""``cadenza up`` with ``mode: auto`` carrying out the third rung in place (issue 31): retune, move a
replica into the prefill role, move it back — with real replicas and a real gateway under
interactive and long batch traffic, zero failed requests and no replica restarted.

The decisions are scripted (:mod:`scripted_up`): what is checked is the actuation and the gateway
(the drain, the prefill settings, the routing file's prefill role, long prompts prefilled on the
moved replica and their KV pulled by the other), not what makes the controller decide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from local_pool import pool_yaml, stop_up, up_env
from server_process import free_port
from waiting import wait_until

SUPPORT = Path(__file__).resolve().parents[1] / "support"
LONG_PROMPT = [(7 * i) % 250 + 3 for i in range(150)]  # token ids: above the pinned threshold
SPEC = {"mode": "auto", "slo": {"interactive": {"itlP99Ms": 1000}},
        "disaggregated": {"minPromptTokens": 64},
        "controller": {"fastWindowSeconds": 5, "windowSeconds": 10, "minSamples": 1, "drainTimeoutSeconds": 60,
                       "bounds": {"chunkSize": {"min": 8, "max": 64}}}}


def stream(url: str, cls: str) -> None:
    """One streamed completion of ``cls`` (batch: the long prompt); raises on any failure."""
    prompt = LONG_PROMPT if cls == "batch" else "Hello there"
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, method="POST",
                                 headers={"Content-Type": "application/json", "x-cadenza-class": cls})
    events = 0
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        for line in resp:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                assert b'"error"' not in line, line
                events += 1
    assert events > 0


class Load:
    """Streams of each class in a loop until stopped; successes per class and every failure."""

    def __init__(self, url: str, classes: tuple[str, ...]) -> None:
        self.url, self.stop = url, threading.Event()
        self.ok = {cls: 0 for cls in classes}
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(cls,), daemon=True) for cls in classes]

    def _run(self, cls: str) -> None:
        while not self.stop.is_set():
            try:
                stream(self.url, cls)
                self.ok[cls] += 1
            except Exception as exc:  # noqa: BLE001 - every failure is recorded and asserted on
                self.failed.append(f"{cls}: {exc!r}")

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def metric(base: str, name: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {")


def wait_for(predicate, timeout: float, what: str):
    return wait_until(predicate, timeout, what, interval=0.2, ignore=(OSError, ValueError, KeyError, TypeError))


@pytest.mark.slow
def test_retune_then_a_move_into_prefill_and_back_in_place_with_no_failed_request(tmp_path, tiny_llama_dir):
    port, state_file, decisions = free_port(), tmp_path / "state.json", tmp_path / "decisions.json"
    decisions.write_text("[]")
    env = {**up_env(tmp_path), "CADENZA_TEST_DECISIONS": str(decisions),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))}
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen([sys.executable, "-c", "import scripted_up; scripted_up.main()", "up",
                           str(pool_yaml(tmp_path / "pool.yaml", tiny_llama_dir, **SPEC)), "--port", str(port),
                           "--state-file", str(state_file)], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    steps: list[dict] = []

    def decide(step: dict) -> None:
        steps.append(step)
        decisions.write_text(json.dumps(steps))

    def state() -> dict:
        return json.loads(state_file.read_text())

    try:
        first = wait_for(lambda: (s := state())["controller"]["roles"] and s, 180, "the pool to be ready")
        pids = {r["name"]: r["pid"] for r in first["replicas"]}
        urls = {r["name"]: r["url"] for r in first["replicas"]}
        with Load(url, ("interactive", "interactive", "batch")) as load:
            wait_for(lambda: all(load.ok.values()) or load.failed, 60, "both classes served")
            assert not load.failed, load.failed[:3]
            decide({"action": "retune", "knobs": {"chunk_size": 8}})
            retuned = wait_for(lambda: (s := state())["controller"]["knobs"]["chunk_size"] == 8 and s, 30, "a retune")
            assert retuned["shape"] == {"colocated": 2, "interactive": 0, "prefill": 0}
            assert metric(url, "cadenza_gateway_disagg_requests_total") == 0  # no prefill replica yet

            decide({"action": "reshape", "move": "disaggregate"})
            moved = wait_for(lambda: "prefill" in (s := state())["controller"]["roles"].values() and s, 60,
                             "a replica moved into the prefill role")
            assert moved["shape"] == {"colocated": 1, "interactive": 0, "prefill": 1}
            prefill = next(n for n, role in moved["controller"]["roles"].items() if role == "prefill")
            decode = next(n for n in urls if n != prefill)
            assert moved["controller"]["lastShiftDetail"]["to"] == moved["shape"]
            routes = json.loads(next(Path(tmp_path).glob("cadenza-up-tiny-*/gateway.json")).read_text())["roles"]
            assert routes == {"interactive": [urls[decode]], "batch": [urls[decode]], "prefill": [urls[prefill]]}
            # Long prompts now go through the prefill replica; the other pulls their KV and decodes.
            wait_for(lambda: metric(urls[prefill], "cadenza_kv_transfer_published_total") >= 3, 30,
                     "long prompts prefilled on the prefill replica")
            assert metric(url, "cadenza_gateway_disagg_requests_total") >= 3
            assert metric(urls[decode], "cadenza_kv_transfer_loads_total") >= 3
            config = json.loads(urllib.request.urlopen(urllib.request.Request(
                f"{urls[prefill]}/admin/config", headers={"Authorization": "Bearer " + admin_token(tmp_path)}),
                timeout=5).read())
            assert config["chunk_size"] == 64 and config["step_time_target_ms"] is None  # the prefill settings

            decide({"action": "reshape", "move": "aggregate"})
            back = wait_for(lambda: set((s := state())["controller"]["roles"].values()) == {"colocated"} and s, 30,
                            "the replica back to colocated")
            assert back["shape"] == {"colocated": 2, "interactive": 0, "prefill": 0}
            served = dict(load.ok)
            wait_for(lambda: load.ok["batch"] >= served["batch"] + 2, 30, "batch served after the move back")
            moved_prompts, served = metric(url, "cadenza_gateway_disagg_requests_total"), dict(load.ok)
            wait_for(lambda: load.ok["batch"] >= served["batch"] + 2, 30, "more batch served")
            assert metric(url, "cadenza_gateway_disagg_requests_total") == moved_prompts  # no prefill route now
        assert load.failed == [], load.failed[:3]
        assert all(load.ok.values())
        final = state()
        assert {r["name"]: r["pid"] for r in final["replicas"]} == pids  # in place: nothing restarted
        assert all(r["restarts"] == 0 for r in final["replicas"])
    finally:
        stop_up(up, log, tmp_path / "up.log")
    text = (tmp_path / "up.log").read_text()
    assert "drained; prefilling the long prompts" in text and "back to colocated (aggregate)" in text


def admin_token(tmp_path: Path) -> str:
    """The per-run token ``cadenza up`` wrote in its run folder."""
    return next(tmp_path.glob("cadenza-up-tiny-*/admin-token")).read_text().strip()
