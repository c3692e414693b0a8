"""A simulated replica runs the engine's own scheduler: same knobs, same token schedule as the real
engine; virtual-clock runs are deterministic and their timelines add up."""

from __future__ import annotations

import dataclasses

import pytest

from cadenza.node.core.config import SchedulerConfig
from cadenza.node.engine.engine_core import EngineCore
from cadenza.node.core.messages import AddRequest
from cadenza.node.core.request import SamplingParams
from cadenza.loadgen.trace import TraceRequest
from cadenza.sim.hardware import PROFILES
from cadenza.sim.model_dims import load_model_dims
from cadenza.sim.replica import SimReplica, VirtualClock, synthetic_token
from cadenza.sim.roofline import Roofline, StepComposition
from cadenza.sim.fleet import simulate_replica

LENGTHS = [(40, 6), (7, 12), (90, 3), (25, 9), (60, 5), (3, 15)]  # (prompt, output) tokens


def schedule_of(out) -> list[tuple[str, int, int]]:
    return [(row.request.request_id, row.start, row.num_tokens) for row in out.rows]


def test_the_simulator_and_the_real_engine_produce_the_same_token_schedule(tiny_llama_dir):
    core = EngineCore.from_model(tiny_llama_dir, token_budget=48, chunk_size=32, max_num_seqs=4)
    vocab = core.model_config.vocab_size
    sim = SimReplica(core.scheduler.config, Roofline(load_model_dims(tiny_llama_dir), PROFILES["l40s"]), VirtualClock())
    for i, (prompt, output) in enumerate(LENGTHS):
        core.add_request(AddRequest(f"r{i}", [synthetic_token(i, p, vocab) for p in range(prompt)],
                                    SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)))
        sim.add_request(f"r{i}", i, prompt, output, arrival_s=0.0)
    real_steps, sim_steps = [], []
    original_execute = core.runner.execute

    def recording_execute(out, masks=None):
        real_steps.append(schedule_of(out))
        return original_execute(out, masks)

    core.runner.execute = recording_execute
    while core.has_unfinished_requests():
        core.step()
    while (out := sim.step()) is not None:
        sim_steps.append(schedule_of(out))
        sim.clock.now = sim.busy_until
    assert len(real_steps) > len(LENGTHS) and sim_steps == real_steps
    assert all(len(t.token_s) == output for t, (_p, output) in zip(sim.times.values(), LENGTHS))


def small_trace(n: int = 60) -> list[TraceRequest]:
    return [TraceRequest(arrival_s=0.05 * i, input_len=200 + 37 * (i % 9), output_len=20 + 11 * (i % 5)) for i in range(n)]


def test_a_virtual_clock_run_is_deterministic_and_its_timelines_add_up():
    config = SchedulerConfig(token_budget=512, chunk_size=256, max_num_seqs=32, max_model_len=4096)
    model = Roofline(load_model_dims("mistral-7b"), PROFILES["a100-80g"])
    first, report = simulate_replica(small_trace(), config, model)
    second, again = simulate_replica(small_trace(), config, model)
    assert report == again
    assert [t.token_s for t in first.times.values()] == [t.token_s for t in second.times.values()]
    assert report.requests == 60 and report.rejected == 0
    for t, req in zip(first.times.values(), small_trace()):
        assert len(t.token_s) == req.output_len and t.ttft_s > 0
        assert all(g > 0 for g in t.itl_s)
    # decodes of a 7B model on an A100 cost ~7 ms of weight reads each step, more with prefill mixed in
    assert 6 < report.itl_ms["p50"] < 60 and report.ttft_ms["p50"] > report.itl_ms["p50"]


def test_chunking_bounds_the_inter_token_gap_a_long_prompt_causes():
    # one stream decoding when an 8,000-token prompt arrives: unchunked, its next token waits for
    # the whole prefill; with 512-token chunks, for one chunk at a time (Sarathi-Serve's point)
    trace = [TraceRequest(0.0, 100, 200), TraceRequest(0.5, 8000, 4)]
    model = Roofline(load_model_dims("llama-3.1-8b"), PROFILES["h100-sxm"])
    whole = SchedulerConfig(token_budget=8192, chunk_size=None, max_num_seqs=8, max_model_len=16384)
    chunked = dataclasses.replace(whole, token_budget=512, chunk_size=512)
    stall = {name: max(simulate_replica(trace, config, model)[0].times["r0"].itl_s)
             for name, config in (("whole", whole), ("chunked", chunked))}
    prefill = model.step_time(StepComposition(prefill_tokens=8000, prefill_attention_tokens=8000 * 4000,
                                              num_rows=1, num_sampled=1)).total_s
    assert stall["whole"] == pytest.approx(prefill, rel=0.1)
    assert stall["chunked"] < stall["whole"] / 4
