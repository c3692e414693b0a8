"""Specification of cadenza.node.frontend.stop_strings: the Aho–Corasick stop-string matcher."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadenza.node.frontend.stop_strings import StopMatch, StopStringMatcher


def reference_first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Brute force: (end, stop) of the stop that completes first, the longest on a tie."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if end >= len(s) and text.startswith(s, end - len(s))]
        if done:
            return end, max(done, key=len)
    return None


def reference_held(text: str, stops: Sequence[str]) -> int:
    """Brute force: the longest suffix of ``text`` that is a proper prefix of a stop."""
    for length in range(len(text), 0, -1):
        if any(len(s) > length and s.startswith(text[-length:]) for s in stops):
            return length
    return 0


def feed_all(matcher: StopStringMatcher, chunks: Sequence[str]) -> tuple[int, str] | None:
    """Feed ``chunks`` in order; the first match as (end in the whole text, stop)."""
    offset = 0
    for chunk in chunks:
        match = matcher.feed(chunk)
        if match is not None:
            return offset + match.end, match.stop
        offset += len(chunk)
    return None


def split(text: str, cuts: Sequence[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# --- properties against brute force ---------------------------------------------------------


@st.composite
def streams(draw: st.DrawFn) -> tuple[str, list[str], list[str]]:
    """A text over a small alphabet, stops (some cut from the text), and a chunking of it."""
    alphabet = draw(st.sampled_from(["a", "ab", "abc", "aé日😀"]))
    letters = st.sampled_from(alphabet)
    text = "".join(draw(st.lists(letters, max_size=40)))
    stops = draw(st.lists(st.text(alphabet, min_size=1, max_size=6), min_size=1, max_size=8))
    cut_from_text = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 6)), max_size=3)
    for start, length in draw(cut_from_text):
        if text:
            start %= len(text)
            stops.append(text[start : start + length])
    cuts = draw(st.lists(st.integers(0, 40), max_size=12))
    return text, draw(st.permutations(stops)), split(text, cuts)


@settings(max_examples=400, deadline=None)
@given(streams())
def test_the_first_stop_to_complete_matches_brute_force_for_any_chunking(
    case: tuple[str, list[str], list[str]],
) -> None:
    text, stops, chunks = case
    assert feed_all(StopStringMatcher(stops), chunks) == reference_first_stop(text, stops)


@settings(max_examples=400, deadline=None)
@given(streams())
def test_held_is_the_longest_suffix_that_may_still_begin_a_stop(
    case: tuple[str, list[str], list[str]],
) -> None:
    text, stops, chunks = case
    matcher, seen = StopStringMatcher(stops), ""
    for chunk in chunks:
        if matcher.feed(chunk) is not None:
            return
        seen += chunk
        assert matcher.held == reference_held(seen, stops), (seen, stops)
        assert matcher.held <= max(map(len, stops)) - 1


# --- overlapping, duplicate and nested stops ------------------------------------------------


@pytest.mark.parametrize(
    ("stops", "text", "expected"),
    [
        (["ab", "b"], "xab", (3, "ab")),  # same end: the earliest start (longest) wins
        (["b", "ab"], "xab", (3, "ab")),
        (["abcd", "bc"], "abcd", (3, "bc")),  # 'bc' inside 'abcd' completes first
        (["abc", "bcd"], "xxabcdyy", (5, "abc")),
        (["abd", "bc"], "zabcd", (4, "bc")),  # 'ab' was a prefix of 'abd', then 'bc' ends
        (["aab", "ab"], "aaab", (4, "aab")),  # the failure link from 'aa' leads to 'a'
        (["STOP", "STOP", "STOP"], "a STOP", (6, "STOP")),  # duplicates
        (["he", "she", "his", "hers"], "ushers", (4, "she")),  # Aho & Corasick's example
    ],
)
def test_overlapping_stops_end_at_the_first_to_complete(
    stops: list[str], text: str, expected: tuple[int, str]
) -> None:
    assert feed_all(StopStringMatcher(stops), [text]) == expected
    assert feed_all(StopStringMatcher(stops), list(text)) == expected  # one char per chunk


def test_a_match_reports_its_end_inside_the_chunk_that_completes_it() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("a ST") is None and matcher.held == 2
    assert matcher.feed("OP and more") == StopMatch(end=2, stop="STOP")


def test_text_that_cannot_begin_a_stop_is_released_at_once() -> None:
    matcher = StopStringMatcher(["abc", "bd"])
    assert matcher.feed("ab") is None and matcher.held == 2  # 'ab' ('abc'), 'b' ('bd')
    assert matcher.feed("x") is None and matcher.held == 0


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])


# --- work per character ---------------------------------------------------------------------


def steps_per_char(stops: Sequence[str], text: str, chunk: int) -> float:
    matcher = StopStringMatcher(stops)
    for start in range(0, len(text), chunk):
        assert matcher.feed(text[start : start + chunk]) is None
    return matcher.steps / len(text)


def test_work_per_character_is_bounded_independent_of_the_number_of_stops() -> None:
    rng = random.Random(3)
    text = "".join(rng.choice("ab") for _ in range(20_000))  # walks deep into the trie, no 'c'
    many = {"".join(rng.choice("ab") for _ in range(14)) + "c" for _ in range(12_000)}
    many_stops = sorted(many)[:10_000]
    one_stop = ["a" * 30 + "c"]
    adversarial = ("a" * 30 + "b") * 600  # every 'b' walks 30 failure links back to the root
    for stops, stream in [(many_stops, text), (one_stop, text), (one_stop, adversarial)]:
        for chunk in (1, 3, 64):
            assert 1 <= steps_per_char(stops, stream, chunk) <= 2  # one edge + failure walks
