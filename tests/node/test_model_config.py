"""Reading Hugging Face config.json files of the Llama family."""

from __future__ import annotations

import pytest
import torch

from cadenza.node.runner.models.config import ModelConfig, ModelConfigError
from cadenza.node.runner.models.rope import inverse_frequencies

LLAMA31_8B = {  # transformers 4.x layout, as published
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "eos_token_id": [128001, 128008, 128009],
}


def test_llama31_layout_with_rope_scaling():
    cfg = ModelConfig.from_dict(LLAMA31_8B)
    assert cfg.head_dim == 128 and cfg.num_key_value_heads == 8 and cfg.rope_theta == 500000.0
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.eos_token_ids == (128001, 128008, 128009)
    assert cfg.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2


def test_transformers5_rope_parameters_layout(smollm2_dir):
    cfg = ModelConfig.from_pretrained(smollm2_dir)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None and cfg.tie_word_embeddings
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)


def test_qwen2_has_qkv_bias_and_no_sliding_window_when_disabled():
    cfg = ModelConfig.from_dict({**LLAMA31_8B, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": None,
                                 "sliding_window": 4096, "use_sliding_window": False})
    assert cfg.qkv_bias and cfg.sliding_window is None


def test_unsupported_architecture_is_refused_by_name():
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel"):
        ModelConfig.from_dict({**LLAMA31_8B, "architectures": ["GPT2LMHeadModel"]})


def test_unsupported_rope_scaling_is_refused():
    with pytest.raises(ModelConfigError, match="yarn"):
        ModelConfig.from_dict({**LLAMA31_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_missing_config_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_llama3_scaling_keeps_high_frequencies_and_divides_low_ones():
    scaling = ModelConfig.from_dict(LLAMA31_8B).rope_scaling
    plain = inverse_frequencies(128, 500000.0)
    scaled = inverse_frequencies(128, 500000.0, scaling)
    assert torch.equal(scaled[:10], plain[:10])
    assert torch.allclose(scaled[-5:], plain[-5:] / 8.0)
