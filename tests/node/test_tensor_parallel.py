"""Tensor parallelism (issue 32): the shards, the collectives, and greedy parity with one rank.

Greedy outputs at tensor-parallel size 2 (KV heads split) and 4 (KV heads replicated: the tiny
model has 4 query and 2 KV heads) equal size 1's, in fp32 on the CPU, over the engine's parity grid
(token budgets and chunk sizes, prefix caching on and off, preemption by recompute), over the
default shared-memory collectives and over gloo. A killed worker fails the replica at once, and
sizes the model cannot split are refused before any process starts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cadenza.node.core.config import ConfigError, EngineConfig
from cadenza.node.core.request import SamplingParams, StructuredOutput
from cadenza.node.frontend.llm import Engine
from cadenza.node.runner.collectives import SLOT_BYTES, ShmGroup, TensorParallelError, TorchGroup, create_arena
from cadenza.node.runner.models.config import ModelConfig
from cadenza.node.runner.tp_shards import ShardPlan

pytestmark = pytest.mark.slow  # engines with worker processes

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


PROMPTS = prompts_of([1, 3, 16, 17, 64, 100, 257], seed=0)
SHARED = [PROMPTS[5][:80] + p for p in prompts_of([5, 9, 30], seed=1)]  # one long common prefix


# -- the shard plan ---------------------------------------------------------------------------------


def _cfg(heads=32, kv=8, inter=14336, vocab=128256) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab, heads * 128, inter, 2, heads, kv, 128, 1e-5, 5e5, 8192, False)


def test_heads_split_over_ranks_and_kv_heads_replicate_when_fewer_than_ranks():
    cfg = _cfg()
    plan = ShardPlan.of(cfg, rank=1, size=4)
    assert (plan.num_heads, plan.num_kv_heads, plan.kv_head_start, plan.intermediate_size) == (8, 2, 2, 3584)
    assert plan.slice_of("layers.0.self_attn.q_proj.weight") == (0, 1024, 2048)
    assert plan.slice_of("layers.0.self_attn.k_proj.weight") == (0, 256, 512)
    assert plan.slice_of("layers.0.self_attn.o_proj.weight") == (1, 1024, 2048)
    assert plan.slice_of("layers.0.mlp.down_proj.weight") == (1, 3584, 7168)
    assert plan.slice_of("layers.0.mlp.up_proj.weight") == (0, 3584, 7168)
    assert plan.slice_of("layers.0.input_layernorm.weight") is None
    # 8 ranks of 8 KV heads: one each; 16 ranks: each KV head on the two ranks whose queries read it
    assert [ShardPlan.of(cfg, r, 16).kv_head_start for r in range(16)] == [r // 2 for r in range(16)]
    assert all(ShardPlan.of(cfg, r, 16).num_kv_heads == 1 for r in range(16))


def test_the_vocabulary_is_padded_to_a_multiple_of_the_ranks():
    cfg = _cfg(vocab=10)
    plans = [ShardPlan.of(cfg, r, 4) for r in range(4)]
    assert [p.vocab_per_rank for p in plans] == [3] * 4
    assert [p.slice_of("embed_tokens.weight") for p in plans] == [(0, 0, 3), (0, 3, 6), (0, 6, 9), (0, 9, 10)]


@pytest.mark.parametrize(("size", "reason"), [
    (3, "does not divide LlamaForCausalLM's 32 attention heads"),
    (12, "does not divide LlamaForCausalLM's 32 attention heads"),
    (64, r"must be >= 1 and <= 16 \(the devices of one node\), got 64"),
])
def test_sizes_the_heads_do_not_split_over_are_refused(size, reason):
    with pytest.raises(ConfigError, match=reason):
        ShardPlan.of(_cfg(), 0, size)
    with pytest.raises(ConfigError, match="neither divides LlamaForCausalLM's 6 KV heads"):
        ShardPlan.of(_cfg(heads=24, kv=6), 0, 4)
    with pytest.raises(ConfigError, match="intermediate size 100"):
        ShardPlan.of(_cfg(inter=100), 0, 8)


# -- the shared-memory collectives ------------------------------------------------------------------


def _ranks(tmp_path, size: int, work) -> list:
    """Run ``work(group)`` on ``size`` ranks (threads mapping one shared file): their results."""
    create_arena(tmp_path / "arena", size)
    groups = [ShmGroup(tmp_path / "arena", r, size) for r in range(size)]
    results, errors = [None] * size, []

    def run(r):
        try:
            results[r] = work(groups[r])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for g in groups:
        g.close()
    if errors:
        raise errors[0]
    return results


def test_shared_memory_all_reduce_gather_and_broadcast_agree_with_torch(tmp_path):
    big = SLOT_BYTES // 4 + 1000  # more floats than a slot holds: goes in two pieces

    def work(g):
        r = g.rank
        x = torch.arange(big, dtype=torch.float32) * (r + 1)
        g.all_reduce(x)
        parts = g.gather(torch.full((3,), float(r)))
        b = torch.arange(5, dtype=torch.int64) if r == 0 else torch.zeros(5, dtype=torch.int64)
        g.broadcast(b)
        return x, parts, b

    results = _ranks(tmp_path, 3, work)
    expected = torch.arange(big, dtype=torch.float32) * 6
    for r, (x, parts, b) in enumerate(results):
        assert torch.equal(x, expected) and torch.equal(b, torch.arange(5))
        assert (parts is None) == (r != 0)
    assert [p.tolist() for p in results[0][1]] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]


def test_an_aborted_group_fails_every_wait_instead_of_hanging(tmp_path):
    create_arena(tmp_path / "arena", 2)
    g0, g1 = ShmGroup(tmp_path / "arena", 0, 2), ShmGroup(tmp_path / "arena", 1, 2)
    threading.Timer(0.2, g1.abort).start()  # rank 1 never joins the op; the engine's watcher aborts
    with pytest.raises(TensorParallelError, match="aborted"):
        g0.all_reduce(torch.ones(4))
    g0.close(), g1.close()


def test_a_wait_on_a_rank_whose_process_is_gone_fails(tmp_path):
    create_arena(tmp_path / "arena", 2)
    g0 = ShmGroup(tmp_path / "arena", 0, 2)
    child = os.fork()
    if child == 0:  # pragma: no cover - the child exits at once
        os._exit(0)
    os.waitpid(child, 0)
    g0.watch(1, child)  # rank 1 "started" and died before it joined
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1"):
        g0.all_reduce(torch.ones(4))
    assert time.monotonic() - started < 5
    g0.close()


def test_a_gloo_worker_waits_for_the_next_step_longer_than_the_group_timeout(tmp_path):
    # a worker waits in a broadcast for rank 0's next step as long as the replica idles: under the
    # group's timeout (600 s in an engine) an idle gloo replica's workers failed and the replica died
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 2)
    groups: dict[int, TorchGroup] = {}
    starts = [threading.Thread(target=lambda r=r: groups.setdefault(r, TorchGroup("gloo", store, r, 2, timeout_s=1.0)))
              for r in (0, 1)]
    for t in starts:
        t.start()
    for t in starts:
        t.join()
    got: list = []

    def worker() -> None:
        try:
            got.append(groups[1].broadcast(torch.zeros(3, dtype=torch.int64)).tolist())
        except TensorParallelError as exc:
            got.append(exc)

    waiting = threading.Thread(target=worker)
    waiting.start()
    time.sleep(2.5)  # rank 0 idles past the 1 s timeout
    groups[0].broadcast(torch.tensor([1, 2, 3]))
    waiting.join(30)
    assert got == [[1, 2, 3]]
    for g in groups.values():
        g.close()


# -- the engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    """Size 1 and size 2 engines over the tiny model, re-configured live across the grid."""
    built = {tp: Engine.from_model(tiny_llama_dir, max_model_len=320, tensor_parallel_size=tp) for tp in (1, 2)}
    yield built
    for engine in built.values():
        engine.close()


@pytest.mark.parametrize(("token_budget", "chunk_size", "prefix_caching"), [
    (16, 1, True), (16, 7, False), (64, 7, True), (64, None, False), (512, 64, True), (512, None, True),
])
def test_greedy_tokens_at_size_2_equal_size_1_over_the_parity_grid(engines, token_budget, chunk_size, prefix_caching):
    knobs = {"token_budget": token_budget, "chunk_size": chunk_size, "prefix_caching": prefix_caching}
    outs = {}
    for tp, engine in engines.items():
        engine.core.reconfigure(knobs)
        outs[tp] = engine.generate(PROMPTS, GREEDY) + engine.generate(SHARED, GREEDY)  # then from the cache
        assert engine.block_manager.num_used_blocks == 0
    assert outs[2] == outs[1]
    if prefix_caching:
        assert engines[2].core.stats().prefix_cache_hit_tokens > 0  # the shared prefix was reused at size 2


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache", "no-cache"])
def test_greedy_tokens_at_size_2_and_4_survive_preemption(tiny_llama_dir, prefix_caching):
    prompts = prompts_of([5, 9, 14, 20, 33, 40, 47, 60], seed=3)
    growing = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = {}
    for tp in (1, 2, 4):  # 20 blocks of 16 tokens (320) for 8 requests growing to ~70 tokens each
        with Engine.from_model(tiny_llama_dir, max_model_len=320, num_kv_blocks=20, tensor_parallel_size=tp,
                               token_budget=64, chunk_size=16, prefix_caching=prefix_caching) as engine:
            outs[tp] = engine.generate(prompts, growing)
            assert engine.core.stats().num_preemptions > 0
    assert outs[2] == outs[1] and outs[4] == outs[1]


def test_size_4_replicates_kv_heads_and_size_2_over_gloo_both_equal_size_1(tiny_llama_dir, engines, monkeypatch):
    engines[1].core.reconfigure({"token_budget": 64, "chunk_size": 16, "prefix_caching": True})
    expected = engines[1].generate(PROMPTS, GREEDY)
    with Engine.from_model(tiny_llama_dir, max_model_len=320, tensor_parallel_size=4, token_budget=64,
                           chunk_size=16) as engine:
        assert engine.runner.plan.num_kv_heads == 1  # 2 KV heads over 4 ranks: each on two
        assert engine.generate(PROMPTS, GREEDY) == expected
    monkeypatch.setenv("CADENZA_TP_COLLECTIVES", "gloo")
    with Engine.from_model(tiny_llama_dir, max_model_len=320, tensor_parallel_size=2, token_budget=64,
                           chunk_size=16) as engine:
        assert engine.generate(PROMPTS[:4], GREEDY) == expected[:4]


def test_a_killed_worker_fails_the_replica_at_once_and_leaves_nothing_behind(tiny_llama_dir):
    engine = Engine.from_model(tiny_llama_dir, max_model_len=1024, tensor_parallel_size=2)
    workers = engine.core.workers
    [pid] = workers.pids.values()
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(max_tokens=250, temperature=0, ignore_eos=True))
    engine.step()
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) died \(signal 9\)"):
        for _ in range(10_000):
            engine.step()
    assert time.monotonic() - killed < 5
    engine.close()
    assert not workers.folder.exists()


def test_rank_0_failing_mid_step_fails_the_replica_instead_of_leaving_the_ranks_out_of_step(tiny_llama_dir, engines):
    # a worker waiting in a collective rank 0 never issues would read rank 0's next op as that one
    # (before: summed headers into activations, then read a float as a 100 GB input size)
    engines[1].core.reconfigure({"token_budget": 64, "chunk_size": 16, "prefix_caching": True})
    expected = engines[1].generate(PROMPTS[:2], GREEDY)
    with Engine.from_model(tiny_llama_dir, max_model_len=320, tensor_parallel_size=2, token_budget=64,
                           chunk_size=16) as engine:
        runner = engine.runner
        prepare, mlp = runner.inputs.prepare, runner.model.layers[1].mlp
        runner.inputs.prepare = lambda *a: (_ for _ in ()).throw(ValueError("before the workers heard"))
        engine.add_request("early", PROMPTS[0], GREEDY)
        with pytest.raises(ValueError, match="before the workers heard"):
            engine.step()
        engine.abort_request("early")
        runner.inputs.prepare = prepare
        assert engine.generate(PROMPTS[:2], GREEDY) == expected  # still in step

        mlp.forward = lambda x: (_ for _ in ()).throw(RuntimeError("rank 0 only"))
        engine.add_request("mid", PROMPTS[0], GREEDY)
        with pytest.raises(TensorParallelError, match=r"rank 0 failed in the middle of a step \(RuntimeError: rank 0 "
                                                      r"only\); the ranks are out of step"):
            engine.step()
        deadline = time.monotonic() + 10
        while engine.core.workers.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "exit code 1" in engine.core.workers.failure  # the worker left its aborted wait


def test_an_idle_replica_notices_a_dead_worker_at_its_next_poll(tiny_llama_dir):
    with Engine.from_model(tiny_llama_dir, max_model_len=320, tensor_parallel_size=2) as engine:
        [pid] = engine.core.workers.pids.values()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while engine.core.workers.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(TensorParallelError, match="died"):
            engine.core.poll()


def test_an_engine_built_in_a_thread_that_ends_keeps_its_workers(tiny_llama_dir, engines):
    # PR_SET_PDEATHSIG fires when the thread that forked a worker ends, not its process: an engine
    # built in a short-lived thread (a thread pool's, a loader's) must not lose its workers with it
    engines[1].core.reconfigure({"token_budget": 64, "chunk_size": 16, "prefix_caching": True})
    expected = engines[1].generate(PROMPTS[:3], GREEDY)
    built: list[Engine] = []
    loader = threading.Thread(target=lambda: built.append(Engine.from_model(
        tiny_llama_dir, max_model_len=320, tensor_parallel_size=2, token_budget=64, chunk_size=16)))
    loader.start()
    loader.join()
    with built[0] as engine:
        time.sleep(0.5)  # the watcher would have seen a killed worker by now
        assert engine.core.workers.failure is None
        assert engine.generate(PROMPTS[:3], GREEDY) == expected


def test_a_worker_exits_once_rank_0_is_gone(tmp_path):
    # rank 0 here is a process that starts a "worker" watching it, without the death signal, and exits
    pid_file = tmp_path / "pid"
    rank0 = ("import os, subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import sys; "
             "from cadenza.node.engine.tp_workers import watch_parent; watch_parent(int(sys.argv[1]), 0.05)', "
             f"str(os.getpid())]); open({str(pid_file)!r}, 'w').write(str(p.pid)); sys.stdin.read()")
    parent = subprocess.Popen([sys.executable, "-c", rank0], stdin=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    worker = int(pid_file.read_text())

    def alive() -> bool:
        try:
            with open(f"/proc/{worker}/stat") as f:
                return f.read().split(") ", 1)[1][0] != "Z"
        except FileNotFoundError:
            return False

    time.sleep(1)
    assert alive()  # watching a live rank 0
    parent.communicate(b"", timeout=30)  # rank 0 exits
    deadline = time.monotonic() + 30
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()


def test_closing_stops_the_workers_and_removes_their_folder(tiny_llama_dir):
    engine = Engine.from_model(tiny_llama_dir, max_model_len=320, tensor_parallel_size=2)
    procs = list(engine.core.workers._procs.values())
    assert not engine.core.workers.folder.exists()  # removed once every rank had started
    engine.close()
    assert all(p.poll() == 0 for p in procs)  # told to stop, they exited cleanly


def test_sizes_the_model_cannot_split_are_refused_before_any_process_starts(tiny_llama_dir):
    with pytest.raises(ConfigError, match=r"3 does not divide tiny-llama\d*'s 4 attention heads"):
        Engine.from_model(tiny_llama_dir, tensor_parallel_size=3)
    for size in (0, 32):
        with pytest.raises(ConfigError, match=f"must be >= 1 and <= 16 .*, got {size}"):
            EngineConfig(model="m", tensor_parallel_size=size)


def test_workers_capture_the_same_step_graphs_and_replay_the_one_rank_0_names(tiny_llama_dir, engines):
    # record="eager": every rank runs the forward a CUDA graph would record, on its fixed padded
    # buffers, collectives included — everything but the capture, so it runs on the CPU
    engines[1].core.reconfigure({"token_budget": 64, "chunk_size": 16, "prefix_caching": True})
    expected = engines[1].generate(PROMPTS, GREEDY)
    with Engine.from_model(tiny_llama_dir, max_model_len=320, tensor_parallel_size=2, token_budget=64,
                           chunk_size=16, block_size=4) as engine:
        engine.runner.capture_graphs(engine.core.config.scheduler, record="eager")
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, GREEDY)
        outs: dict[str, list[int]] = {}
        replayed = 0
        while engine.core.has_unfinished_requests():
            for out in engine.step():
                outs.setdefault(out.request_id, []).extend(out.token_ids)
            replayed += engine.runner.last_step_graphed
        assert [outs[str(i)] for i in range(len(PROMPTS))] == expected
        assert replayed > 10  # the decode steps replayed graphs on both ranks


def test_closing_with_a_stopped_worker_kills_it_after_the_grace_instead_of_waiting_forever(tiny_llama_dir,
                                                                                           monkeypatch):
    from cadenza.node.engine import tp_workers

    monkeypatch.setattr(tp_workers, "STOP_GRACE_S", 1.0)
    engine = Engine.from_model(tiny_llama_dir, max_model_len=320, tensor_parallel_size=2)
    [proc] = engine.core.workers._procs.values()
    os.kill(proc.pid, signal.SIGSTOP)  # alive, and never takes the end
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < 5 and proc.poll() == -signal.SIGKILL


def test_a_folder_left_by_an_engine_killed_while_starting_is_swept_by_the_next(tiny_llama_dir, tmp_path):
    child = os.fork()
    if child == 0:  # pragma: no cover - the child exits at once
        os._exit(0)
    os.waitpid(child, 0)
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    stale = base / f"cadenza-tp-{child}-abcd1234"
    stale.mkdir()
    (stale / "collectives").write_bytes(b"\0" * 64)
    live = base / f"cadenza-tp-{os.getpid()}-live0000"  # this process's: kept
    live.mkdir()
    try:
        with Engine.from_model(tiny_llama_dir, max_model_len=320, tensor_parallel_size=2):
            assert not stale.exists() and live.exists()
    finally:
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


def test_logprobs_at_size_2_equal_size_1s(engines):
    # rank 0 holds the whole vocabulary's logits (gathered), so logprobs need nothing of the workers
    asking = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    got = {}
    for tp, engine in engines.items():
        engine.add_request(f"lp{tp}", PROMPTS[4], asking)
        entries = []
        while engine.core.has_unfinished_requests():
            deltas, _record = engine.core.step()
            entries += [e for d in deltas for e in (d.logprobs or [])]
        got[tp] = entries
    assert len(got[2]) == 6
    for (lp2, top2), (lp1, top1) in zip(got[2], got[1]):
        assert lp2 == pytest.approx(lp1, abs=1e-4) and [i for i, _ in top2] == [i for i, _ in top1]


def test_structured_outputs_at_size_2_equal_size_1s(engines):
    # rank 0 masks the gathered logits before it samples; the workers never see the grammar
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "b": {"enum": ["x", "yy"]}},
              "required": ["a", "b"], "additionalProperties": False}
    constrained = SamplingParams(max_tokens=60, temperature=1.0, seed=3,
                                 structured=StructuredOutput("json_schema", json.dumps(schema)))
    outs = {tp: engine.generate(PROMPTS[:3], constrained) for tp, engine in engines.items()}
    assert outs[2] == outs[1]
    assert all(tokens[-1] in engines[1].core.eos_token_ids for tokens in outs[1])  # each grammar completed
