"""``cadenza up``: the same ServingPool YAML on one machine — replicas, gateway, restarts, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from cadenza.local.up import choose_admin_token, plan, port_problem
from cadenza.pool.spec import PoolSpecError
from cadenza.pool.validate import validate_pool
from local_pool import pool_yaml, stop_up, up_env
from server_process import free_port
from waiting import wait_until


def post(url: str, cls: str, timeout: float = 30.0) -> dict:
    body = json.dumps({"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, method="POST",
                                 headers={"Content-Type": "application/json", "x-cadenza-class": cls})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_for(predicate, timeout: float, what: str):
    return wait_until(predicate, timeout, what, interval=0.2, ignore=(OSError, ValueError, KeyError))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_the_plan_follows_the_pool_mode(tmp_path, tiny_llama_dir):
    pool = validate_pool(yaml.safe_load(pool_yaml(tmp_path / "p.yaml", tiny_llama_dir).read_text()))
    replicas, gateway = plan(pool, tmp_path, "127.0.0.1", 8123)
    config = json.loads((tmp_path / "gateway.json").read_text())
    assert [r.role for r in replicas] == ["colocated", "colocated"]
    assert config["roles"]["interactive"] == config["roles"]["batch"] == [r.url for r in replicas]
    assert "--chunk-size" in replicas[0].cmd and gateway.cmd[-4:] == ["--host", "127.0.0.1", "--port", "8123"]
    pool["spec"]["mode"] = "dedicated"
    replicas, _ = plan(pool, tmp_path, "127.0.0.1", 8123)
    config = json.loads((tmp_path / "gateway.json").read_text())
    assert [r.role for r in replicas] == ["interactive", "batch"]
    assert config["roles"] == {"interactive": [replicas[0].url], "batch": [replicas[1].url]}
    pool["spec"].update(mode="disaggregated", replicas=3, disaggregated={"prefillReplicas": 1})
    replicas, gateway = plan(pool, tmp_path, "127.0.0.1", 8123, admin_token="t0ken")
    config = json.loads((tmp_path / "gateway.json").read_text())
    assert [r.role for r in replicas] == ["prefill", "decode", "decode"]
    decode = [r.url for r in replicas[1:]]
    assert config["roles"] == {"interactive": decode, "batch": decode, "prefill": [replicas[0].url]}
    assert all(r.cmd[r.cmd.index("--kv-transfer-port") + 1] == "0" for r in replicas)  # announced per request
    assert gateway.env["CADENZA_ADMIN_TOKEN"] == replicas[0].env["CADENZA_ADMIN_TOKEN"] == "t0ken"
    assert gateway.cmd[gateway.cmd.index("--disagg-min-prompt-tokens") + 1] == "auto"
    # auto (issue 31): every replica may become a prefill replica in place; the prefill route starts empty
    pool["spec"].update(mode="auto", disaggregated={"minPromptTokens": 64})
    replicas, gateway = plan(pool, tmp_path, "127.0.0.1", 8123, admin_token="t0ken")
    config = json.loads((tmp_path / "gateway.json").read_text())
    assert [r.role for r in replicas] == ["auto"] * 3
    assert config["roles"] == {"interactive": [r.url for r in replicas], "batch": [r.url for r in replicas]}
    assert all(r.cmd[r.cmd.index("--kv-transfer-port") + 1] == "0" for r in replicas)
    assert gateway.env["CADENZA_ADMIN_TOKEN"] == "t0ken"
    assert gateway.cmd[gateway.cmd.index("--disagg-min-prompt-tokens") + 1] == "64"
    pool["spec"]["controller"] = {"disaggregate": False}
    replicas, gateway = plan(pool, tmp_path, "127.0.0.1", 8123, admin_token="t0ken")
    assert "--kv-transfer-port" not in replicas[0].cmd and "--disagg-min-prompt-tokens" not in gateway.cmd
    assert gateway.env["CADENZA_ADMIN_TOKEN"] == ""


@pytest.mark.parametrize("mode", ["colocated", "dedicated", "auto", "disaggregated"])
def test_the_users_admin_token_is_the_pools_in_every_mode(tmp_path, mode):
    assert choose_admin_token(mode, {"CADENZA_ADMIN_TOKEN": " mine\n"}) == ("mine", "env")
    (tmp_path / "token").write_text("from-a-secret\n")
    assert choose_admin_token(mode, {"CADENZA_ADMIN_TOKEN_FILE": str(tmp_path / "token")}) == ("from-a-secret", "file")
    own = choose_admin_token(mode, {})
    if mode in ("auto", "disaggregated"):  # they need one: a per-run token, shown where to find it
        assert own.source == "run" and len(own.value) == 32
        assert str(tmp_path / "admin-token") in own.describe(tmp_path)
    else:
        assert own == (None, "none") and "off" in own.describe(tmp_path)
    for bad in (tmp_path / "missing", tmp_path / "empty"):  # a typo must not silently mean another token
        (tmp_path / "empty").write_text("\n")
        with pytest.raises(PoolSpecError, match="CADENZA_ADMIN_TOKEN_FILE"):
            choose_admin_token(mode, {"CADENZA_ADMIN_TOKEN_FILE": str(bad)})


def test_the_replicas_get_the_pools_token_or_none_never_one_inherited_behind_ups_back(tmp_path, tiny_llama_dir,
                                                                                    monkeypatch):
    monkeypatch.setenv("CADENZA_ADMIN_TOKEN_FILE", str(tmp_path / "stale"))
    pool = validate_pool(yaml.safe_load(pool_yaml(tmp_path / "p.yaml", tiny_llama_dir).read_text()))
    replicas, _ = plan(pool, tmp_path, "127.0.0.1", 8123, admin_token="mine")
    assert replicas[0].env["CADENZA_ADMIN_TOKEN"] == "mine" and replicas[0].env["CADENZA_ADMIN_TOKEN_FILE"] == ""
    replicas, _ = plan(pool, tmp_path, "127.0.0.1", 8123)
    assert replicas[0].env["CADENZA_ADMIN_TOKEN"] == replicas[0].env["CADENZA_ADMIN_TOKEN_FILE"] == ""  # unset


def test_replicas_share_the_cores_instead_of_oversubscribing(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    pool = validate_pool(yaml.safe_load(pool_yaml(tmp_path / "p.yaml", tiny_llama_dir, replicas=4).read_text()))
    assert {r.env["OMP_NUM_THREADS"] for r in plan(pool, tmp_path, "127.0.0.1", 8123)[0]} == {"2"}
    pool["spec"]["resources"] = {"limits": {"cpu": "500m"}}  # the pool's own cap
    assert {r.env["OMP_NUM_THREADS"] for r in plan(pool, tmp_path, "127.0.0.1", 8123)[0]} == {"1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's setting wins
    assert all("OMP_NUM_THREADS" not in r.env for r in plan(pool, tmp_path, "127.0.0.1", 8123)[0])


def test_a_pool_of_zero_replicas_is_refused_locally(tmp_path, tiny_llama_dir):
    pool = validate_pool(yaml.safe_load(pool_yaml(tmp_path / "p.yaml", tiny_llama_dir, replicas=0).read_text()))
    with pytest.raises(PoolSpecError, match="spec.replicas is 0"):
        plan(pool, tmp_path, "127.0.0.1", 8123)


def test_a_tensor_parallel_size_the_local_models_heads_do_not_split_is_refused_before_anything_starts(
        tmp_path, tiny_llama_dir):
    engine = {"tokenBudget": 64, "chunkSize": 16, "maxModelLen": 256}
    pool = validate_pool(yaml.safe_load(pool_yaml(tmp_path / "p.yaml", tiny_llama_dir,
                                                  engine={**engine, "tensorParallelSize": 3}).read_text()))
    with pytest.raises(PoolSpecError, match=r"3 does not divide tiny \(.*config.json\)'s 4 attention heads"):
        plan(pool, tmp_path, "127.0.0.1", 8123)
    pool["spec"]["engine"]["tensorParallelSize"] = 2  # 4 heads, 2 KV heads: every rank on this machine's CPUs
    replicas, _ = plan(pool, tmp_path, "127.0.0.1", 8123)
    assert replicas[0].cmd[replicas[0].cmd.index("--tensor-parallel-size") + 1] == "2"


def test_a_busy_port_is_refused_before_any_replica_starts(tmp_path, tiny_llama_dir):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert "in use" in port_problem("127.0.0.1", port)
        result = subprocess.run([sys.executable, "-m", "cadenza.node.cli", "up",
                                 str(pool_yaml(tmp_path / "p.yaml", tiny_llama_dir)), "--port", str(port)],
                                capture_output=True, text=True, timeout=120, env=up_env(tmp_path))
    assert result.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("cadenza-up-*"))  # refused before the run folder: no replica was started
    assert port_problem("127.0.0.1", free_port()) is None


@pytest.mark.parametrize(("content", "extra", "message"), [
    (b"apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", [], "holds no ServingPool"),
    (b"apiVersion: serving.cadenza.dev/v1alpha1\nkind: ServingPol\nmetadata: {name: x}\n", [],
     "found: serving.cadenza.dev/v1alpha1/ServingPol"),
    (b"\xff\xfe garbage", [], "not UTF-8"),
    (None, ["--pool", "nothere"], "no ServingPool named 'nothere' (it has: tiny)"),
])
def test_a_file_without_the_pool_asked_for_says_what_it_holds(tmp_path, tiny_llama_dir, content, extra, message):
    path = pool_yaml(tmp_path / "p.yaml", tiny_llama_dir)
    if content is not None:
        path.write_bytes(content)
    result = subprocess.run([sys.executable, "-m", "cadenza.node.cli", "up", str(path), *extra,
                             "--port", str(free_port())], capture_output=True, text=True, timeout=60, env=up_env(tmp_path))
    assert result.returncode == 2 and message in result.stderr and str(path) in result.stderr, result.stderr


@pytest.mark.parametrize(("extra", "message"), [
    (["--port", "0"], "must be a port number from 1 to 65535"),
    (["--port", "99999"], "must be a port number from 1 to 65535"),
    (["--state-file", "/nonexistent/dir/state.json"], "--state-file /nonexistent/dir/state.json"),
    (["--state-file", "/tmp"], "--state-file /tmp: must be a file"),
])
def test_bad_options_are_refused_before_anything_starts(tmp_path, tiny_llama_dir, extra, message):
    result = subprocess.run([sys.executable, "-m", "cadenza.node.cli", "up",
                             str(pool_yaml(tmp_path / "p.yaml", tiny_llama_dir)), *extra],
                            capture_output=True, text=True, timeout=60, env=up_env(tmp_path))
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.glob("cadenza-up-*"))  # nothing was started


def test_an_ipv6_gateway_address_is_a_valid_url(tmp_path, tiny_llama_dir):
    pool = validate_pool(yaml.safe_load(pool_yaml(tmp_path / "p.yaml", tiny_llama_dir).read_text()))
    assert plan(pool, tmp_path, "::1", 8123)[1].url == "http://[::1]:8123"


def test_an_invalid_pool_file_is_refused_before_anything_starts(tmp_path, tiny_llama_dir):
    bad = pool_yaml(tmp_path / "bad.yaml", tiny_llama_dir, engine={"tokenBudget": 64, "chunkSize": 128})
    result = subprocess.run([sys.executable, "-m", "cadenza.node.cli", "up", str(bad), "--port", str(free_port())],
                            capture_output=True, text=True, timeout=60, env=up_env(tmp_path))
    assert result.returncode == 2 and "spec.engine" in result.stderr and "chunkSize" in result.stderr


# Loaded by every process of the pool (PYTHONPATH): in a replica's engine core process, the first
# step after the trigger file appears raises what no handler catches, so the core dies while the
# replica's server process lives on.
CRASH_ONCE = """
import os, sys
trigger = os.environ.get("CADENZA_TEST_ENGINE_CRASH_FILE")
if trigger and "--fd" in sys.argv:
    from cadenza.node.engine.engine_core import EngineCore as Engine

    class SimulatedEngineCrash(BaseException):
        pass

    step = Engine.step

    def crashing_step(self):
        try:
            os.unlink(trigger)  # one replica wins the trigger; its restart finds none
        except FileNotFoundError:
            return step(self)
        raise SimulatedEngineCrash("simulated bug in the engine loop")

    Engine.step = crashing_step
"""


@pytest.mark.slow
def test_two_replicas_serve_both_classes_and_a_killed_replica_or_a_dead_engine_comes_back(tmp_path, tiny_llama_dir):
    port, state_file = free_port(), tmp_path / "state.json"
    inject, trigger = tmp_path / "inject", tmp_path / "crash-engine"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(CRASH_ONCE)
    env = {**up_env(tmp_path), "PYTHONPATH": str(inject), "CADENZA_TEST_ENGINE_CRASH_FILE": str(trigger)}
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen([sys.executable, "-m", "cadenza.node.cli", "up",
                           str(pool_yaml(tmp_path / "pool.yaml", tiny_llama_dir)), "--port", str(port),
                           "--state-file", str(state_file)], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        state = wait_for(lambda: json.loads(state_file.read_text()), 180, "the pool to be ready")
        assert len(state["replicas"]) == 2
        for cls in ("interactive", "batch", "background"):
            assert post(url, cls)["usage"]["completion_tokens"] == 4

        victim = state["replicas"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        for i in range(6):  # requests keep succeeding through the other replica
            assert post(url, ("interactive", "batch")[i % 2])["choices"]
        restarted = wait_for(lambda: (s := json.loads(state_file.read_text()))["replicas"][0]["restarts"] == 1 and s,
                             60, "the killed replica to be restarted")
        new_pid = restarted["replicas"][0]["pid"]
        assert new_pid != victim["pid"]
        wait_for(lambda: urllib.request.urlopen(f"{victim['url']}/ready", timeout=2).status == 200, 120,
                 "the restarted replica to be ready")
        assert post(url, "interactive")["choices"]

        # An engine that dies inside a live process: the replica exits, and is restarted.
        before = {r["name"]: (r["pid"], r["restarts"]) for r in json.loads(state_file.read_text())["replicas"]}
        trigger.touch()
        for i in range(6):  # the gateway retries the failed request on the other replica
            assert post(url, ("interactive", "batch")[i % 2])["choices"]
        assert not trigger.exists()
        crashed = wait_for(lambda: [r for r in json.loads(state_file.read_text())["replicas"]
                                    if r["restarts"] > before[r["name"]][1]], 60, "the dead engine's replica to restart")
        assert len(crashed) == 1 and crashed[0]["pid"] != before[crashed[0]["name"]][0]
        wait_for(lambda: urllib.request.urlopen(f"{crashed[0]['url']}/ready", timeout=2).status == 200, 120,
                 "the replica with a new engine to be ready")
        assert post(url, "batch")["choices"]
        assert "engine died" in Path(crashed[0]["log"]).read_text()
        pids = [r["pid"] for r in json.loads(state_file.read_text())["replicas"]]
    finally:
        stop_up(up, log, tmp_path / "up.log")
    assert not state_file.exists()  # removed with the pool: its pids are gone
    wait_for(lambda: not any(alive(pid) for pid in pids), 30, "replicas stopped")
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/health", timeout=2)


@pytest.mark.slow
def test_no_child_outlives_a_killed_supervisor(tmp_path, tiny_llama_dir):
    """SIGKILL (or a closed terminal's SIGHUP) must not leave replicas holding ports and memory."""
    port, state_file = free_port(), tmp_path / "state.json"
    with open(tmp_path / "up.log", "w") as log:
        up = subprocess.Popen([sys.executable, "-m", "cadenza.node.cli", "up",
                               str(pool_yaml(tmp_path / "pool.yaml", tiny_llama_dir, replicas=1)),
                               "--port", str(port), "--state-file", str(state_file)], stdout=log, stderr=subprocess.STDOUT, env=up_env(tmp_path))
    try:
        state = wait_for(lambda: json.loads(state_file.read_text()), 180, "the pool to be ready")
    finally:
        up.kill()
        up.wait()
    pids = [state["gateway"]["pid"], *(r["pid"] for r in state["replicas"])]
    wait_for(lambda: not any(alive(pid) for pid in pids), 30, "children stopped with their supervisor")


@pytest.mark.slow
def test_a_disaggregated_pool_prefills_long_prompts_elsewhere_and_answers_as_one_replica_would(tmp_path,
                                                                                            tiny_llama_dir):
    port, state_file, token = free_port(), tmp_path / "state.json", "users-own-token"
    spec = {"mode": "disaggregated", "disaggregated": {"prefillReplicas": 1, "minPromptTokens": 32}}
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen([sys.executable, "-m", "cadenza.node.cli", "up",
                           str(pool_yaml(tmp_path / "pool.yaml", tiny_llama_dir, **spec)), "--port", str(port),
                           "--state-file", str(state_file)], stdout=log, stderr=subprocess.STDOUT,
                          env={**up_env(tmp_path), "CADENZA_ADMIN_TOKEN": token})
    url = f"http://127.0.0.1:{port}"

    def complete(base: str, prompt: list[int]) -> dict:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    def metric(base: str, name: str) -> float:
        text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {")

    try:
        state = wait_for(lambda: json.loads(state_file.read_text()), 180, "the pool to be ready")
        roles = {r["role"]: r["url"] for r in state["replicas"]}
        assert set(roles) == {"prefill", "decode"}
        long_prompt, short_prompt = [(7 * i) % 250 + 3 for i in range(150)], [5, 6, 7]
        moved = complete(url, long_prompt)
        assert metric(url, "cadenza_gateway_disagg_requests_total") == 1  # prefilled on the prefill replica
        assert metric(roles["decode"], "cadenza_kv_transfer_loads_total") == 1
        assert metric(roles["decode"], "cadenza_kv_transfer_loaded_tokens_total") == 149  # the handshake passed
        assert metric(roles["prefill"], "cadenza_kv_transfer_published_total") == 1
        # the prefill replica serving the prompt whole, as a colocated replica would, gives the same tokens
        # (not the decode replica: its prefix cache now holds the KV it pulled)
        assert moved["choices"][0]["text"] == complete(roles["prefill"], long_prompt)["choices"][0]["text"]
        assert moved["usage"] == {"prompt_tokens": 150, "completion_tokens": 8, "total_tokens": 158}
        complete(url, short_prompt)  # below the pinned threshold: straight to the decode replica
        assert metric(url, "cadenza_gateway_disagg_requests_total") == 1
        assert metric(roles["decode"], "cadenza_kv_transfer_loads_total") == 1
        check_the_pools_admin_api_and_the_gateways_view_of_it(url, state, token, tmp_path / "up.log")
    finally:
        stop_up(up, log, tmp_path / "up.log")


def check_the_pools_admin_api_and_the_gateways_view_of_it(url: str, state: dict, token: str, log: Path) -> None:
    """Under `cadenza up` (a disaggregated pool, whose token `up` used to replace with a hidden one):
    the log says where each replica's admin API is, and the user's token opens it; the gateway names
    no address, counts the prefill replica as up, and gives bench the pool's counters summed."""
    import asyncio

    import aiohttp

    from cadenza.loadgen.server_samples import SAMPLE_KEYS, ServerSampler

    def get(address: str, auth: str | None = None) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {auth}"} if auth else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(address, headers=headers), timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    async def sample() -> ServerSampler:
        sampler = ServerSampler(f"{url}/v1")
        async with aiohttp.ClientSession() as session:
            assert await sampler.poll(session, 0.0)
        return sampler

    text = log.read_text()
    for replica in state["replicas"]:
        line = next(ln for ln in text.splitlines() if f"replica {replica['name']} " in ln)
        assert f"{replica['url']}/admin/config on, with your token (CADENZA_ADMIN_TOKEN)" in line
        assert get(f"{replica['url']}/admin/config", token)[0] == 200
        assert get(f"{replica['url']}/admin/config", "a-guess")[0] == 401

    status, body = get(f"{url}/admin/config", token)
    assert status == 404 and "/admin/config on its own address" in body["error"]["message"]
    assert not any(r["url"].rsplit(":", 1)[1] in body["error"]["message"] for r in state["replicas"])

    status, ready = get(f"{url}/ready")
    assert status == 200 and ready["replicas"] == ready["up"] == {"interactive": 1, "batch": 1, "prefill": 1}

    sampler = asyncio.run(sample())  # what `cadenza bench` samples through the gateway
    assert sampler.url == f"{url}/gateway/stats" and sampler.note is None
    pool_blocks = sum(get(f"{r['url']}/ready")[1]["kv_blocks_total"] for r in state["replicas"])
    assert set(SAMPLE_KEYS) <= set(sampler.samples[0]) and sampler.samples[0]["kv_blocks_total"] == pool_blocks

