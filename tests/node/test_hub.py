"""Models from the Hub (``hf://org/name@rev``) against a local Hub serving a tiny generated model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from cadenza.node import hub
from fake_hub import FakeHub


@pytest.fixture
def hub_model(tiny_llama_dir, tmp_path):
    folder = tmp_path / "repo"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "pytorch_model.bin").write_bytes(b"legacy weights cadenza never reads")
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(b"another copy")
    with FakeHub(folder, missing=("org/nope",)) as fake:
        yield fake


def cadenza(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cadenza.node.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", **env})


def test_a_hub_model_is_downloaded_once_with_only_its_serving_files_then_found_offline(hub_model, tmp_path):
    env = {"HF_ENDPOINT": hub_model.url, "HF_HOME": str(tmp_path / "hf")}
    done = cadenza("fetch-model", "hf://org/tiny@main", env=env)
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots"
    [snapshot] = folder.iterdir()
    assert done.stdout.strip().endswith(str(snapshot.relative_to(tmp_path)))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in snapshot.iterdir()}
    assert not (snapshot / "pytorch_model.bin").exists() and not (snapshot / "onnx").exists()
    assert json.loads((snapshot / "config.json").read_text())["model_type"] == "llama"
    # an engine pod after its init container: no network, the cache answers
    again = cadenza("fetch-model", "hf://org/tiny@main", env={**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert again.returncode == 0 and again.stdout == done.stdout


def test_serve_takes_a_hub_model_and_names_it_by_its_repo(hub_model, tmp_path, monkeypatch):
    from cadenza.node.cli import build_parser, engine_config_from_args

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    fetched = cadenza("fetch-model", "hf://org/tiny", env={"HF_ENDPOINT": hub_model.url, "HF_HOME": str(tmp_path / "hf")})
    assert fetched.returncode == 0, fetched.stderr
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants  # read at import: this process imported it before

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    args = build_parser().parse_args(["serve", "--model", "hf://org/tiny", "--device", "cpu"])
    config = engine_config_from_args(args)
    assert config.model == fetched.stdout.strip() and config.model_name == "org/tiny"


def test_a_missing_repo_or_a_bad_reference_is_a_clear_error(hub_model, tmp_path):
    env = {"HF_ENDPOINT": hub_model.url, "HF_HOME": str(tmp_path / "hf")}
    missing = cadenza("fetch-model", "hf://org/nope", env=env)
    assert missing.returncode == 2 and "no repo org/nope on the Hub" in missing.stderr
    assert "Traceback" not in missing.stderr
    offline = cadenza("fetch-model", "hf://org/tiny@v2", env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 2 and "org/tiny@v2 is not cached" in offline.stderr
    for bad in ("hf://tiny", "hf://org/tiny@", "hf://org/../x", "hf://org/tiny@../../etc"):
        if bad.endswith("@"):
            assert hub.parse(bad) == ("org/tiny", "main")
            continue
        with pytest.raises(ValueError, match="hf://org/name"):
            hub.parse(bad)
