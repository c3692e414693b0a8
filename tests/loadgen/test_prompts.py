"""Prompt synthesis: exact token lengths, prompts that differ, reproducible seeds."""

from __future__ import annotations

import pytest

from cadenza.loadgen.prompts import PromptSynthesizer, corpus_sentences, load_tokenizer


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_tokenizer(smollm2_dir)


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 8, 16, 17, 63, 100, 511, 1000, 4142, 14050])
def test_prompts_hit_the_exact_token_count_with_smollm2(smollm2, num_tokens):
    synth = PromptSynthesizer(smollm2, seed=num_tokens)
    for _ in range(5):
        prompt = synth.prompt(num_tokens)
        assert len(smollm2.encode(prompt, add_special_tokens=False).ids) == num_tokens


def test_prompts_differ_from_the_first_block_on(smollm2):
    synth = PromptSynthesizer(smollm2, seed=0)
    first_blocks = {tuple(smollm2.encode(synth.prompt(200), add_special_tokens=False).ids[:16])
                    for _ in range(50)}
    assert len(first_blocks) >= 45  # a prefix cache with 16-token blocks can rarely share


def test_prompt_length_is_exact_for_a_byte_level_tokenizer(byte_tokenizer_path):
    synth = PromptSynthesizer(load_tokenizer(byte_tokenizer_path), seed=3)
    for n in (1, 9, 250, 3000):
        prompt = synth.prompt(n)
        assert len(prompt.encode()) == n
        assert synth.count(prompt) == n


def test_the_same_seed_gives_the_same_prompts(byte_tokenizer_path):
    tokenizer = load_tokenizer(byte_tokenizer_path)
    a, b = PromptSynthesizer(tokenizer, seed=7), PromptSynthesizer(tokenizer, seed=7)
    c = PromptSynthesizer(tokenizer, seed=8)
    prompts_a = [a.prompt(300) for _ in range(3)]
    assert prompts_a == [b.prompt(300) for _ in range(3)]
    assert prompts_a != [c.prompt(300) for _ in range(3)]
    assert len(set(prompts_a)) == 3


def test_the_corpus_is_varied_english():
    sentences = corpus_sentences()
    assert len(sentences) >= 25
    assert all(s[-1] in ".!?" for s in sentences)


def test_a_prompt_needs_at_least_one_token(byte_tokenizer_path):
    with pytest.raises(ValueError):
        PromptSynthesizer(load_tokenizer(byte_tokenizer_path)).prompt(0)


def test_load_tokenizer_accepts_a_file_or_its_folder(byte_tokenizer_path, tmp_path):
    assert load_tokenizer(byte_tokenizer_path).get_vocab_size() == 256
    assert load_tokenizer(byte_tokenizer_path.parent).get_vocab_size() == 256
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")
