"""``cadenza up``: the same ServingPool YAML on one machine — replicas, gateway, restarts, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from cadenza.operator.local import plan
from cadenza.operator.validate import validate_pool
from server_process import free_port


def pool_yaml(path: Path, model_dir: Path, **spec) -> Path:
    body = {
        "apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool",
        "metadata": {"name": "tiny", "namespace": "default"},
        "spec": {"model": {"name": "tiny", "source": {"path": str(model_dir)}}, "replicas": 2,
                 "engine": {"tokenBudget": 64, "chunkSize": 16, "maxModelLen": 256}, **spec},
    }
    path.write_text(yaml.safe_dump(body))
    return path


def post(url: str, cls: str, timeout: float = 30.0) -> dict:
    body = json.dumps({"model": "tiny", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, method="POST",
                                 headers={"Content-Type": "application/json", "x-cadenza-class": cls})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (OSError, ValueError, KeyError):
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


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


def test_an_invalid_pool_file_is_refused_before_anything_starts(tmp_path, tiny_llama_dir):
    bad = pool_yaml(tmp_path / "bad.yaml", tiny_llama_dir, engine={"tokenBudget": 64, "chunkSize": 128})
    result = subprocess.run([sys.executable, "-m", "cadenza.node.cli", "up", str(bad), "--port", str(free_port())],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "spec.engine" in result.stderr and "chunkSize" in result.stderr


def test_two_replicas_and_the_gateway_serve_both_classes_and_a_killed_replica_comes_back(tmp_path, tiny_llama_dir):
    port, state_file = free_port(), tmp_path / "state.json"
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen([sys.executable, "-m", "cadenza.node.cli", "up",
                           str(pool_yaml(tmp_path / "pool.yaml", tiny_llama_dir)), "--port", str(port),
                           "--state-file", str(state_file)], stdout=log, stderr=subprocess.STDOUT)
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
    finally:
        up.send_signal(signal.SIGINT)
        try:
            assert up.wait(timeout=60) == 0, (tmp_path / "up.log").read_text()
        finally:
            if up.poll() is None:
                up.kill()
            log.close()
    pids = [r["pid"] for r in json.loads(state_file.read_text())["replicas"]]
    wait_for(lambda: not any(alive(pid) for pid in pids), 30, "replicas stopped")
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/health", timeout=2)
