"""Fixtures shared by every test package: the embedded model and tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest

from cadenza.node.embedded import ensure_embedded_model
from tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (``make test`` fetches it first; else ~30 s)."""
    return ensure_embedded_model()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with GQA (4 query heads, 2 KV heads), untied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
