"""CUDA graphs captured for real: the same tokens as eager steps, and replays that take new inputs.

Skipped without a CUDA GPU (tests/node/test_cuda_graphs.py covers everything but the capture on a
CPU). Part of the prepared GPU check: ``python -m bench.gpu_check``.
"""

from __future__ import annotations

import pytest
import torch

from cadenza.node.core.request import SamplingParams
from cadenza.node.frontend.llm import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPT_LENS = [1, 3, 16, 17, 40, 64, 100, 130]


def _generate(model_dir, cuda_graphs: bool, dtype: str, **knobs):
    engine = Engine.from_model(model_dir, max_model_len=320, device="cuda", dtype=dtype, attention_backend="triton",
                               cuda_graphs=cuda_graphs, **knobs)
    taken = []
    if cuda_graphs:
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.shapes and graphs.record == "cuda"
        run = graphs.run
        graphs.run = lambda rows: taken.append(run(rows)) or taken[-1]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in PROMPT_LENS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert engine.block_manager.num_used_blocks == 0
    return outs, [t is not None for t in taken]


@pytest.mark.parametrize(("token_budget", "chunk_size", "num_kv_blocks"), [
    (64, 16, None), (512, None, None), (32, 8, 80),
], ids=["chunked", "whole-prompts", "preempting"])
def test_graph_replays_give_the_eager_tokens_in_fp32(tiny_llama_dir, token_budget, chunk_size, num_kv_blocks):
    knobs = dict(token_budget=token_budget, chunk_size=chunk_size, block_size=16, num_kv_blocks=num_kv_blocks)
    eager, _ = _generate(tiny_llama_dir, False, "float32", **knobs)
    graphed, taken = _generate(tiny_llama_dir, True, "float32", **knobs)
    assert graphed == eager
    assert sum(taken) >= len(taken) // 2, taken


def test_graphs_are_captured_for_decode_and_mixed_shapes_and_logged(tiny_llama_dir, caplog):
    caplog.set_level("INFO", logger="cadenza.node.runner.cuda_graphs")
    engine = Engine.from_model(tiny_llama_dir, max_model_len=320, device="cuda", attention_backend="triton",
                               token_budget=256, chunk_size=128, max_num_seqs=16)
    shapes = engine.runner.graphs.shapes
    assert any(s.max_query_len == 1 for s in shapes) and any(s.max_query_len > 1 for s in shapes)
    assert engine.runner.graphs.capture_seconds > 0
    assert "shapes captured" in caplog.text and "MiB of memory pool" in caplog.text


def test_no_graphs_with_the_flag_off_or_the_torch_backend(tiny_llama_dir):
    off = Engine.from_model(tiny_llama_dir, max_model_len=320, device="cuda", attention_backend="triton",
                            cuda_graphs=False)
    assert off.runner.graphs is None
    torch_backend = Engine.from_model(tiny_llama_dir, max_model_len=320, device="cuda", attention_backend="torch")
    assert torch_backend.runner.graphs is None
