"""A decoder model's dimensions, from its ``config.json``: what the step-time model needs, no weights.

Shipped configs (``cadenza/sim/models/*.json``, dims as in each model's Hugging Face
``config.json``): ``llama-3.1-8b``, ``llama-3.1-70b``, ``mistral-7b`` (v0.1), ``qwen2.5-7b`` and
``smollm2-135m`` (the embedded model). Any Llama-family ``config.json`` works as a path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "models"


class ModelDimsError(ValueError):
    """A config that names no shipped model or lacks a dimension."""


@dataclass(frozen=True, slots=True)
class ModelDims:
    """Dimensions of a Llama-family decoder (GQA attention, SwiGLU MLP).

    Attributes:
        name: the config's name (file stem).
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim, vocab_size:
            as in ``config.json``.
        tie_word_embeddings: the LM head reuses the embedding (its bytes are read either way).
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @property
    def layer_params(self) -> int:
        """Weights of one layer's projections: q, k, v, o and the MLP's gate, up, down."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def num_params(self) -> int:
        """Every weight: layers, embedding and (untied) LM head; norms left out (negligible)."""
        embeddings = self.lm_head_params * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes one token takes over all layers (keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def load_model_dims(name_or_path: str | Path) -> ModelDims:
    """A shipped model by name (``llama-3.1-8b``) or a ``config.json`` path (or its folder).

    Raises:
        ModelDimsError: an unknown name, or a config without the dimensions above.
        OSError: the file cannot be read.
    """
    key = str(name_or_path)
    path = SHIPPED / f"{key}.json" if (SHIPPED / f"{key}.json").exists() else Path(key)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        shipped = sorted(p.stem for p in SHIPPED.glob("*.json"))
        raise ModelDimsError(f"unknown model {key!r}: one of {shipped} or a config.json path")
    cfg = json.loads(path.read_text())
    try:
        heads = int(cfg["num_attention_heads"])
        return ModelDims(
            name=path.stem if path.name != "config.json" else path.parent.name,
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelDimsError(f"{path}: missing or bad dimension ({exc})") from exc
