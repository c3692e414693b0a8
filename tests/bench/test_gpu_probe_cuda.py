"""The GPU probe's CUDA-only parts on a real device (skipped without CUDA): the profiler's kernel
intervals it reads the busy share from, and its engines on drawn SmolLM2 weights, graphs on and off."""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import pytest
import torch

from bench_scripts import ROOT

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu_probe import QUICK, build_engine, decode_row  # noqa: E402
from bench.probe_engine import Driver, free_device, model_folder  # noqa: E402
from bench.probe_figures import busy_seconds, kernel_intervals  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_profiler_gives_the_kernels_of_back_to_back_matmuls_as_busy_time():
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)  # ~1.5 ms a product on a Hopper
    a @ a
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    intervals = kernel_intervals(prof.events())
    assert len(intervals) >= 20
    assert 0.5 * wall < busy_seconds(intervals) <= wall


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_a_probe_engine_decodes_on_drawn_smollm2_weights(cuda_graphs, tmp_path):
    shape = replace(QUICK, decode_model="smollm2-135m", kv_cache_bytes=1 << 30, decode_steps=4, warmup_steps=2)
    drive = Driver(build_engine(model_folder("smollm2-135m", tmp_path), shape, cuda_graphs), torch.cuda.synchronize)
    row = decode_row(drive, 8, shape)
    assert row["batch"] == 8 and row["step_ms"] > 0 and row["context_tokens"] >= 8 * shape.context
    assert not drive.core.has_unfinished_requests()
    del drive
    free_device()
