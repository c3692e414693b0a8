"""The model's shape, read from a Hugging Face ``config.json``.

Covers the Llama family: Llama 2/3, SmolLM2, Mistral and Qwen2 (``model_type`` ``llama``,
``mistral``, ``qwen2``). Both the transformers 4.x layout (``rope_theta``, ``rope_scaling``) and
the 5.x layout (``rope_parameters``) are understood. No torch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_ROPE_TYPES = ("default", "linear", "llama3")


class ModelConfigError(ValueError):
    """The model folder is not one cadenza can serve; the message says why."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a Llama-family decoder.

    Attributes:
        rope_scaling: ``None`` or a dict with ``rope_type`` (``linear`` | ``llama3``) and its
            parameters (``factor``; for llama3 ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``).
        qkv_bias: q/k/v projections carry a bias (Qwen2, or ``attention_bias``).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read ``path/config.json``.

        Raises:
            FileNotFoundError: no ``config.json``.
            ModelConfigError: an architecture or RoPE type cadenza does not implement.
        """
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: --model must be a Hugging Face model folder")
        try:
            cfg = json.loads(file.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ModelConfigError(f"{file} is not valid JSON: {exc}") from None
        try:
            return cls.from_dict(cfg)
        except (KeyError, TypeError) as exc:
            raise ModelConfigError(f"{file} lacks a usable {exc} entry") from None


    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type", ""), "")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"architecture {arch or cfg.get('model_type')!r} is not supported; "
                f"cadenza serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope else None)
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in _ROPE_TYPES:
                raise ModelConfigError(f"rope_scaling type {kind!r} is not supported; cadenza implements {_ROPE_TYPES}")
            scaling = None if kind == "default" else {**scaling, "rope_type": kind}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling=scaling,
            sliding_window=window,
            eos_token_ids=eos_ids,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V cache one token takes across all layers."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def check_model_folder(path: str | Path, need_tokenizer: bool = True) -> ModelConfig:
    """Everything a served model needs is there: ``config.json``, weights, ``tokenizer.json``.

    Raises:
        FileNotFoundError: naming what is missing.
        ModelConfigError: an unreadable or unsupported ``config.json``.
    """
    folder = Path(path)
    cfg = ModelConfig.from_pretrained(folder)
    if not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    if need_tokenizer and not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder / 'tokenizer.json'} not found: cadenza needs a fast tokenizer file")
    return cfg
