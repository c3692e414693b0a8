"""Step data: what one step computes, and the step being built.

A step is a list of rows; a row is one request's slice of tokens ``[start, start + num_tokens)``.
A row that reaches the end of the request's tokens samples the next one (``sample``): a decode is
a row of one token, a prefill chunk a row of many. The model runner reads only these types of the
scheduler (the layering test holds it to that). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from cadenza.node.core.cost_model import StepFeatures
from cadenza.node.core.request import Request


class ScheduledRow(NamedTuple):
    """One request's slice of a step: tokens ``[start, start + num_tokens)`` are computed.

    ``sample`` is True when the row reaches the end of the request's tokens, so the model runner
    samples the next token from the row's last position. ``block_table`` is the request's table
    as the block manager holds it (the runner reads it even if the request is aborted mid-step).
    """

    request: Request
    start: int
    num_tokens: int
    sample: bool
    block_table: list[int]


new_row = tuple.__new__  # builds a row without a Python-level __new__ call (hot path)


# The step table's columns, one row a step: what ``cadenza serve --step-log`` writes
# (:mod:`cadenza.node.frontend.step_log`, from each step's record) and ``cadenza sim calibrate``
# reads; the last is optional.
STEP_LOG_FIELDS = ("prefill_tokens", "decode_tokens", "decode_context_tokens", "prefill_attention_tokens",
                   "num_rows", "num_sampled", "seconds", "host_seconds")

@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes: decode rows first, then prefill rows.

    Decode rows are held as three parallel lists rather than a row object each (the hot path:
    hundreds per step): decode ``i`` computes the one token of ``decodes[i]`` at position
    ``decode_positions[i]`` (its last, sampled token) with block table ``decode_tables[i]``, and
    samples. :attr:`rows` gives every row as a :class:`ScheduledRow`, in batch order.

    Attributes:
        decodes, decode_positions, decode_tables: the decode rows, in running order.
        prefill_rows: the prefill chunks, after the decodes in the batch.
        num_decode_tokens, num_prefill_tokens: tokens of each kind.
        decode_context_tokens: tokens the decodes attend over (sum of their lengths).
        prefill_attention_tokens: the chunks' attention work (tokens x mean context).
        preempted: requests preempted while building the step.
        admitted: ``(request, phase, seconds queued)`` of requests that started running;
            phase ``admission`` or ``resume``.
        predicted_seconds: the cost model's step time for these rows (None: uncalibrated).
    """

    decodes: list[Request] = field(default_factory=list)
    decode_positions: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    prefill_rows: list[ScheduledRow] = field(default_factory=list)
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    decode_context_tokens: int = 0
    prefill_attention_tokens: float = 0.0
    preempted: list[Request] = field(default_factory=list)
    admitted: list[tuple[Request, str, float]] = field(default_factory=list)
    predicted_seconds: float | None = None

    @property
    def rows(self) -> list[ScheduledRow]:
        """Every row in batch order, decodes first (built on each call: for tools and tests)."""
        decodes = [ScheduledRow(req, pos, 1, True, table)
                   for req, pos, table in zip(self.decodes, self.decode_positions, self.decode_tables)]
        return decodes + self.prefill_rows

    @property
    def num_rows(self) -> int:
        return len(self.decodes) + len(self.prefill_rows)

    @property
    def num_sampled(self) -> int:
        """Rows that sample a token: every decode, and the chunks that finish a prompt."""
        return len(self.decodes) + sum(row.sample for row in self.prefill_rows)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefill_rows

    def features(self) -> StepFeatures:
        """The step's composition, for the cost model."""
        return StepFeatures(self.num_prefill_tokens, self.num_decode_tokens, self.decode_context_tokens,
                            self.prefill_attention_tokens)


class Step:
    """A step being built: its rows, what is left of the budget, refunds on preemption.

    Prefill rows are also indexed in ``prefills`` by request id (a victim's chunk is found at once).
    """

    def __init__(self, budget: int) -> None:
        self.out = SchedulerOutput()
        self.budget_left = budget
        self.prefills: dict[str, ScheduledRow] = {}

    def add_prefill(self, req: Request, start: int, n: int, table: list[int]) -> None:
        row = new_row(ScheduledRow, (req, start, n, start + n == len(req.token_ids), table))
        self.out.prefill_rows.append(row)
        self.prefills[req.request_id] = row
        self.budget_left -= n
        self.out.num_prefill_tokens += n
        self.out.prefill_attention_tokens += n * (start + n / 2)

    def unschedule(self, req: Request) -> tuple[int, bool]:
        """Remove ``req``'s row (a preemption victim): ``(tokens refunded, was a prefill chunk)``."""
        out = self.out
        row = self.prefills.pop(req.request_id, None)
        if row is not None:
            out.prefill_rows.remove(row)
            out.num_prefill_tokens -= row.num_tokens
            out.prefill_attention_tokens -= row.num_tokens * (row.start + row.num_tokens / 2)
            self.budget_left += row.num_tokens
            return row.num_tokens, True
        for i, scheduled in enumerate(out.decodes):
            if scheduled is req:
                del out.decodes[i]
                out.decode_context_tokens -= out.decode_positions.pop(i) + 1
                del out.decode_tables[i]
                out.num_decode_tokens -= 1
                self.budget_left += 1
                return 1, False
        return 0, False
