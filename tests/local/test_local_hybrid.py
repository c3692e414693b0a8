"""``cadenza up`` with ``mode: auto``: the SLO controller retunes, dedicates a replica, and gives
it back, in place, with real processes and zero failed requests.

The model is a random Llama wide enough (2 layers, hidden 1,536) that a 256-token prefill chunk
costs about a dozen decode steps on one core. The ITL target is set from this machine: half of a
step holding a 256-token chunk (measured in-process first), so short interactive streams alone
stay far inside it, while long batch prompts chunked into the same steps breach it at 512 tokens
and still at 256. Retuning can only halve the chunk (bounds 256-512), which is not enough, so the
controller then dedicates a replica."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.request

import pytest

from local_pool import pool_yaml, stop_up, up_env
from server_process import free_port
from tiny_models import build_tiny_model
from waiting import wait_until

# Tiny windows so the ladder runs in a minute or two; the ITL target is set per machine (itl_target_ms).
# Rung 2 only: long batch prompts are what rung 3 would disaggregate (issue 31), so it is off here.
SPEC = {
    "mode": "auto",
    "engine": {"tokenBudget": 512, "chunkSize": 512, "maxModelLen": 1024},
    "dedicated": {"engine": {"chunkSize": 16}},
    "controller": {"fastWindowSeconds": 5, "windowSeconds": 10, "minSamples": 3, "cooldownSeconds": 0,
                   "dwellSeconds": 10, "staleSeconds": 30, "bounds": {"chunkSize": {"min": 256, "max": 512}},
                   "disaggregate": False},
}
BATCH_PROMPT = [5 + i % 300 for i in range(700)]  # token ids: 700 tokens, two chunks at 512, three at 256


def itl_target_ms(model) -> float:
    """A third of the time of a step that holds a 256-token chunk beside two decodes (one thread,
    median of three); skips where that is not well above a decode step, so no machine makes it
    flaky. (Half, on 2026-12-03: the pool's ITL p99 with chunks at their 256 bound hovered at
    135-250 ms against a 134 ms target, within it every other window, and the reshape, which
    needs 10 s over it, never came.)"""
    import statistics
    import time

    import torch

    from cadenza.node.frontend.llm import Engine
    from cadenza.node.runner.sampler import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine.from_model(model, token_budget=512, chunk_size=256, max_model_len=1024)
        for i in range(2):
            engine.add_request(f"d{i}", [5 + i, 6, 7], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))

        def timed_steps(n: int) -> list[float]:
            out = []
            for _ in range(n):
                started = time.perf_counter()
                engine.step()
                out.append(time.perf_counter() - started)
            return out

        timed_steps(3)  # warm up
        decode = statistics.median(timed_steps(10))
        engine.add_request("chunked", BATCH_PROMPT, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        chunked = statistics.median(timed_steps(3))  # 700 tokens: three steps with a chunk
    finally:
        torch.set_num_threads(threads)
    if chunked < 8 * decode:
        pytest.skip(f"a 256-token chunk step ({chunked * 1e3:.0f} ms) is not well above a decode step "
                    f"({decode * 1e3:.0f} ms) on this machine")
    return round(chunked * 1e3 / 3)


def stream(url: str, cls: str, max_tokens: int = 8) -> int:
    """One streamed completion; the number of content events (raises on any failure)."""
    prompt = BATCH_PROMPT if cls == "batch" else "Hello there"
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, method="POST",
                                 headers={"Content-Type": "application/json", "x-cadenza-class": cls})
    events = 0
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        for line in resp:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                assert b'"error"' not in line, line
                events += 1
    return events


def wait_for(predicate, timeout: float, what: str):
    return wait_until(predicate, timeout, what, interval=0.5, ignore=(OSError, ValueError, KeyError))


class Load:
    """Streams of the given classes in a loop until stopped; counts successes and failures."""

    def __init__(self, url: str, classes: tuple[str, ...]) -> None:
        self.url, self.stop = url, threading.Event()
        self.ok, self.failed = 0, []
        self.threads = [threading.Thread(target=self._run, args=(cls,), daemon=True) for cls in classes]

    def _run(self, cls: str) -> None:
        while not self.stop.is_set():
            try:
                stream(self.url, cls)
                self.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is recorded and asserted on
                self.failed.append(repr(exc))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)


@pytest.mark.slow
def test_long_batch_prompts_make_the_controller_retune_then_dedicate_then_merge_back_with_no_failed_request(
        tmp_path):
    model = build_tiny_model(tmp_path / "model", num_heads=24, num_kv_heads=4, head_dim=64, num_layers=2)
    slo = {"interactive": {"itlP99Ms": itl_target_ms(model)}, "batch": {"ttftP99Ms": 60000}}
    port, state_file = free_port(), tmp_path / "state.json"
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen([sys.executable, "-m", "cadenza.node.cli", "up",
                           str(pool_yaml(tmp_path / "pool.yaml", model, **SPEC, slo=slo)), "--port", str(port),
                           "--state-file", str(state_file)], stdout=log, stderr=subprocess.STDOUT,
                          env=up_env(tmp_path))
    url = f"http://127.0.0.1:{port}"

    def state():
        return json.loads(state_file.read_text())

    try:
        first = wait_for(state, 180, "the pool to be ready")
        pids = {r["name"]: r["pid"] for r in first["replicas"]}
        assert set(first["controller"]["roles"].values()) == {"colocated"}
        # Interactive alone is inside its SLO: the controller sees it (a known window) and holds, with
        # no reshape. (Not asserted: that the chunk stays at 512. On a shared CI machine a busy
        # neighbour test can push two short streams' ITL p99 past the target for a window, and the
        # retune it causes is the controller doing its job; holding within the SLO is decide()'s
        # unit test, test_within_slo_holds in tests/control/test_controller.py.)
        with Load(url, ("interactive", "interactive")) as calm:
            wait_for(lambda: state()["controller"]["lastDecision"]["reason"].startswith("interactive within"), 60,
                     "a known window of interactive traffic alone")
            assert set(state()["controller"]["roles"].values()) == {"colocated"}
        assert calm.ok > 0 and not calm.failed, calm.failed[:3]
        with Load(url, ("interactive", "interactive", "batch", "batch", "batch")) as load:
            retuned = wait_for(lambda: (s := state())["controller"]["knobs"]["chunk_size"] < 512 and s, 120,
                               "a retune (chunk size shrinks)")
            assert "ITL p99" in retuned["controller"]["lastRetuneDetail"]["reason"]
            assert retuned["controller"]["roles"] == first["controller"]["roles"]  # rung 1 first
            dedicated = wait_for(lambda: "interactive" in (s := state())["controller"]["roles"].values() and s, 180,
                                 "a replica dedicated to interactive")
            assert dedicated["controller"]["knobs"]["chunk_size"] == 256  # only once rung 1 sat at its bound
            roles = dedicated["controller"]["roles"]
            assert sorted(roles.values()) == ["colocated", "interactive"]  # batch keeps a replica
            # The interactive replica runs the interactive settings, applied live; batch does not reach it.
            inter = next(r for r in dedicated["replicas"] if roles[r["name"]] == "interactive")
            before_batch = _class_admitted(inter["url"], "batch")
            for _ in range(2):
                stream(url, "batch", max_tokens=2)
            assert _class_admitted(inter["url"], "batch") == before_batch
        assert load.ok > 0 and not load.failed, load.failed[:3]
        merged = wait_for(lambda: set((s := state())["controller"]["roles"].values()) == {"colocated"} and s, 120,
                          "the replica to be given back once the load stopped")
        decisions = [d["action"] for d in merged["controller"]["decisions"]]
        assert "retune" in decisions and "reshape" in decisions
        # In place: no replica was restarted or replaced.
        assert {r["name"]: r["pid"] for r in merged["replicas"]} == pids
        assert all(r["restarts"] == 0 for r in merged["replicas"])
    except AssertionError:  # what the controller saw and did, for the report
        lines = (tmp_path / "up.log").read_text().splitlines(keepends=True)
        print(f"ITL target {slo['interactive']['itlP99Ms']} ms\n" + "".join(l for l in lines if "controller" in l)[-6000:])
        raise
    finally:
        stop_up(up, log, tmp_path / "up.log")
    text = (tmp_path / "up.log").read_text()
    assert "controller tiny: retune" in text and "controller tiny: reshape" in text


def _class_admitted(replica_url: str, cls: str) -> int:
    with urllib.request.urlopen(f"{replica_url}/ready", timeout=5) as resp:
        return json.loads(resp.read())["classes"][cls]["prefill_tokens"]
