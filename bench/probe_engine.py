"""The GPU probe's hands on the engine (:mod:`bench.gpu_probe`): a model folder of a shipped
model's shapes (its ``config.json`` only: the engine core draws the weights), and a driver that
queues requests of random tokens and times steps of the real scheduler and runner.
"""

from __future__ import annotations

import gc
import json
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from bench.probe_figures import model_json
from cadenza.node.engine.engine_core import EngineCore
from cadenza.node.core.messages import AddRequest, StepRecord
from cadenza.node.core.request import SamplingParams


def model_folder(name: str, root: Path) -> Path:
    """``root/NAME/config.json`` (:func:`model_json`), a folder the engine core builds the model
    from with drawn weights."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model_json(name)))
    return folder


def free_device() -> None:
    """Return a dropped engine's memory (its KV cache and weights) before the next is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Driver:
    """Requests into an engine core and timed steps out of it.

    Args:
        core: the engine core.
        sync: waits for the device (``torch.cuda.synchronize``; a no-op on the CPU).
    """

    def __init__(self, core: EngineCore, sync: Callable[[], None]) -> None:
        self.core, self.sync = core, sync
        self.rng = random.Random(0)
        self.count = 0

    def prompt(self, length: int) -> list[int]:
        """``length`` random token ids (distinct prompts: no two share a KV block)."""
        vocab = self.core.model_config.vocab_size
        return [self.rng.randrange(vocab) for _ in range(length)]

    def add(self, length: int, max_tokens: int, prompt: list[int] | None = None) -> str:
        """Queue a request of ``prompt`` (default: ``length`` random tokens), greedy, EOS
        ignored; its id."""
        self.count += 1
        rid = f"p{self.count}"
        prompt = self.prompt(length) if prompt is None else prompt
        self.core.add_request(AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                     ignore_eos=True)))
        return rid

    def streams(self, n: int, length: int, steps: int) -> list[str]:
        """``n`` requests of ``length`` prompt tokens, stepped until every one is decoding (has
        its first token), each able to decode ``steps`` tokens more: their ids."""
        chunks = -(-length // self.core.config.scheduler.effective_chunk_size)
        ids = [self.add(length, steps + n * chunks + 1) for _ in range(n)]  # the first decode while the rest fill
        started: set[str] = set()
        while len(started) < n:
            started.update(d.request_id for d in self.core.step()[0])
        return ids

    def stop(self, ids: Iterable[str]) -> None:
        for rid in ids:
            self.core.abort_request(rid)

    def timed_step(self, prefill: int, decode: int) -> tuple[float, StepRecord]:
        """One step between two device synchronisations, checked to hold ``prefill`` prefill and
        ``decode`` decode tokens: its wall seconds and its record.

        Raises:
            RuntimeError: the scheduler ran another step than the one expected.
        """
        self.sync()
        start = time.perf_counter()
        _deltas, record = self.core.step()
        self.sync()
        seconds = time.perf_counter() - start
        got = (0, 0) if record is None else (record.num_prefill_tokens, record.num_decode_tokens)
        if got != (prefill, decode):
            raise RuntimeError(f"a step of {got[0]} prefill + {got[1]} decode tokens where {prefill} + {decode} "
                               "were expected")
        return seconds, record

    def decode_steps(self, n: int, rows: int) -> tuple[float, list[StepRecord]]:
        """``n`` steps back to back (no synchronisation between them, as a serving loop runs),
        each checked to be a decode of ``rows`` rows: wall seconds per step, and the records.

        Raises:
            RuntimeError: a step that was not.
        """
        self.sync()
        start = time.perf_counter()
        records = [self.core.step()[1] for _ in range(n)]
        self.sync()
        elapsed = (time.perf_counter() - start) / n
        if any(r is None or r.num_prefill_tokens or r.num_decode_tokens != rows for r in records):
            raise RuntimeError(f"a timed step was not a decode of {rows} rows")
        return elapsed, records

