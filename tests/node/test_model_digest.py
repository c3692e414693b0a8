"""A model folder's digest: it tells weights apart, names files alike wherever they live, and hashes
a big file once, not at every start."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from cadenza.node import model_digest as digest_module
from cadenza.node.model_digest import file_sha256, model_digest
from tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """Two tiny Llamas of one shape and tokenizer, weights drawn with seeds 0 and 1."""
    root = tmp_path_factory.mktemp("twins")
    return build_tiny_model(root / "a", seed=0), build_tiny_model(root / "b", seed=1)


def test_other_weights_of_the_same_shape_have_another_digest_and_a_copy_the_same(twins, tmp_path):
    a, b = twins
    assert model_digest(a, tmp_path / "c") != model_digest(b, tmp_path / "c")
    copy = shutil.copytree(a, tmp_path / "copy")
    assert model_digest(copy, tmp_path / "c") == model_digest(a, tmp_path / "c")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0}))  # same weights, other RoPE
    assert model_digest(copy, tmp_path / "c") != model_digest(a, tmp_path / "c")


def test_a_hub_cache_file_is_named_by_its_sha256_and_not_read(twins, tmp_path):
    a, _ = twins
    weights = (a / "model.safetensors").read_bytes()
    sha = hashlib.sha256(weights).hexdigest()
    blobs, snapshot = tmp_path / "models--org--tiny" / "blobs", tmp_path / "models--org--tiny" / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (blobs / sha).write_bytes(weights)
    for f in a.iterdir():  # the hub's layout: each snapshot file links to its blob
        (snapshot / f.name).symlink_to(blobs / sha if f.name == "model.safetensors" else f)
    assert file_sha256(snapshot / "model.safetensors", tmp_path / "c") == (sha, "hub")
    assert model_digest(snapshot, tmp_path / "c") == model_digest(a, tmp_path / "c")  # same files, same digest


def test_a_big_file_is_hashed_once_and_again_only_when_it_changes(twins, tmp_path, monkeypatch):
    monkeypatch.setattr(digest_module, "CACHE_MIN_BYTES", 0)
    a, _ = twins
    folder = shutil.copytree(a, tmp_path / "m")
    weights, cache = folder / "model.safetensors", tmp_path / "cache"
    first = file_sha256(weights, cache)
    assert first == (hashlib.sha256(weights.read_bytes()).hexdigest(), "hashed")
    assert file_sha256(weights, cache) == (first[0], "cached")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the same size, its mtime put back: the change is still seen (ctime moved)
    st = weights.stat()
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_sha256(weights, cache) == (hashlib.sha256(bytes(data)).hexdigest(), "hashed")


def test_an_unwritable_cache_costs_a_hash_at_each_start_and_nothing_else(twins, tmp_path, monkeypatch):
    monkeypatch.setattr(digest_module, "CACHE_MIN_BYTES", 0)
    a, _ = twins
    (tmp_path / "file").write_text("not a folder")
    assert file_sha256(a / "model.safetensors", tmp_path / "file" / "cache")[1] == "hashed"
    assert model_digest(a, tmp_path / "file" / "cache") == model_digest(a, tmp_path / "other")


def test_a_folder_without_weights_or_with_a_broken_file_is_refused(twins, tmp_path):
    with pytest.raises(FileNotFoundError):
        model_digest(tmp_path, tmp_path / "c")
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(ValueError, match="not a safetensors file"):
        model_digest(tmp_path, tmp_path / "c")
