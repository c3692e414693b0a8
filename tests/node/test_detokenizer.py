"""Specification of cadenza.node.frontend.detokenizer: safe UTF-8 text deltas and OpenAI stop strings."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadenza.node.frontend.detokenizer import IncrementalDetokenizer
from cadenza.node.frontend.tokenizer import Tokenizer
from tiny_tokenizer import build_tiny_tokenizer_dir

MIXED_TEXT = "Héllo wörld! 日本語のテキスト 😀🚀👍🏽 and 🇫🇷, déjà vu, 東京. ok"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tiny_tokenizer_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(params=["tiny", "smollm2"])
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(request.param)


def stream(detok: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    """Deltas for ``ids`` (stopping like a server would), then the flush when not stopped."""
    deltas = []
    for token_id in ids:
        deltas.append(detok.add_token(token_id))
        if detok.stopped:
            return deltas
    return [*deltas, detok.flush()]


def char_ids(tok: Tokenizer, text: str) -> list[int]:
    """Ids with (at least) one token per character, so stops can span token boundaries."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]


def reference_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """What a client must see: the text before the first stop string to complete."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text.startswith(s, end - len(s)) and end >= len(s)]
        if done:
            stop = max(done, key=len)
            return text[: end - len(stop)], stop
    return text, None


# --- UTF-8 safety ---------------------------------------------------------------------------


def test_deltas_concatenate_to_the_full_decode(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED_TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    assert "".join(stream(detok, ids)) == MIXED_TEXT == detok.text


def test_multibyte_characters_split_across_tokens_are_never_emitted_broken(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED_TEXT, add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert partial, "the test text must split some characters across tokens"
    deltas = stream(IncrementalDetokenizer(tok), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # tokens holding half a character emit nothing yet


def test_smollm2_emoji_bytes_are_buffered_until_complete(smollm2: Tokenizer) -> None:
    ids = smollm2.encode(" 😀", add_special_tokens=False)
    assert len(ids) == 2  # ' \xf0\x9f\x98' + '\x80'
    detok = IncrementalDetokenizer(smollm2)
    assert [detok.add_token(i) for i in ids] == ["", " 😀"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_stream_to_exactly_the_full_decode(
    tok: Tokenizer, skip_special_tokens: bool
) -> None:
    rng = random.Random(1234)
    for trial in range(100):
        high = tok.vocab_size if trial % 2 else min(tok.vocab_size, 400)  # byte-ish tokens
        ids = [rng.randrange(high) for _ in range(rng.randrange(1, 30))]
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
        deltas = stream(detok, ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert all(not d.endswith("\ufffd") for d in deltas[:-1])


def test_special_tokens_are_skipped_unless_asked_for(tiny: Tokenizer) -> None:
    ids = [*tiny.encode("hi", add_special_tokens=False), 2]
    assert "".join(stream(IncrementalDetokenizer(tiny), ids)) == "hi"
    kept = IncrementalDetokenizer(tiny, skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "hi<|im_end|>"


def test_unknown_ids_from_a_padded_vocab_decode_to_nothing(tiny: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tiny)
    assert detok.add_token(tiny.vocab_size + 10) == ""
    assert detok.flush() == ""


# --- stop strings ---------------------------------------------------------------------------


def test_stop_string_and_what_follows_are_never_emitted(tiny: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tiny, stop=["STOP"])
    deltas = stream(detok, char_ids(tiny, "Hello world STOP and more"))
    assert "".join(deltas) == detok.text == "Hello world "
    assert detok.stopped and detok.stop_reason == "STOP"
    assert all("S" not in d for d in deltas)


def test_stop_at_the_very_start_emits_nothing(tiny: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tiny, stop=["Hello"])
    deltas = stream(detok, tiny.encode("Hello world", add_special_tokens=False))
    assert set(deltas) == {""} and detok.text == ""
    assert detok.stopped and detok.stop_reason == "Hello"


def test_stop_spanning_several_tokens_is_found(tok: Tokenizer) -> None:
    stop = "capital of"
    ids = tok.encode("What is the capital of France?", add_special_tokens=False)
    assert len(tok.encode(stop, add_special_tokens=False)) > 1
    detok = IncrementalDetokenizer(tok, stop=[stop])
    assert "".join(stream(detok, ids)) == "What is the "
    assert detok.stop_reason == stop


def test_stop_inside_one_token_truncates_that_token(tiny: Tokenizer) -> None:
    ids = tiny.encode("the capital", add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny, stop=["apit"])
    assert "".join(stream(detok, ids)) == "the c"


def test_overlapping_stops_end_at_the_first_to_complete(tiny: Tokenizer) -> None:
    for stops in (["abc", "bcd"], ["bcd", "abc"]):
        detok = IncrementalDetokenizer(tiny, stop=stops)
        assert "".join(stream(detok, char_ids(tiny, "xxabcdyy"))) == "xx"
        assert detok.stop_reason == "abc"
    detok = IncrementalDetokenizer(tiny, stop=["abd", "bc"])  # 'ab' is held, then 'bc' wins
    assert "".join(stream(detok, char_ids(tiny, "zabcd"))) == "za"
    assert detok.stop_reason == "bc"


@pytest.mark.parametrize(
    ("stops", "text", "expected", "reason"),
    [
        (["ab", "b"], "xab", "x", "ab"),  # 'b' ends with 'ab': the earliest start wins
        (["b", "ab"], "xab", "x", "ab"),
        (["abcd", "bc"], "abcd", "a", "bc"),  # 'bc' completes before 'abcd'
        (["ab", "ab", "b"], "zzab", "zz", "ab"),  # duplicates
    ],
)
def test_nested_stops_end_at_the_first_to_complete_then_the_earliest_start(
    tiny: Tokenizer, stops: list[str], text: str, expected: str, reason: str
) -> None:
    for ids in (char_ids(tiny, text), tiny.encode(text, add_special_tokens=False)):
        detok = IncrementalDetokenizer(tiny, stop=stops)
        assert "".join(stream(detok, ids)) == expected and detok.stop_reason == reason


def test_many_stop_strings_match_like_one(tiny: Tokenizer) -> None:
    stops = [f"{n:05d}" for n in range(10_000)] + ["ST"]  # only 'ST' can occur in the text
    detok = IncrementalDetokenizer(tiny, stop=stops)
    assert "".join(stream(detok, char_ids(tiny, "a b 0x1 STOP"))) == "a b 0x1 "
    assert detok.stop_reason == "ST"


def test_text_that_might_start_a_stop_is_held_back_then_released(tiny: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tiny, stop=["STOP"])
    assert [detok.add_token(i) for i in char_ids(tiny, "a ST")] == ["a", " ", "", ""]
    assert [detok.add_token(i) for i in char_ids(tiny, "ay")] == ["STa", "y"]
    assert not detok.stopped


def test_held_back_text_is_flushed_when_the_request_ends(tiny: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tiny, stop=["STOP"])
    deltas = [detok.add_token(i) for i in char_ids(tiny, "Hello ST")]
    assert "".join(deltas) == "Hello "
    assert detok.flush() == "ST"
    assert detok.text == "Hello ST" and not detok.stopped and detok.stop_reason is None
    assert detok.flush() == "" and detok.add_token(5) == ""


def test_hold_back_is_at_most_the_longest_stop_minus_one(tiny: Tokenizer) -> None:
    stops = ["the end of it", "xyz"]
    text = "the the the end the end of and the end of i. " * 3
    detok = IncrementalDetokenizer(tiny, stop=stops)
    ids = char_ids(tiny, text)
    for n, token_id in enumerate(ids, 1):
        detok.add_token(token_id)
        decoded = tiny.decode(ids[:n])
        assert decoded.startswith(detok.text)
        assert len(decoded) - len(detok.text) <= len(stops[0]) - 1
    assert detok.text + detok.flush() == text


def test_special_token_can_be_a_stop_when_kept(tiny: Tokenizer) -> None:
    ids = [*tiny.encode("done", add_special_tokens=False), 2, 5]
    detok = IncrementalDetokenizer(tiny, stop=["<|im_end|>"], skip_special_tokens=False)
    assert "".join(stream(detok, ids)) == "done" and detok.stopped


def test_stop_after_stopping_emits_nothing(tiny: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tiny, stop=["b"])
    assert "".join(stream(detok, char_ids(tiny, "abc"))) == "a"
    assert detok.add_token(tiny.encode("z", add_special_tokens=False)[0]) == ""
    assert detok.flush() == "" and detok.text == "a"


def test_empty_stop_string_is_rejected(tiny: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tiny, stop=["ok", ""])


def test_random_texts_and_stops_match_the_reference(tok: Tokenizer) -> None:
    rng = random.Random(7)
    alphabet = "ab é日😀 "
    for _ in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 25)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4)))]
        if text and rng.random() < 0.5:
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randrange(1, 5)])
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, stop=stops)
        emitted = "".join(stream(detok, ids))
        expected, reason = reference_stop(text, stops)
        assert (emitted, detok.stop_reason) == (expected, reason), (text, stops)


@st.composite
def chunked_streams(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    """Text pieces (each encoded on its own, so token boundaries fall anywhere) and stops."""
    alphabet = draw(st.sampled_from(["ab", "abc ", "a é日😀"]))
    pieces = draw(st.lists(st.text(alphabet, min_size=1, max_size=5), max_size=8))
    stops = draw(st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=6))
    text = "".join(pieces)
    if text and draw(st.booleans()):
        start = draw(st.integers(0, len(text) - 1))
        stops.append(text[start : start + draw(st.integers(1, 5))])
    return pieces, stops


@settings(
    max_examples=150, deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(case=chunked_streams())
def test_any_chunking_of_the_text_matches_the_reference(
    tok: Tokenizer, case: tuple[list[str], list[str]]
) -> None:
    pieces, stops = case
    text = "".join(pieces)
    ids = [i for piece in pieces for i in tok.encode(piece, add_special_tokens=False)]
    detok = IncrementalDetokenizer(tok, stop=stops)
    emitted = "".join(stream(detok, ids))
    assert (emitted, detok.stop_reason) == reference_stop(text, stops), (pieces, stops)
