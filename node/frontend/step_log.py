"""The step log: one JSON line per engine step, its composition and its measured seconds.

This is the table ``cadenza sim calibrate`` fits a hardware profile from
(:mod:`cadenza.sim.calibrate`); ``cadenza serve --step-log PATH`` writes it. Each line holds
:data:`STEP_LOG_FIELDS`: tokens by kind, the context the decode rows attend over, the prefill
chunks' query-key pairs (``sum n (start + n/2)``), rows, rows that sampled, and the forward pass's
wall seconds as the core measured them (``runner.execute``), and the scheduler's own seconds in
the step beside them (``host_seconds``).
Lines are buffered and flushed at most once a second (``tail -f`` shows the steps as they run),
and when the log closes at server shutdown.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from cadenza.node.core.messages import StepRecord

FLUSH_PERIOD_S = 1.0
STEP_LOG_FIELDS = ("prefill_tokens", "decode_tokens", "decode_context_tokens", "prefill_attention_tokens",
                   "num_rows", "num_sampled", "seconds", "host_seconds")


class StepLog:
    """Appends one line per step to ``path`` (created with its parent folders).

    Raises:
        OSError: the file cannot be opened for appending.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")
        self._flushed = time.monotonic()

    def write(self, step: StepRecord) -> None:
        row = (step.num_prefill_tokens, step.num_decode_tokens, step.decode_context_tokens,
               step.prefill_attention_tokens, step.num_rows, step.num_sampled, step.seconds, step.host_seconds)
        self._file.write(json.dumps(dict(zip(STEP_LOG_FIELDS, row))) + "\n")
        now = time.monotonic()
        if now - self._flushed >= FLUSH_PERIOD_S:
            self._file.flush()
            self._flushed = now

    def close(self) -> None:
        self._file.close()
