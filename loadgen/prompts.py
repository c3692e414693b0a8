"""Synthetic prompts of an exact token length, for replaying traces that carry no text.

Each prompt is plain English drawn from a small built-in corpus: its sentences are shuffled per
prompt (seeded) and the prompt starts at a random token of the first one, so two prompts almost
never share a first KV block and a prefix cache cannot serve one from another. The sentences are
tokenized once; a prompt takes the first N ids of its shuffled stream, decodes them, re-encodes
the text and nudges the number of ids taken until the re-encoded text is exactly N tokens.

Token counts are of the text alone (``add_special_tokens=False``): a server that adds a BOS
token, or a chat template around the message, sees a few more prompt tokens.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from tokenizers import Tokenizer

_CORPUS = """
The harbour town woke slowly on winter mornings. Fishing boats left before dawn, their lamps
bobbing like fireflies over the grey water, and by eight o'clock the bakery on the corner had
already sold its first tray of cinnamon rolls. Old Marta, who had kept the lighthouse for
thirty-one years, still walked the pier every day, although the light had been automated long ago.

Photosynthesis converts light energy into chemical energy stored in sugar. Inside the chloroplast,
pigments such as chlorophyll absorb mostly red and blue light and reflect green, which is why
leaves look green to us. Water molecules are split, oxygen is released as a by-product, and the
captured energy drives the fixation of carbon dioxide in the Calvin cycle.

To make a simple tomato sauce, warm two tablespoons of olive oil in a wide pan over medium heat.
Add a finely chopped onion and a pinch of salt, and cook until soft but not brown, about ten
minutes. Stir in two cloves of garlic, then a can of crushed tomatoes, and let it simmer gently for
twenty minutes. Season with basil, pepper and, if the tomatoes are sharp, a little sugar.

A hash table stores key-value pairs in an array of buckets. A hash function maps each key to an
index; when two keys land in the same bucket, the collision is resolved by chaining or by probing
for another free slot. With a good hash function and a load factor kept below a fixed threshold,
lookups, inserts and deletes take constant time on average.

The committee met on Tuesday to review the budget for the coming year. Several members asked why
the maintenance costs had risen by twelve percent, and the treasurer explained that the roof of the
community hall had to be replaced after the storms in March. A vote on the new playground was
postponed until the next meeting, when updated quotes from three contractors will be available.

In 1869 the first transcontinental railroad in the United States was completed at Promontory
Summit, Utah. Crews working from the east and the west had laid nearly two thousand miles of track
across plains, deserts and mountains. The journey from coast to coast, which once took months by
wagon, could now be made in about a week.

Dear Sam, thank you for the lovely postcard from Lisbon! The tiles on the front made me want to book
a trip straight away. We are all well here; the garden is full of courgettes again, far more than
we can eat, so expect a parcel. Write soon and tell me whether you found that little bookshop near
the river that you kept talking about.

Regular exercise improves sleep, mood and concentration. Adults are usually advised to aim for at
least one hundred and fifty minutes of moderate activity each week, such as brisk walking or
cycling, along with muscle-strengthening exercises on two or more days. Even short walks after
meals can help keep blood sugar steady.

Why did the mathematician refuse to play hide and seek? Because good luck hiding when everyone
knows you are always in the set of places not yet searched. The physicist laughed, the chemist
groaned, and the biologist asked whether the game had been peer reviewed.

Clouds form when moist air rises, expands and cools until water vapour condenses on tiny particles
of dust or salt. Flat layers of stratus bring grey, drizzly days, while towering cumulonimbus clouds
can reach the top of the troposphere and produce lightning, hail and sudden gusts of wind.
"""


def corpus_sentences() -> list[str]:
    """The built-in corpus split into sentences (whitespace normalised)."""
    text = " ".join(_CORPUS.split())
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a Hugging Face ``tokenizer.json`` (a file, or a folder holding one).

    Raises:
        FileNotFoundError: neither ``path`` nor ``path/tokenizer.json`` is a file.
        Exception: whatever ``tokenizers`` raises for a file it cannot parse.
    """
    path = Path(path).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(str(file))


class PromptSynthesizer:
    """Makes prompts of a requested token length for one tokenizer.

    Args:
        tokenizer: the tokenizer whose token count should match the requested length.
        seed: seeds the per-prompt sentence order and start offset; the same seed and call
            sequence give the same prompts.
    """

    def __init__(self, tokenizer: Tokenizer, seed: int = 0) -> None:
        self._tokenizer = tokenizer
        self._rng = random.Random(seed)
        # A leading space, as each sentence appears after the one before it in the stream.
        self._sentence_ids = [
            tokenizer.encode(" " + s, add_special_tokens=False).ids for s in corpus_sentences()
        ]

    def count(self, text: str) -> int:
        """Number of tokens in ``text`` (no special tokens added)."""
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def prompt(self, num_tokens: int) -> str:
        """A prompt of ``num_tokens`` tokens (re-encoded), different on every call.

        Exact for any length the tokenizer can express; when decoding and re-encoding cannot
        meet the length exactly (rare: it depends on how the tokenizer merges across the cut),
        the closest length found is returned, never more than a couple of tokens off.

        Raises:
            ValueError: ``num_tokens`` < 1.
        """
        if num_tokens < 1:
            raise ValueError(f"a prompt needs at least 1 token, got {num_tokens}")
        ids = self._stream(num_tokens + 16)
        take = num_tokens
        best_text, best_err = "", num_tokens
        seen = set()
        while 1 <= take <= len(ids) and take not in seen:
            seen.add(take)
            text = self._tokenizer.decode(ids[:take], skip_special_tokens=False)
            got = self.count(text)
            if got == num_tokens:
                return text
            if abs(got - num_tokens) < best_err:
                best_text, best_err = text, abs(got - num_tokens)
            take += num_tokens - got
        return best_text

    def _stream(self, min_len: int) -> list[int]:
        """At least ``min_len`` ids of shuffled sentences, from a random start in the first."""
        first = self._rng.randrange(len(self._sentence_ids))
        start = self._rng.randrange(max(len(self._sentence_ids[first]) - 1, 1))
        ids = list(self._sentence_ids[first][start:])
        order = list(range(len(self._sentence_ids)))
        while len(ids) < min_len:
            self._rng.shuffle(order)
            for i in order:
                ids.extend(self._sentence_ids[i])
                if len(ids) >= min_len:
                    break
        return ids
