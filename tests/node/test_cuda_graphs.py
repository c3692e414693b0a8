"""CUDA graphs, all but the capture: shapes, padding, fixed buffers and the eager fallback, on a CPU.

``StepGraphs(record="eager")`` runs the very forward a graph would record, on the same fixed,
padded buffers, at every replay; so a step that takes a graph here computes what its replay would.
tests/node/test_cuda_graphs_gpu.py captures real graphs where there is a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cadenza.node.core.request import SamplingParams
from cadenza.node.frontend.llm import Engine
from cadenza.node.runner.cuda_graphs import (
    MAX_GRAPH_ROWS,
    chunk_buckets,
    decode_buckets,
    graph_shapes,
    mixed_decode_buckets,
    shape_for,
    StepGraphs,
)
from cadenza.node.runner.step_inputs import GraphShape, InputBuffers, Layout, StepRows, fill


def rows_of(counts: list[int], starts: list[int], tables: list[list[int]], sampled: list[int], num_decodes: int):
    ids = np.arange(100, 100 + sum(counts), dtype=np.int64)
    return StepRows(ids, np.asarray(starts, dtype=np.int64), np.asarray(counts, dtype=np.int64), tables, sampled,
                    [None] * len(sampled), num_decodes)


def test_decode_buckets_are_small_powers_then_multiples_of_eight_up_to_the_cap():
    assert decode_buckets(1) == [1]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(30) == [1, 2, 4, 8, 16, 24, 30]
    assert decode_buckets(10_000)[-1] == MAX_GRAPH_ROWS
    with pytest.raises(ValueError):
        decode_buckets(0)


def test_chunk_buckets_step_by_64_past_64_and_end_at_the_full_chunk():
    assert chunk_buckets(8) == []
    assert chunk_buckets(100) == [16, 32, 64, 100]  # a full 100-token chunk takes a graph of its own
    assert chunk_buckets(300) == [16, 32, 64, 128, 192, 256, 300]
    assert chunk_buckets(100_000)[-1] == 512
    assert mixed_decode_buckets(1) == [1] and mixed_decode_buckets(48) == [1, 2, 4, 8, 16, 32, 48]


def test_graph_shapes_come_decodes_first_each_kind_largest_first_chunks_within_the_budget():
    shapes = graph_shapes(max_num_seqs=32, token_budget=64, max_chunk=128, max_model_len=1024)
    assert GraphShape(32, 32, 1) in shapes and GraphShape(8 + 2, 8 + 32 + 1, 32) in shapes
    assert GraphShape(8 + 2, 8 + 64 + 1, 64) in shapes  # 8 decodes + a 56-token chunk fill the budget: a graph
    decode = [s for s in shapes if s.max_query_len == 1]
    assert shapes[: len(decode)] == decode and decode[-1] == GraphShape(1, 1, 1)
    for kind in (decode, shapes[len(decode):]):
        assert [s.tokens for s in kind] == sorted((s.tokens for s in kind), reverse=True)
    assert max(s.max_query_len for s in shapes) == 64
    assert all(s.max_query_len == 1 for s in graph_shapes(32, 64, 64, 1024, mixed=False))
    assert max(s.max_query_len for s in graph_shapes(32, 4096, 4096, max_model_len=100)) <= 100


def test_a_step_takes_the_smallest_shape_that_holds_it_or_none():
    shapes = graph_shapes(max_num_seqs=32, token_budget=600, max_chunk=512, max_model_len=1024)
    decode5 = rows_of([1] * 5, [10] * 5, [[1]] * 5, list(range(5)), 5)
    assert shape_for(decode5, shapes) == GraphShape(8, 8, 1)
    mixed = rows_of([1] * 5 + [20], [10] * 5 + [0], [[1]] * 6, list(range(5)), 5)
    assert shape_for(mixed, shapes) == GraphShape(8 + 2, 8 + 32 + 1, 32)
    big_chunk = rows_of([1] * 5 + [130], [10] * 5 + [0], [[1]] * 6, list(range(5)), 5)
    assert shape_for(big_chunk, shapes) == GraphShape(8 + 2, 8 + 192 + 1, 192)
    two_chunks = rows_of([1, 20, 20], [3, 0, 0], [[1]] * 3, [0], 1)
    assert shape_for(two_chunks, shapes) is None
    too_long = rows_of([1, 600], [3, 0], [[1]] * 2, [0], 1)
    assert shape_for(too_long, shapes) is None
    assert shape_for(rows_of([1] * 40, [1] * 40, [[1]] * 40, list(range(40)), 40), shapes) is None


def test_padding_rows_write_only_the_scratch_block_and_are_never_sampled():
    bs, scratch = 4, 9
    # Two decodes and a 6-token chunk that does not sample, padded to a mixed shape (5 rows, 16 tokens).
    rows = rows_of([1, 1, 6], [5, 2, 0], [[3, 4], [7], [1, 2]], [0, 1], 2)
    layout = Layout(tokens=16, logits=5, rows=5, width=4)
    int64, int32 = np.full(layout.int64_size, -7, np.int64), np.full(layout.int32_size, -7, np.int32)
    fill(rows, layout, int64, int32, bs, scratch)
    ids, positions, slots, logits_index = layout.int64_views(int64)
    query_start, seq_lens, tables = layout.int32_views(int32)
    assert query_start.tolist() == [0, 1, 2, 8, 9, 16]  # padding rows: 1 token, then the 7 left
    assert seq_lens.tolist() == [6, 3, 6, 1, 7]
    assert positions.tolist() == [5, 2, 0, 1, 2, 3, 4, 5, 0, 0, 1, 2, 3, 4, 5, 6]
    assert slots[:8].tolist() == [4 * 4 + 1, 7 * 4 + 2, 4, 5, 6, 7, 8, 9]  # the real rows' own slots
    assert (slots[8:] // bs == scratch).all()
    assert (tables[3:, :2] == scratch).all() and tables[0, :2].tolist() == [3, 4]
    assert (tables[:, 2:] == -7).all()  # columns no row reaches are left as they were
    assert ids[:8].tolist() == list(range(100, 108)) and (ids[8:] == 0).all()
    assert logits_index.tolist() == [0, 1, 0, 0, 0]  # the sampled rows' last tokens, then zeros


@pytest.mark.parametrize("tokens, logits, rows", [(1, 1, 1), (5, 2, 3), (7, 0, 6), (41, 10, 10), (130, 3, 3)])
def test_every_array_starts_on_sixteen_bytes_as_its_own_allocation_would(tokens, logits, rows):
    layout = Layout(tokens, logits, rows, width=5)
    int64, int32 = torch.zeros(layout.int64_size, dtype=torch.int64), torch.zeros(layout.int32_size, dtype=torch.int32)
    for view in (*layout.int64_views(int64), *layout.int32_views(int32)):
        assert (view.data_ptr() - int64.data_ptr() if view.dtype == torch.int64 else
                view.data_ptr() - int32.data_ptr()) % 16 == 0


def test_an_unpadded_layout_is_the_step_itself_and_a_small_layout_is_refused():
    rows = rows_of([1, 3], [4, 0], [[2, 5], [6]], [0, 1], 1)
    layout = Layout(tokens=4, logits=2, rows=2, width=2)
    int64, int32 = np.zeros(layout.int64_size, np.int64), np.zeros(layout.int32_size, np.int32)
    fill(rows, layout, int64, int32, block_size=4, scratch_block=9)
    _ids, positions, slots, logits_index = layout.int64_views(int64)
    assert positions.tolist() == [4, 0, 1, 2] and slots.tolist() == [20, 24, 25, 26]
    assert logits_index.tolist() == [0, 3]
    with pytest.raises(ValueError, match="does not fit"):
        fill(rows, Layout(tokens=6, logits=2, rows=2, width=2), int64, int32, 4, 9)  # spare tokens, no spare row
    with pytest.raises(ValueError, match="wider"):
        fill(rows, Layout(tokens=4, logits=2, rows=2, width=1), int64, int32, 4, 9)


def test_fixed_buffers_refuse_a_step_over_their_capacity_and_growable_ones_grow():
    rows = rows_of([1, 3], [4, 0], [[2, 5], [6]], [0, 1], 1)
    layout = Layout(tokens=4, logits=2, rows=2, width=2)
    with pytest.raises(ValueError, match="capacity"):
        InputBuffers(torch.device("cpu"), 4, 4, growable=False).prepare(rows, layout, 4, 9)
    buffers = InputBuffers(torch.device("cpu"), 4, 4)
    views = buffers.prepare(rows, layout, 4, 9)
    assert views[2].tolist() == [20, 24, 25, 26]


PROMPT_LENS = [1, 3, 16, 17, 40, 64, 100, 130]


def _generate(model_dir, graphs: bool, backend: str, **knobs):
    engine = Engine.from_model(model_dir, max_model_len=320, attention_backend=backend, **knobs)
    if graphs:
        engine.runner.capture_graphs(engine.core.config.scheduler, record="eager")
    calls = []
    run = engine.runner.graphs.run if graphs else None
    if graphs:
        def counting(rows, announce=None):
            out = run(rows, announce)
            calls.append(out is not None)
            return out
        engine.runner.graphs.run = counting
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in PROMPT_LENS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert engine.block_manager.num_used_blocks == 0
    return outs, calls


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize(("token_budget", "chunk_size", "prefix_caching", "num_kv_blocks"), [
    (64, 16, True, None),
    (512, None, False, None),
    (32, 8, True, 80),  # 320 tokens of KV for ~560: decodes preempt and recompute
], ids=["chunked", "whole-prompts", "preempting"])
def test_steps_through_padded_graph_buffers_give_the_eager_steps_tokens(
        tiny_llama_dir, backend, token_budget, chunk_size, prefix_caching, num_kv_blocks):
    knobs = dict(token_budget=token_budget, chunk_size=chunk_size, prefix_caching=prefix_caching, block_size=4,
                 num_kv_blocks=num_kv_blocks)
    eager, _ = _generate(tiny_llama_dir, False, backend, **knobs)
    graphed, calls = _generate(tiny_llama_dir, True, backend, **knobs)
    assert graphed == eager
    assert sum(calls) >= len(calls) // 2 and not all(calls), calls  # most steps took a graph, some ran eagerly


def test_a_live_reconfiguration_past_the_captured_shapes_runs_those_steps_eagerly(tiny_llama_dir):
    eager, _ = _generate(tiny_llama_dir, False, "torch", token_budget=256, chunk_size=None, block_size=4)
    engine = Engine.from_model(tiny_llama_dir, max_model_len=320, attention_backend="torch", token_budget=32,
                               chunk_size=8, block_size=4, max_num_seqs=4)
    engine.runner.capture_graphs(engine.core.config.scheduler, record="eager")
    assert max(s.rows for s in engine.runner.graphs.shapes) <= 4 + 2
    engine.reconfigure({"token_budget": 256, "chunk_size": None, "max_num_seqs": 64})
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in PROMPT_LENS]
    assert engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) == eager


def test_padding_never_touches_a_block_the_pool_hands_out(tiny_llama_dir):
    engine = Engine.from_model(tiny_llama_dir, max_model_len=320, attention_backend="torch", block_size=4)
    runner = engine.runner
    runner.capture_graphs(engine.core.config.scheduler, record="eager")
    before = runner.kv_cache[:, :, : runner.scratch_block].clone()
    rows = rows_of([1], [0], [[0]], [], 1)  # one decode in block 0, padded to the 1-row graph: no padding
    with torch.inference_mode():  # as the runner's steps run
        assert runner.graphs.run(rows) is not None
    changed = (runner.kv_cache[:, :, : runner.scratch_block] != before).flatten(3).any(-1)
    assert changed[:, :, 0].any() and not changed[:, :, 1:].any()  # block 0 written, others not
    before = runner.kv_cache[:, :, : runner.scratch_block].clone()
    rows = rows_of([1, 1, 1], [0, 0, 0], [[1], [2], [3]], [0, 1, 2], 3)  # 3 rows, padded to 4
    with torch.inference_mode():
        assert runner.graphs.run(rows) is not None
    changed = (runner.kv_cache[:, :, : runner.scratch_block] != before).flatten(3).any(-1)
    assert changed[:, :, 1:4].all() and not changed[:, :, 4:].any() and not changed[:, :, 0].any()


def test_capture_stops_at_its_time_budget_and_the_rest_run_eagerly(tiny_llama_dir, caplog):
    engine = Engine.from_model(tiny_llama_dir, max_model_len=320, attention_backend="torch", block_size=4)
    runner = engine.runner
    shapes = graph_shapes(16, 64, 32, 320)
    graphs = StepGraphs(runner.device, 4, runner.scratch_block, 80, shapes, record="eager", time_budget_s=0.0)
    with caplog.at_level("WARNING", logger="cadenza.node.runner.cuda_graphs"), torch.inference_mode():
        graphs.capture(lambda views, shape: runner._forward(views, shape.max_query_len, 320))
    assert graphs.shapes == shapes[:1] == [GraphShape(16, 16, 1)] and "passed its 0 s" in caplog.text
    with torch.inference_mode():
        assert graphs.run(rows_of([1], [0], [[0]], [0], 1)) is not None  # padded to the 16-row graph
        assert graphs.run(rows_of([1, 9], [0, 0], [[0], [1, 2, 3]], [0, 1], 1)) is None  # no mixed graph: eager


def test_a_capture_that_fails_keeps_what_it_captured_and_logs_why(tiny_llama_dir, caplog):
    engine = Engine.from_model(tiny_llama_dir, max_model_len=320, attention_backend="torch", block_size=4)

    def broken(views, shape):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = StepGraphs(engine.runner.device, 4, engine.runner.scratch_block, 80, graph_shapes(4, 64, 32, 320),
                        record="eager")
    with caplog.at_level("WARNING", logger="cadenza.node.runner.cuda_graphs"), torch.inference_mode():
        graphs.capture(broken)
    assert graphs.shapes == [] and "not permitted when stream is capturing" in caplog.text
    with torch.inference_mode():
        assert graphs.run(rows_of([1], [0], [[0]], [0], 1)) is None  # every step runs eagerly


@pytest.mark.parametrize(("others", "kept"), [({2: 1}, 3), ({2: 0}, 2), ({0: 0}, 0)],
                         ids=["a-rank-out-of-budget", "a-rank-failed-a-shape", "a-rank-failed-the-first"])
def test_tensor_parallel_ranks_keep_the_same_shapes_and_stop_together(tiny_llama_dir, others, kept):
    # ``least`` stands for the other ranks' answers: every rank keeps what all captured and stops
    # where the first one stops, so rank 0 names only graphs every worker holds
    engine = Engine.from_model(tiny_llama_dir, max_model_len=320, attention_backend="torch", block_size=4)
    runner = engine.runner
    shapes = graph_shapes(16, 64, 32, 320)
    graphs = StepGraphs(runner.device, 4, runner.scratch_block, 80, shapes, record="eager")
    asked = []

    def least(state: int) -> int:
        asked.append(state)
        return min(state, others.get(len(asked) - 1, 2))

    with torch.inference_mode():
        graphs.capture(lambda views, shape: runner._forward(views, shape.max_query_len, 320), least)
    assert graphs.shapes == shapes[:kept] and len(asked) == max(others) + 1 and set(asked) == {2}


def test_step_records_say_which_steps_replayed_a_graph(tiny_llama_dir):
    from cadenza.node.core.messages import AddRequest

    engine = Engine.from_model(tiny_llama_dir, max_model_len=320, attention_backend="torch", block_size=4,
                               token_budget=64, chunk_size=None)
    core = engine.core
    core.runner.capture_graphs(core.config.scheduler, record="eager")
    for rid in ("a", "b"):  # two 20-token prompts: both chunks in the first step, which no graph holds
        core.add_request(AddRequest(rid, list(range(3, 23)), SamplingParams(max_tokens=3, temperature=0,
                                                                            ignore_eos=True)))
    graphed = []
    while core.has_unfinished_requests():
        _deltas, record = core.step()
        graphed.append(record.cuda_graph)
    assert graphed == [False, True, True]  # then two steps of two decodes each replay the 2-row graph
