"""A step's input arrays: built with numpy into persistent host buffers, copied to the device in two.

The model reads seven index arrays a step (:class:`~cadenza.node.runner.backend.AttentionMetadata`
and the token ids, positions and logits rows). Building each with ``torch.tensor(list)`` and a
synchronous ``.to(device)`` costs a host-device round trip apiece, on the critical path of every
step. Instead they live in two persistent buffers, one int64 and one int32, laid out back to back
for the step's sizes (:class:`Layout`): the host fills them with vectorised numpy operations, and
one non-blocking copy per buffer (from pinned memory on a CUDA device) moves the used part. On the
CPU the host buffer *is* the device buffer: nothing is copied.

Padding to a CUDA graph's shape (:class:`GraphShape`) happens here too, so it is tested on the CPU:
a graph runs a fixed number of rows and tokens, and the step's own rows are followed by padding
rows — one token each, the last taking any spare tokens — whose tokens sit in the KV cache's
scratch block (a block the block manager never hands out) and whose rows are never sampled. Rows
are independent in every op the model runs, so padding changes nothing in the real rows.

Invariants: a row's tokens ``[start, start + count)`` sit in slots
``table[pos // block_size] * block_size + pos % block_size``; ``query_start_loc`` is the running
sum of the counts from 0; ``seq_lens = starts + counts``; ``logits_index[i]`` is the last token of
the ``i``-th sampled row (then zeros, up to a graph's row count).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from cadenza.node.core.step import SchedulerOutput


class GraphShape(NamedTuple):
    """The fixed sizes of one captured step: ``rows`` rows of ``tokens`` tokens in all, none longer
    than ``max_query_len`` (1 for a decode-only step)."""

    rows: int
    tokens: int
    max_query_len: int


@dataclass(slots=True)
class StepRows:
    """A step flattened, host side: row ``i`` computes tokens ``[starts[i], starts[i] + counts[i])``.

    Attributes:
        token_ids: ``[T]`` int64 the tokens computed, row after row.
        starts, counts: ``[S]`` int64.
        tables: ``S`` block tables.
        sampled: indices of the rows that sample, in row order.
        sampled_requests: their requests.
        num_decodes: rows that are decodes (the first ones).
    """

    token_ids: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    tables: list[list[int]]
    sampled: list[int]
    sampled_requests: list
    num_decodes: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_rows(self) -> int:
        return len(self.starts)

    @property
    def max_query_len(self) -> int:
        return int(self.counts.max())

    @property
    def sample_positions(self) -> list[int]:
        """The position of the token each sampled row samples (its row's end)."""
        return (self.starts[self.sampled] + self.counts[self.sampled]).tolist()


def step_rows(step: SchedulerOutput) -> StepRows:
    """The rows of ``step``, decodes first (every decode samples)."""
    decodes, chunks = step.decodes, step.prefill_rows
    num_decodes = len(decodes)
    num_rows = num_decodes + len(chunks)
    ids = [req.token_ids[pos] for req, pos in zip(decodes, step.decode_positions)]
    starts = np.empty(num_rows, dtype=np.int64)
    counts = np.ones(num_rows, dtype=np.int64)
    starts[:num_decodes] = step.decode_positions
    sampled, sampled_reqs = list(range(num_decodes)), list(decodes)
    for i, (req, start, n, do_sample, _table) in enumerate(chunks, num_decodes):
        ids.extend(req.token_ids[start : start + n])
        starts[i] = start
        counts[i] = n
        if do_sample:
            sampled.append(i)
            sampled_reqs.append(req)
    tables = step.decode_tables + [row.block_table for row in chunks]
    return StepRows(np.asarray(ids, dtype=np.int64), starts, counts, tables, sampled, sampled_reqs, num_decodes)


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Layout(NamedTuple):
    """Where each array sits in the two buffers, for ``tokens`` tokens, ``logits`` logits rows,
    ``rows`` rows and block tables ``width`` wide.

    Every array starts on 16 bytes, as a separate allocation would: Triton specialises a kernel
    on its pointers' 16-byte alignment, so an unaligned view would compile (and run) another
    variant of the kernel.
    """

    tokens: int
    logits: int
    rows: int
    width: int

    @property
    def int64_size(self) -> int:
        return 3 * _up(self.tokens, 2) + self.logits

    @property
    def int32_size(self) -> int:
        return _up(self.rows + 1, 4) + _up(self.rows, 4) + self.rows * self.width

    def int64_views(self, buf):
        """``input_ids, positions, slot_mapping [T], logits_index [L]`` of an int64 buffer."""
        t, step = self.tokens, _up(self.tokens, 2)
        return buf[:t], buf[step : step + t], buf[2 * step : 2 * step + t], buf[3 * step : 3 * step + self.logits]

    def int32_views(self, buf):
        """``query_start_loc [S + 1], seq_lens [S], block_tables [S, W]`` of an int32 buffer."""
        s = self.rows
        lens_at = _up(s + 1, 4)
        tables_at = lens_at + _up(s, 4)
        tables = buf[tables_at : tables_at + s * self.width]
        return buf[: s + 1], buf[lens_at : lens_at + s], tables.reshape(s, self.width)


def fill(rows: StepRows, layout: Layout, int64: np.ndarray, int32: np.ndarray, block_size: int,
         scratch_block: int) -> None:
    """Write ``rows`` into the buffers at ``layout``, padded to its sizes.

    Args:
        rows: the step.
        layout: its sizes: at least the step's; larger sizes are padded (a graph's shape).
        int64, int32: host buffers of at least ``layout.int64_size`` / ``int32_size`` elements.
        block_size: tokens per KV block.
        scratch_block: the KV block padding tokens are written to.

    Raises:
        ValueError: a layout too small for the step, or whose padding does not fit
            (``layout.tokens - T`` spare tokens need ``layout.rows - S >= 1`` spare rows).
    """
    t, s = rows.num_tokens, rows.num_rows
    spare_tokens, spare_rows = layout.tokens - t, layout.rows - s
    if spare_tokens < spare_rows or spare_rows < 0 or (spare_tokens and not spare_rows) or layout.logits < len(rows.sampled):
        raise ValueError(f"a step of {s} rows and {t} tokens ({len(rows.sampled)} sampled) does not fit {layout}")
    used = max(map(len, rows.tables), default=0)
    if used > layout.width:
        raise ValueError(f"a block table of {used} blocks is wider than {layout.width}")
    ids, positions, slots, logits_index = layout.int64_views(int64)
    query_start, seq_lens, tables = layout.int32_views(int32)
    starts, counts = rows.starts, rows.counts
    if spare_rows:  # one token per padding row, the last one taking what is left
        pad_counts = np.ones(spare_rows, dtype=np.int64)
        pad_counts[-1] += spare_tokens - spare_rows
        starts = np.concatenate([starts, np.zeros(spare_rows, dtype=np.int64)])
        counts = np.concatenate([counts, pad_counts])
    query_start[0] = 0
    np.cumsum(counts, out=query_start[1:])
    seq_lens[:] = starts + counts
    # Only the columns a kernel can reach are written: the blocks below the step's longest sequence
    # (the torch reference gathers a group of rows up to its longest), so a graph's full-width
    # tables cost what the step's own do.
    reach = max(used, -(-int(counts[s:].max(initial=0)) // block_size))
    tables[:s, :reach] = 0
    for i, table in enumerate(rows.tables):
        tables[i, : len(table)] = table
    tables[s:, :reach] = scratch_block
    ids[:t] = rows.token_ids
    ids[t:] = 0
    row_of_token = np.repeat(np.arange(layout.rows), counts)
    positions[:] = np.arange(layout.tokens) - np.repeat(query_start[:-1].astype(np.int64) - starts, counts)
    slots[:] = tables[row_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    logits_index[: len(rows.sampled)] = query_start[1:][rows.sampled] - 1
    logits_index[len(rows.sampled):] = 0


class InputBuffers:
    """A persistent int64 and int32 buffer on the host (pinned on a CUDA device) and their device
    twins; :meth:`prepare` fills them for a step and starts the copies.

    Args:
        device: where the model runs.
        int64_size, int32_size: initial capacities in elements.
        growable: whether a step larger than the capacity reallocates (eager steps); a CUDA
            graph's buffers never move, since the graph holds their addresses.
    """

    def __init__(self, device: torch.device, int64_size: int, int32_size: int, growable: bool = True) -> None:
        self.device = device
        self.growable = growable
        self._pinned = device.type == "cuda"
        self._copied: torch.cuda.Event | None = None
        self._allocate(int64_size, int32_size)

    def _allocate(self, int64_size: int, int32_size: int) -> None:
        self.host64 = torch.zeros(int64_size, dtype=torch.int64, pin_memory=self._pinned)
        self.host32 = torch.zeros(int32_size, dtype=torch.int32, pin_memory=self._pinned)
        if self.device.type == "cpu":
            self.dev64, self.dev32 = self.host64, self.host32
        else:
            self.dev64 = torch.zeros(int64_size, dtype=torch.int64, device=self.device)
            self.dev32 = torch.zeros(int32_size, dtype=torch.int32, device=self.device)

    def prepare(self, rows: StepRows, layout: Layout, block_size: int, scratch_block: int):
        """Fill the host buffers for ``rows`` at ``layout`` and start their copies to the device.

        Returns:
            ``(input_ids, positions, slot_mapping, logits_index, query_start_loc, seq_lens,
            block_tables)``: device views, valid in stream order after this call.

        Raises:
            ValueError: as :func:`fill`; or a step over the capacity of fixed buffers.
        """
        return self.load(layout, lambda host64, host32: fill(rows, layout, host64.numpy(), host32.numpy(), block_size,
                                                             scratch_block))

    def load(self, layout: Layout, write) -> tuple:
        """Let ``write(host64, host32)`` fill the host buffers (at least ``layout``'s sizes) for a
        step laid out as ``layout``, then start their copies; the device views, as :meth:`prepare`.
        A tensor-parallel worker writes the arrays rank 0 broadcast (:mod:`.collectives`).

        Raises:
            ValueError: a step over the capacity of fixed buffers.
        """
        if layout.int64_size > self.host64.numel() or layout.int32_size > self.host32.numel():
            if not self.growable:
                raise ValueError(f"{layout} is over the capacity of fixed input buffers")
            self._wait_copied()
            self._allocate(max(layout.int64_size, 2 * self.host64.numel()),
                           max(layout.int32_size, 2 * self.host32.numel()))
        self._wait_copied()  # the last step's copies read the host buffers: never overwrite them early
        write(self.host64, self.host32)
        if self.dev64 is not self.host64:
            n64, n32 = layout.int64_size, layout.int32_size
            self.dev64[:n64].copy_(self.host64[:n64], non_blocking=True)
            self.dev32[:n32].copy_(self.host32[:n32], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self.views(layout)

    def views(self, layout: Layout):
        """The device views of ``layout`` (see :meth:`prepare`)."""
        return (*layout.int64_views(self.dev64), *layout.int32_views(self.dev32))

    def _wait_copied(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
