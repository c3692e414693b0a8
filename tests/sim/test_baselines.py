"""The prefill-first baseline: whole prompts in steps of their own, decodes waiting meanwhile."""

from __future__ import annotations

from cadenza.node.core.config import SchedulerConfig
from cadenza.loadgen.trace import TraceRequest
from cadenza.sim.baselines import PrefillFirstScheduler
from cadenza.sim.hardware import PROFILES
from cadenza.sim.model_dims import load_model_dims
from cadenza.sim.replica import SimReplica, VirtualClock
from cadenza.sim.roofline import Roofline
from cadenza.sim.fleet import simulate_replica

MODEL = Roofline(load_model_dims("mistral-7b"), PROFILES["a100-80g"])
UNCHUNKED = SchedulerConfig(token_budget=8192, chunk_size=None, max_num_seqs=64, max_model_len=8192)


def test_a_prompt_runs_whole_in_a_step_of_its_own_while_decodes_wait():
    replica = SimReplica(UNCHUNKED, MODEL, VirtualClock(), scheduler_cls=PrefillFirstScheduler)
    replica.add_request("stream", 0, 50, 100, arrival_s=0.0)
    for _ in range(3):
        replica.step()
        replica.clock.now = replica.busy_until
    replica.add_request("long", 1, 6000, 5, arrival_s=replica.clock.now)
    replica.add_request("short", 2, 300, 5, arrival_s=replica.clock.now)
    out = replica.step()
    assert not out.decodes and [(r.request.request_id, r.num_tokens) for r in out.prefill_rows] == [
        ("long", 6000), ("short", 300)]
    replica.clock.now = replica.busy_until
    out = replica.step()
    assert {r.request_id for r in out.decodes} == {"stream", "long", "short"} and not out.prefill_rows


def test_under_load_prefill_first_stalls_decodes_that_chunking_protects():
    trace = [TraceRequest(0.2 * i, 1500 + 400 * (i % 5), 60) for i in range(150)]
    chunked = SchedulerConfig(token_budget=512, chunk_size=512, max_num_seqs=64, max_model_len=8192)
    _, first = simulate_replica(trace, UNCHUNKED, MODEL, scheduler_cls=PrefillFirstScheduler)
    _, sarathi = simulate_replica(trace, chunked, MODEL)
    assert first.requests == sarathi.requests == 150
    assert first.itl_ms["p99"] > 2 * sarathi.itl_ms["p99"]
