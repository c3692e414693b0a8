"""Fixtures shared by every test package: the embedded model and tiny random models."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Triton kernels run under the interpreter on a GPU-less machine. Triton reads this when it is
# first imported (torch imports it lazily), so it is set before anything else can import it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
