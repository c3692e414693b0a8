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
from cadenza.node.core.request import Request, RequestStatus


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


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes: decode rows first, then prefill rows.

    Attributes:
        rows: every row, in the order the runner lays out the batch.
        num_decode_tokens, num_prefill_tokens: tokens of each kind.
        decode_context_tokens: tokens the decodes attend over (sum of their lengths).
        prefill_attention_tokens: the chunks' attention work (tokens x mean context).
        preempted: requests preempted while building the step.
        prefill_rows: the prefill chunks among ``rows``.
        admitted: ``(request, phase, seconds queued)`` of requests that started running;
            phase ``admission`` or ``resume``.
        predicted_seconds: the cost model's step time for these rows (None: uncalibrated).
    """

    rows: list[ScheduledRow]
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    decode_context_tokens: int = 0
    prefill_attention_tokens: float = 0.0
    preempted: list[Request] = field(default_factory=list)
    prefill_rows: list[ScheduledRow] = field(default_factory=list)
    admitted: list[tuple[Request, str, float]] = field(default_factory=list)
    predicted_seconds: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        return not self.rows

    def features(self) -> StepFeatures:
        """The step's composition, for the cost model."""
        return StepFeatures(self.num_prefill_tokens, self.num_decode_tokens, self.decode_context_tokens,
                            self.prefill_attention_tokens)


class Step:
    """A step being built: its rows, what is left of the budget, refunds on preemption.

    Decode rows are only appended to ``out.rows`` (the hot path: hundreds per step); prefill rows
    are also indexed in ``prefills`` by request id.
    """

    def __init__(self, budget: int) -> None:
        self.out = SchedulerOutput(rows=[])
        self.budget_left = budget
        self.prefills: dict[str, ScheduledRow] = {}

    def add_prefill(self, req: Request, start: int, n: int, table: list[int]) -> None:
        row = new_row(ScheduledRow, (req, start, n, start + n == len(req.token_ids), table))
        self.out.rows.append(row)
        self.prefills[req.request_id] = row
        self.budget_left -= n
        self.out.num_prefill_tokens += n
        self.out.prefill_attention_tokens += n * (start + n / 2)

    def unschedule(self, req: Request) -> tuple[int, bool]:
        """Remove ``req``'s row (a preemption victim): ``(tokens refunded, was a prefill chunk)``."""
        out = self.out
        row = self.prefills.pop(req.request_id, None)
        if row is not None:
            out.rows.remove(row)
            out.num_prefill_tokens -= row.num_tokens
            out.prefill_attention_tokens -= row.num_tokens * (row.start + row.num_tokens / 2)
            self.budget_left += row.num_tokens
            return row.num_tokens, True
        for i, row in enumerate(out.rows):
            if row.request is req:  # a decode row
                del out.rows[i]
                out.num_decode_tokens -= 1
                out.decode_context_tokens -= row.start + 1
                self.budget_left += 1
                return 1, False
        return 0, False


class TokenUpdate(NamedTuple):
    """A token sampled in a step, and the finished status it caused (None if still running)."""

    request: Request
    token_id: int
    finished: RequestStatus | None
