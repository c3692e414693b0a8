"""Tiny random Llama-family checkpoints, built with ``transformers`` and saved as HF folders.

Used to compare cadenza against ``transformers`` (the reference) without downloads. Weights are
drawn with a larger ``initializer_range`` than real models so that logits are well separated and
greedy decoding is not decided by float noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from tiny_tokenizer import TINY_VOCAB_SIZE, build_tiny_tokenizer_dir

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}


def build_tiny_model(
    path: Path,
    *,
    arch: str = "llama",
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    num_layers: int = 2,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> Path:
    """Write a random model + the tiny tokenizer into ``path``; return ``path``.

    The vocabulary is the tiny tokenizer's (384 tokens) with ``<|im_end|>`` (id 2) as EOS.
    """
    path.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer_dir(path)
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": rope_theta}
    config = _CONFIGS[arch](
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=num_heads * head_dim,
        intermediate_size=2 * num_heads * head_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":  # give the q/k/v biases real values (they init to zero)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


def load_reference(path: Path):
    """The ``transformers`` model for a folder written by :func:`build_tiny_model` (fp32, eval)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
