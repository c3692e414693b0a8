"""CUDA graphs for the steps that repeat: decodes, and decodes with one bounded prefill chunk.

On a GPU the engine's decode step is host-bound: the forward launches a few hundred kernels from
Python, and a Llama-3.1-8B step took ~12 ms on an H200 at every batch size against a 3.8 ms memory
floor (``data/gpu/h200/``). A CUDA graph records the launches of one step once and replays them
with a single call. As vLLM and SGLang do, one graph is captured per padded shape at start-up: a
step is padded up to the smallest captured shape that holds it (:func:`shape_for`; the padding is
:func:`cadenza.node.runner.step_inputs.fill`'s), its inputs are written in place into the graph's
fixed buffers, and the graph is replayed. Steps no shape holds (a large prefill, several chunks, a
live reconfiguration past the captured sizes) run eagerly, as every step does with graphs off.

Shapes (:func:`graph_shapes`): decode-only steps of ``b`` rows for each bucket ``b`` of
:func:`decode_buckets` (1, 2, 4, 8, 16, 24, 32, ... up to ``max_num_seqs``); and, where the step's
piggybacked chunk is small enough to pay for its padding, ``b`` decode rows
(:func:`mixed_decode_buckets`) plus one chunk of at most ``c`` tokens for each chunk bucket ``c``
(:func:`chunk_buckets`, up to ``MAX_GRAPH_CHUNK``), as ``(b + 2, b + c + 1, c)``: the chunk row,
and one padding row at least.

What makes the kernels capture-safe: no host reads of device values inside the forward (the
attention grid is sized by the shape's ``max_query_len``, a host int), launch grids fixed by the
shape, every buffer's address fixed (inputs here, the KV cache and weights allocated once), and
intermediates from the graphs' shared memory pool. Capture runs largest shape first, so smaller
graphs reuse the pool, and stops when the pool passes ``memory_budget`` bytes or the capture its
``time_budget_s``; its time and memory are logged. A graph ends at the hidden states of the rows that sample, copied into one buffer all
graphs share: the LM head and sampling run after the replay, for the real rows only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from cadenza.node.core.config import CUDA_GRAPH_MAX_CHUNK, CUDA_GRAPH_MAX_ROWS
from cadenza.node.runner.step_inputs import GraphShape, InputBuffers, Layout, StepRows

logger = logging.getLogger(__name__)

MAX_GRAPH_ROWS = CUDA_GRAPH_MAX_ROWS  # the largest decode bucket captured, whatever max_num_seqs says (vLLM: 512)
MAX_GRAPH_CHUNK = CUDA_GRAPH_MAX_CHUNK  # the largest prefill chunk a mixed-step graph carries
MIN_GRAPH_CHUNK = 16
DEFAULT_MEMORY_BUDGET = 2 << 30  # bytes of graph memory pool captured at most
DEFAULT_TIME_BUDGET_S = 60.0  # seconds of capture at start-up at most
_UNKNOWN = object()
_CAPTURE_LOCK = threading.Lock()  # torch captures one graph at a time per process

Forward = Callable[[tuple, GraphShape], torch.Tensor]  # (device input views, shape) -> hidden [rows, H]


def decode_buckets(max_rows: int) -> list[int]:
    """Row counts a decode graph is captured for: 1, 2, 4, 8, then every multiple of 8, up to
    ``min(max_rows, MAX_GRAPH_ROWS)`` (which is always included).

    Raises:
        ValueError: ``max_rows < 1``.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    top = min(max_rows, MAX_GRAPH_ROWS)
    buckets = [b for b in (1, 2, 4) if b < top] + list(range(8, top, 8))
    return buckets + [top]


def chunk_buckets(max_chunk: int) -> list[int]:
    """Chunk sizes a mixed-step graph is captured for: 16, 32, 64, then every multiple of 64, and
    ``min(max_chunk, MAX_GRAPH_CHUNK)`` itself, the size of every full chunk (none below
    ``MIN_GRAPH_CHUNK``). A chunk pads to the next one: at most 63 tokens of padding past 64,
    where the step's compute starts to count."""
    top = min(max_chunk, MAX_GRAPH_CHUNK)
    if top < MIN_GRAPH_CHUNK:
        return []
    return sorted({c for c in (16, 32) if c <= top} | set(range(64, top + 1, 64)) | {top})


def mixed_decode_buckets(max_rows: int) -> list[int]:
    """Decode rows of the mixed-step graphs: powers of two up to ``min(max_rows, MAX_GRAPH_ROWS)``
    (which is included). Coarser than :func:`decode_buckets`: next to a chunk, padded decode rows
    cost little, and each one multiplies the chunk buckets."""
    top = min(max_rows, MAX_GRAPH_ROWS)
    return [1 << i for i in range(top.bit_length()) if 1 << i < top] + [top]


def graph_shapes(max_num_seqs: int, token_budget: int, max_chunk: int, max_model_len: int,
                 mixed: bool = True) -> list[GraphShape]:
    """Every shape to capture: the decode shapes, then the mixed ones, each largest first (the
    pool sized by the first is reused by the rest; a capture cut short by its budget loses the
    mixed shapes, not the small decodes, where graphs pay most).

    Args:
        max_num_seqs: most rows a step has.
        token_budget: most tokens a step has (a chunk is never larger).
        max_chunk: the largest chunk the scheduler cuts (its effective chunk size).
        max_model_len: the longest sequence: a padding row's positions stay below it.
        mixed: also capture decode-plus-one-chunk shapes.
    """
    max_chunk = min(max_chunk, max_model_len)
    decode = decode_buckets(max_num_seqs)
    shapes = [GraphShape(b, b, 1) for b in reversed(decode) if b <= token_budget]
    if mixed:
        shapes += sorted((GraphShape(b + 2, b + c + 1, c) for b in mixed_decode_buckets(max_num_seqs)
                          for c in chunk_buckets(min(max_chunk, token_budget)) if b < token_budget),
                         key=lambda s: (s.tokens, s.rows), reverse=True)
    return shapes


def shape_for(rows: StepRows, shapes: Sequence[GraphShape]) -> GraphShape | None:
    """The smallest captured shape that holds ``rows`` (fewest tokens, then rows), or None.

    A decode-only step fits a decode shape of at least its rows; a step of decodes and exactly one
    chunk fits a mixed shape whose decode part and chunk are at least its own.
    """
    num_chunks = rows.num_rows - rows.num_decodes
    if num_chunks > 1:
        return None
    best = None
    for shape in shapes:
        if num_chunks == 0:
            fits = shape.max_query_len == 1 and shape.rows >= rows.num_rows
        else:
            chunk = int(rows.counts[-1])
            fits = (shape.max_query_len > 1 and shape.rows - 2 >= rows.num_decodes
                    and shape.max_query_len >= chunk)
        if fits and (best is None or (shape.tokens, shape.rows) < (best.tokens, best.rows)):
            best = shape
    return best


class StepGraphs:
    """The captured step graphs of one model runner, and their fixed input buffers.

    Args:
        device: the runner's device.
        block_size: tokens per KV block.
        scratch_block: the KV block padding tokens write to (never handed out).
        table_width: block-table width of every graph (blocks of the longest sequence).
        shapes: the shapes to capture (:func:`graph_shapes`).
        memory_budget: bytes of graph memory pool past which capture stops (smaller shapes then
            run eagerly).
        time_budget_s: seconds of capture past which it stops, likewise.
        record: ``"cuda"`` captures CUDA graphs; ``"eager"`` runs the same forward on the same
            fixed, padded buffers at every replay: everything but the capture itself, for tests on
            a CPU.
    """

    def __init__(self, device: torch.device, block_size: int, scratch_block: int, table_width: int,
                 shapes: Sequence[GraphShape], memory_budget: int = DEFAULT_MEMORY_BUDGET, record: str = "cuda",
                 time_budget_s: float = DEFAULT_TIME_BUDGET_S) -> None:
        if record not in ("cuda", "eager"):
            raise ValueError(f"record must be 'cuda' or 'eager', got {record!r}")
        self.device, self.width, self.record = device, table_width, record
        self.block_size, self.scratch_block = block_size, scratch_block
        self.memory_budget, self.time_budget_s = memory_budget, time_budget_s
        self._wanted = list(shapes)
        largest = [self.layout(s) for s in self._wanted] or [Layout(0, 0, 0, 0)]
        self.inputs = InputBuffers(device, max(l.int64_size for l in largest), max(l.int32_size for l in largest),
                                   growable=False)
        self._graphs: dict[GraphShape, Callable[[], None]] = {}
        # (decode rows, chunk rows, tokens of a lone chunk) -> the shape that holds such a step, or None
        self._shape_of: dict[tuple[int, int, int], GraphShape | None] = {}
        self._out: torch.Tensor | None = None
        self._index: dict[GraphShape, int] = {}  # each captured shape's place in capture order
        self.capture_seconds = 0.0
        self.pool_bytes = 0

    def layout(self, shape: GraphShape) -> Layout:
        """A graph's layout: logits for every row (the sampled ones first)."""
        return Layout(shape.tokens, shape.rows, shape.rows, self.width)

    @property
    def shapes(self) -> list[GraphShape]:
        """The shapes captured."""
        return list(self._graphs)

    def capture(self, forward: Forward, least: Callable[[int], int] | None = None) -> None:
        """Capture a graph of ``forward`` for each shape in order, within the memory and time budgets.

        ``least(state)`` (tensor parallelism) is called once after each shape with this rank's
        state — 2 captured and within its budgets, 1 captured and out of budget, 0 failed — and
        returns the least over the ranks: every rank then keeps the same shapes (one that a rank
        failed is dropped by all) and stops at the same one, so each can replay the graph rank 0
        names, and no rank waits in a collective the others left.

        ``forward(views, shape)`` runs one step on the device views of the fixed buffers and
        returns the hidden states ``[shape.rows, H]`` of its logits rows; each graph copies them
        into one output buffer that all graphs share (one graph's output is read before the next
        replays). Each shape runs once eagerly first, on the capture stream (Triton compiles its
        kernels, the allocator settles), then is recorded. Past a budget, or at an error, capture
        stops and the graphs already captured stay: the other steps run eagerly.
        """
        with _CAPTURE_LOCK:  # one capture at a time in a process (engines in threads share it)
            start = time.perf_counter()
            cuda = self.record == "cuda"
            if cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
                pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
                before = torch.cuda.memory_reserved(self.device)
            for shape in self._wanted:
                views = self.inputs.views(self.layout(shape))
                try:
                    self._neutral(shape)
                    if self._out is None:  # the largest shape comes first: size the shared output from it
                        hidden = forward(views, shape)
                        rows = max(s.rows for s in self._wanted)
                        self._out = torch.empty((rows, *hidden.shape[1:]), dtype=hidden.dtype, device=self.device)
                    self._graphs[shape] = self._capture_cuda(forward, views, shape, pool, stream) if cuda else (
                        lambda v=views, s=shape: self._out[: s.rows].copy_(forward(v, s)))
                except Exception as exc:  # noqa: BLE001 - any failure: keep what is captured, run the rest eagerly
                    if cuda:
                        torch.cuda.set_stream(torch.cuda.default_stream(self.device))
                    logger.warning("CUDA graphs: capturing %s failed (%s: %s); %d shapes captured, the rest run "
                                   "eagerly", shape, type(exc).__name__, exc, len(self._graphs))
                    if least is not None:
                        least(0)
                    break
                if cuda:
                    self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
                within = True
                if self.pool_bytes > self.memory_budget:
                    logger.warning("CUDA graphs: %.0f MiB of pool passes the budget of %.0f MiB after %s; the "
                                   "shapes left run eagerly", self.pool_bytes / 2**20, self.memory_budget / 2**20,
                                   shape)
                    within = False
                elif time.perf_counter() - start > self.time_budget_s:
                    logger.warning("CUDA graphs: capture passed its %.0f s after %s; the shapes left run eagerly",
                                   self.time_budget_s, shape)
                    within = False
                state = 2 if within else 1
                if least is not None and (state := least(state)) == 0:
                    del self._graphs[shape]  # another rank failed it: no rank may replay it
                    logger.warning("CUDA graphs: another tensor-parallel rank could not capture %s; the shapes "
                                   "left run eagerly", shape)
                if state < 2:
                    break
            self.capture_seconds = time.perf_counter() - start
            self._index = {shape: i for i, shape in enumerate(self._graphs)}
        logger.info("CUDA graphs (%s): %d of %d shapes captured in %.2f s, %.0f MiB of memory pool",
                    self.record, len(self._graphs), len(self._wanted), self.capture_seconds, self.pool_bytes / 2**20)

    def _capture_cuda(self, forward: Forward, views: tuple, shape: GraphShape, pool, stream) -> Callable[[], None]:
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            forward(views, shape)  # warm-up: compiles the kernels for this shape
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self._out[: shape.rows].copy_(forward(views, shape))
        return graph.replay

    def _neutral(self, shape: GraphShape) -> None:
        """Fill the buffers with a step of padding only: valid indices, KV writes to the scratch block."""
        empty = np.empty(0, dtype=np.int64)
        self.inputs.prepare(StepRows(empty, empty, empty, [], [], [], 0), self.layout(shape), self.block_size,
                            self.scratch_block)

    def run(self, rows: StepRows, announce: Callable[[int, int, Layout], None] | None = None) -> torch.Tensor | None:
        """Run ``rows`` through the smallest captured graph that holds it.

        ``announce(shape index, sampled rows, layout)`` is called once the graph's inputs are
        filled, before the replay (tensor parallelism: rank 0 broadcasts them, and every worker
        replays the same graph, :meth:`replay`).

        Returns:
            ``[len(rows.sampled), H]`` hidden states of the sampled rows' last tokens (a view of
            the shared output, valid until the next replay), or None when no captured shape
            holds the step.
        """
        chunks = rows.num_rows - rows.num_decodes
        key = (rows.num_decodes, chunks, int(rows.counts[-1]) if chunks == 1 else 0)  # all shape_for reads
        shape = self._shape_of.get(key, _UNKNOWN)
        if shape is _UNKNOWN:  # a scan of every shape (~10-25 us): once per composition
            if len(self._shape_of) >= 1 << 16:
                self._shape_of.clear()
            shape = self._shape_of[key] = shape_for(rows, self._graphs)
        if shape is None or max(map(len, rows.tables)) > self.width:
            return None
        layout = self.layout(shape)
        self.inputs.prepare(rows, layout, self.block_size, self.scratch_block)
        if announce is not None:
            announce(self._index[shape], len(rows.sampled), layout)
        self._graphs[shape]()
        return self._out[: len(rows.sampled)]

    def replay(self, index: int, num_sampled: int, write: Callable[[torch.Tensor, torch.Tensor], object]) -> torch.Tensor:
        """A tensor-parallel worker's side of :meth:`run`: let ``write(host64, host32)`` fill the
        inputs of the ``index``-th captured graph (the arrays rank 0 broadcast), replay it, and
        return the hidden states of its ``num_sampled`` sampled rows."""
        shape = list(self._graphs)[index]
        self.inputs.load(self.layout(shape), write)
        self._graphs[shape]()
        return self._out[:num_sampled]
