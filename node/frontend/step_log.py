"""The step log: one JSON line per engine step, its composition and its measured seconds.

This is the table ``cadenza sim calibrate`` fits a hardware profile from
(:mod:`cadenza.sim.calibrate`); ``cadenza serve --step-log PATH`` writes it. Each line holds
:data:`STEP_LOG_FIELDS`: tokens by kind, the context the decode rows attend over, the prefill
chunks' query-key pairs (``sum n (start + n/2)``), rows, rows that sampled, and the forward pass's
wall seconds as the core measured them (``runner.execute``), and the scheduler's own seconds in
the step beside them (``host_seconds``).
Each line is flushed as it is written (``tail -f`` shows every step as it ends; a flush is a
write call, microseconds against a step's milliseconds).
"""

from __future__ import annotations

import json
from pathlib import Path

from cadenza.node.core.messages import StepRecord
from cadenza.node.core.step import STEP_LOG_FIELDS

__all__ = ["STEP_LOG_FIELDS", "StepLog"]


class StepLog:
    """Appends one line per step to ``path`` (created with its parent folders).

    Raises:
        ValueError: the file cannot be opened for appending (the message says why).
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"--step-log {path}: cannot append to it ({exc.strerror or exc})") from None
        self.path = path

    def write(self, step: StepRecord) -> None:
        row = (step.num_prefill_tokens, step.num_decode_tokens, step.decode_context_tokens,
               step.prefill_attention_tokens, step.num_rows, step.num_sampled, step.seconds, step.host_seconds)
        self._file.write(json.dumps(dict(zip(STEP_LOG_FIELDS, row))) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
