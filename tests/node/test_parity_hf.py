"""Greedy parity with Hugging Face ``transformers``: the engine's tokens equal ``generate()``'s.

Tiny random checkpoints are built here (GQA, tied and untied embeddings, Llama-3 RoPE scaling,
Qwen2 biases, Mistral), served in fp32 under every token budget / chunk size combination and with
a KV pool small enough to force preemption by recompute.
"""

from __future__ import annotations

import pytest
import torch

from cadenza.node.frontend.llm import Engine
from cadenza.node.core.request import SamplingParams
from tiny_models import LLAMA3_ROPE, build_tiny_model, load_reference

PROMPT_LENS = [1, 3, 16, 17, 64, 100, 257, 300]
MAX_TOKENS = 12


def prompts(seed: int = 0) -> list[list[int]]:
    return prompts_of(PROMPT_LENS, seed)


# Short prompts with long outputs: the outputs outgrow a small KV pool, so decodes must preempt.
GROWING_PROMPT_LENS = [5, 9, 14, 20, 33, 40, 47, 60]
GROWING_MAX_TOKENS = 40


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model_dir, prompt_ids: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    model = load_reference(model_dir)
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False)
            outs.append(y[0, len(ids) :].tolist())
    return outs


def engine_greedy(model_dir, prompt_ids, max_tokens: int = MAX_TOKENS, **knobs) -> tuple[list[list[int]], Engine]:
    engine = Engine.from_model(model_dir, max_model_len=320, **knobs)
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return outs, engine


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    ids = prompts()
    return ids, hf_greedy(tiny_llama_dir, ids)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, None], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("token_budget", [16, 64, 512], ids=lambda b: f"budget{b}")
def test_greedy_tokens_equal_transformers_under_every_budget_and_chunk_size(
    tiny_llama_dir, reference, token_budget, chunk_size
):
    ids, expected = reference
    got, engine = engine_greedy(tiny_llama_dir, ids, token_budget=token_budget, chunk_size=chunk_size)
    assert got == expected
    assert engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def growing(tiny_llama_dir):
    ids = prompts_of(GROWING_PROMPT_LENS, seed=3)
    return ids, hf_greedy(tiny_llama_dir, ids, GROWING_MAX_TOKENS)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_tokens_survive_preemption_by_recompute(tiny_llama_dir, growing, block_size, prefix_caching):
    ids, expected = growing
    # 320 tokens (max_model_len) is all the pool holds; 8 requests growing to ~70 tokens each do not fit.
    got, engine = engine_greedy(
        tiny_llama_dir, ids, GROWING_MAX_TOKENS, token_budget=512, chunk_size=None, block_size=block_size,
        num_kv_blocks=320 // block_size, prefix_caching=prefix_caching,
    )
    assert engine.scheduler.stats.num_preemptions > 0
    assert got == expected
    assert engine.block_manager.num_used_blocks == 0


VARIANTS = {
    "tied-embeddings-llama3-rope-gqa4": dict(num_heads=4, num_kv_heads=1, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE),
    "multi-head-no-gqa": dict(num_heads=4, num_kv_heads=4),
    "gqa8-head-dim-32": dict(num_heads=8, num_kv_heads=1, head_dim=32, rope_theta=500000.0),
    "qwen2-qkv-bias": dict(arch="qwen2", num_heads=4, num_kv_heads=2),
    "mistral": dict(arch="mistral", num_heads=4, num_kv_heads=2),
}


@pytest.mark.slow  # a new model, and transformers' and the engine's greedy runs twice each
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_equal_transformers_across_llama_family_variants(tmp_path, variant):
    model_dir = build_tiny_model(tmp_path / variant, **VARIANTS[variant])
    ids = prompts(seed=1)
    expected = hf_greedy(model_dir, ids)
    got, _ = engine_greedy(model_dir, ids, token_budget=64, chunk_size=7)
    assert got == expected
    growing_ids = prompts_of(GROWING_PROMPT_LENS, seed=4)
    got, engine = engine_greedy(model_dir, growing_ids, GROWING_MAX_TOKENS, token_budget=48, chunk_size=None,
                                block_size=8, num_kv_blocks=40)
    assert engine.scheduler.stats.num_preemptions > 0
    assert got == hf_greedy(model_dir, growing_ids, GROWING_MAX_TOKENS)
