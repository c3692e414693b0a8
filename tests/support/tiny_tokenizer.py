"""A tiny, deterministic byte-level BPE tokenizer folder for tests (no downloads).

``build_tiny_tokenizer_dir(path)`` trains a SmolLM2-shaped tokenizer with the ``tokenizers``
library on the few paragraphs below and writes a Hugging Face tokenizer folder:

- ``tokenizer.json``: byte-level BPE (ByteLevel pre-tokenizer and decoder, initial alphabet
  ``ByteLevel.alphabet()`` so every byte is encodable), vocab size ``TINY_VOCAB_SIZE`` (384),
  special tokens ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2;
- ``tokenizer_config.json``: ``bos_token`` ``<|im_start|>``, ``eos_token`` ``<|im_end|>``,
  ``pad_token`` ``<|im_end|>``, ``unk_token`` ``<|endoftext|>`` and a ChatML chat template
  (SmolLM2's, with a tiny default system prompt).

It writes no ``config.json``: a test that builds a random model next to it writes its own, with
``vocab_size`` = ``tiny_vocab_size(path)``. The same input always gives byte-identical files.

Tests load this file by path (pytest runs with ``--import-mode=importlib``)::

    spec = importlib.util.spec_from_file_location(
        "tiny_tokenizer", Path(__file__).with_name("tiny_tokenizer.py"))
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TINY_VOCAB_SIZE = 384
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. What is the capital of France? "
    "The capital of France is Paris. Hello, world! How are you today? I am fine, thank you.",
    "A scheduler builds one mixed batch under the token budget: decode tokens first, then "
    "prefill chunks in the leftover budget. Every running sequence advances every step.",
    "Café crème, déjà vu, naïve résumé, Zoë à l'été. Ça va très bien, merci beaucoup.",
    "日本語のテキストも少し入れます。東京は日本の首都です。こんにちは、世界。",
    "Emoji travel as several bytes: 😀 🚀 🎉 👍 ❤️ and 🇫🇷 round-trip.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # 3\n",
    "<|im_start|>user\nHi there!<|im_end|>\n"
    "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n",
)


def train_tiny_tokenizer() -> Tokenizer:
    """Train the tiny byte-level BPE in memory (deterministic; about 10 ms)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    return tokenizer


def build_tiny_tokenizer_dir(path: Path) -> Path:
    """Write the tiny tokenizer folder into ``path`` (created if needed) and return ``path``.

    Files: ``tokenizer.json`` and ``tokenizer_config.json`` (see the module docstring). The
    vocab size is ``tiny_vocab_size(path)`` (== ``TINY_VOCAB_SIZE``).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_tokenizer()
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, (token, tokenizer.token_to_id(token))
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def tiny_vocab_size(path: Path) -> int:
    """The vocab size (special tokens included) of the tokenizer written at ``path``."""
    return Tokenizer.from_file(str(Path(path) / "tokenizer.json")).get_vocab_size()


if __name__ == "__main__":  # pragma: no cover - manual use: python tests/node/tiny_tokenizer.py DIR
    import sys

    out = build_tiny_tokenizer_dir(Path(sys.argv[1]))
    print(out, tiny_vocab_size(out))
