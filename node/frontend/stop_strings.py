"""Stop-string matching over a text stream: one Aho–Corasick automaton per request.

The stop strings are built once into a trie with *failure links* (Aho & Corasick, "Efficient
string matching: an aid to bibliographic search", CACM 18(6), 1975). Each node is a string that
is a prefix of some stop; its failure link points to the node of its longest proper suffix that
is also such a prefix. Feeding a character follows one trie edge, after walking failure links
until one exists; the walk only ever shortens the current prefix, which grew by at most one per
character, so the work is amortised O(1) per character and independent of the number of stops.

After any text, the state is the node of the longest suffix of that text that is a prefix of a
stop: its depth is exactly how many characters may still begin a stop (and must be held back).
Each node also keeps its first *output*: the longest stop that is a suffix of the node's string,
found on itself or through its dictionary link (the nearest stop on its failure chain). Only that
one matters here — among stops that complete at the same character the longest starts earliest —
so a match costs O(1) too. Building is O(total length of the stop strings). No torch here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

_ROOT = 0  # the node of the empty string


class StopMatch(NamedTuple):
    """The first stop string to complete in a fed chunk.

    ``end`` is the index in that chunk just past the stop's last character (characters); the
    stop may have started in earlier chunks, ``len(stop) - end`` characters before this one.
    """

    end: int
    stop: str


class StopStringMatcher:
    """Finds the first stop string to complete in a text fed chunk by chunk.

    Args:
        stops: the stop strings (non-empty; duplicates are fine).

    Raises:
        ValueError: a stop string is empty.

    The stop that *completes first* wins; of those completing at the same character, the
    longest (the one that starts earliest). ``feed`` consumes each chunk once; ``held`` then says
    how many trailing characters of the text so far could still begin a stop.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self._goto: list[dict[str, int]] = [{}]  # node -> char -> child node
        self._depth: list[int] = [0]  # node -> length of its string (characters)
        self._stop: list[str | None] = [None]  # node -> its string, if that is a stop
        for stop in stops:
            if not stop:
                raise ValueError("stop strings must be non-empty")
            self._insert(stop)
        self._fail: list[int] = [_ROOT] * len(self._goto)
        self._output: list[str | None] = list(self._stop)  # node -> longest stop it ends with
        self._link_failures()
        self._state = _ROOT
        self.steps = 0  # edges and failure links followed by ``feed`` (a work counter)

    @property
    def held(self) -> int:
        """Length of the longest suffix of the text fed so far that is a proper prefix of a stop.

        These characters must be held back. Meaningless after a match (stop feeding then).
        """
        return self._depth[self._state]

    def feed(self, chunk: str) -> StopMatch | None:
        """Consume ``chunk``; return the first stop to complete in it, or None.

        On a match the rest of the chunk is not consumed. Amortised O(1) per character.
        """
        goto, fail, output = self._goto, self._fail, self._output
        state, steps = self._state, 0
        for index, char in enumerate(chunk):
            child = goto[state].get(char)
            while child is None and state != _ROOT:
                state = fail[state]
                steps += 1
                child = goto[state].get(char)
            state = _ROOT if child is None else child
            steps += 1
            stop = output[state]
            if stop is not None:
                self._state, self.steps = state, self.steps + steps
                return StopMatch(index + 1, stop)
        self._state, self.steps = state, self.steps + steps
        return None

    def _insert(self, stop: str) -> None:
        node = _ROOT
        for char in stop:
            child = self._goto[node].get(char)
            if child is None:
                child = len(self._goto)
                self._goto[node][char] = child
                self._goto.append({})
                self._depth.append(self._depth[node] + 1)
                self._stop.append(None)
            node = child
        self._stop[node] = stop

    def _link_failures(self) -> None:
        """Breadth-first: a node's failure link and output come from shallower nodes."""
        goto, fail, output = self._goto, self._fail, self._output
        queue = deque(goto[_ROOT].values())  # depth-1 nodes fail to the root
        while queue:
            node = queue.popleft()
            for char, child in goto[node].items():
                link = fail[node]
                while char not in goto[link] and link != _ROOT:
                    link = fail[link]
                fail[child] = goto[link].get(char, _ROOT)
                if output[child] is None:
                    output[child] = output[fail[child]]  # the dictionary link's stop
                queue.append(child)
