"""Seeded random weights: a model of a real model's shapes built without its files (the GPU probe's
way to run Llama-3.1-8B shapes where no checkpoint can be downloaded)."""

from __future__ import annotations

import json

import pytest
import torch

from cadenza.node.core.config import EngineConfig
from cadenza.node.engine.engine_core import EngineCore
from cadenza.node.core.messages import AddRequest
from cadenza.node.core.request import SamplingParams
from cadenza.node.runner.backend import AttentionMetadata, TorchBackend
from cadenza.node.runner.models.config import ModelConfig
from cadenza.node.runner.models.llama import LlamaForCausalLM, load_model, random_weights
from cadenza.sim.model_dims import SHIPPED

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 512, "tie_word_embeddings": False}


def _model(cfg: dict, seed: int) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelConfig.from_dict(cfg), TorchBackend(), max_position=64)
    random_weights(model, seed)
    return model


def test_the_same_seed_draws_the_same_weights_and_another_seed_others():
    a, b, c = _model(TINY, 0).state_dict(), _model(TINY, 0).state_dict(), _model(TINY, 1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.mlp.down_proj.weight"], c["layers.0.mlp.down_proj.weight"])


def test_drawn_weights_follow_the_llama_initialisation():
    model = _model({**TINY, "architectures": ["Qwen2ForCausalLM"]}, 3)  # Qwen2: q/k/v carry a bias
    params = dict(model.named_parameters())
    assert torch.count_nonzero(params["layers.1.self_attn.qkv_proj.bias"]) == 0
    assert torch.equal(params["norm.weight"], torch.ones(64))
    assert torch.equal(params["layers.0.input_layernorm.weight"], torch.ones(64))
    matrix = params["layers.0.mlp.gate_up_proj.weight"]
    assert abs(matrix.mean().item()) < 2e-3 and 0.018 < matrix.std().item() < 0.022


def test_an_engine_runs_on_drawn_weights_from_a_config_alone(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    config = EngineConfig.from_knobs(str(tmp_path), device="cpu", attention_backend="torch", num_kv_blocks=16)

    def greedy(seed: int) -> list[int]:
        core = EngineCore(config, weights_seed=seed)
        core.add_request(AddRequest("r", list(range(5, 25)), SamplingParams(max_tokens=6, temperature=0,
                                                                            ignore_eos=True)))
        tokens = []
        while core.has_unfinished_requests():
            tokens += [t for delta in core.step()[0] for t in delta.new_token_ids]
        return tokens

    first = greedy(0)
    assert len(first) == 6 and first == greedy(0)
    assert first != greedy(1)  # the tokens come from the drawn weights
    # KV made by other drawn weights is other KV: the transfer fingerprint says which seed.
    assert EngineCore(config, weights_seed=0)._fingerprint() != EngineCore(config, weights_seed=1)._fingerprint()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        EngineCore(config)  # without a seed the weights are loaded, and there are none


def _logits(model: LlamaForCausalLM, num_tokens: int, device: str) -> torch.Tensor:
    """Logits of the last token of one prompt of ``num_tokens`` random ids (an empty cache)."""
    cfg = model.config
    block = 16
    blocks = -(-num_tokens // block)
    shape, dtype = (blocks, block, cfg.num_key_value_heads, cfg.head_dim), model.norm.weight.dtype
    kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
          for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device).view(1, -1),
        max_query_len=num_tokens, max_seq_len=num_tokens,
    )
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0)).to(device)
    hidden = model(ids, torch.arange(num_tokens, device=device), kv, meta)
    return model.compute_logits(hidden[-1:])


def _shipped(name: str) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((SHIPPED / f"{name}.json").read_text()))


@pytest.mark.slow
def test_smollm2_shapes_on_drawn_weights_give_finite_spread_logits_in_bf16():
    """30 layers in bf16 on the CPU: std 0.02 keeps every activation finite, and the logits are
    not all equal (greedy decoding follows the weights, not ties)."""
    model = load_model("unused", _shipped("smollm2-135m"), TorchBackend(), 64, torch.bfloat16, torch.device("cpu"),
                       weights_seed=0)
    logits = _logits(model, 24, "cpu")
    assert torch.isfinite(logits).all() and logits.std() > 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Llama-3.1-8B shapes: 16 GB of weights)")
def test_llama_8b_shapes_on_drawn_weights_give_finite_logits_on_cuda():
    from cadenza.node.runner.backend import TritonBackend

    model = load_model("unused", _shipped("llama-3.1-8b"), TritonBackend(), 256, torch.bfloat16,
                       torch.device("cuda"), weights_seed=0)
    logits = _logits(model, 128, "cuda")
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    del model
    torch.cuda.empty_cache()
