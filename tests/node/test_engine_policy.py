"""The scheduling policy with a real (tiny, random) model: preemption refunds, cancellation,
prefix caching — greedy outputs stay exactly those of ``transformers``."""

from __future__ import annotations

import pytest
import torch

from cadenza.node.frontend.llm import Engine
from cadenza.node.core.request import RequestStatus, SamplingParams
from tiny_models import load_reference


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    model = load_reference(model_dir)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=max_tokens, do_sample=False)[0, len(p):].tolist() for p in prompts]


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_to_completion(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def test_higher_class_decode_preempts_a_scheduled_batch_request_and_both_stay_correct(tiny_llama_dir, monkeypatch):
    """KV pool of 9 blocks, two running requests, the interactive one needs a new block."""
    engine = Engine.from_model(tiny_llama_dir, token_budget=64, chunk_size=64, max_model_len=32, block_size=4,
                               num_kv_blocks=9)
    engine.reconfigure({"watermark": 0.0})
    refunds = []
    from cadenza.node.core import scheduler as scheduler_module

    original = scheduler_module.Step.unschedule

    def unschedule(self, req):
        result = original(self, req)
        refunds.append((req.request_id, result))
        return result

    monkeypatch.setattr(scheduler_module.Step, "unschedule", unschedule)
    batch_prompt, inter_prompt = random_prompt(14, 1), random_prompt(6, 2)
    engine.add_request("batch", batch_prompt, greedy(10), arrival_time=1.0, traffic_class="batch")
    engine.add_request("inter", inter_prompt, greedy(10), arrival_time=2.0, traffic_class="interactive")
    got = run_to_completion(engine)
    assert ("batch", (1, False)) in refunds  # its decode row was unscheduled and the token refunded
    assert engine.scheduler.stats.num_preemptions >= 1
    assert [got["batch"], got["inter"]] == hf_greedy(tiny_llama_dir, [batch_prompt, inter_prompt], 10)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("when", ["between-chunks", "after-last-chunk-scheduled"])
def test_cancelling_a_prompt_stops_it_and_returns_every_block(tiny_llama_dir, when):
    """Chunk size 128, three 300-token prompts; the third is cancelled."""
    engine = Engine.from_model(tiny_llama_dir, token_budget=512, chunk_size=128, max_model_len=512)
    free_at_start = engine.block_manager.num_free_blocks
    for i in range(3):
        engine.add_request(f"p{i}", random_prompt(300, 10 + i), greedy(5))
    third = engine.scheduler.requests["p2"]
    emitted_after_cancel = []
    cancelled = False
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        row = next((r for r in out.rows if r.request is third), None)
        if not cancelled and row is not None:
            last_chunk = row.start + row.num_tokens == third.num_prompt_tokens
            if (when == "between-chunks" and 0 < row.start and not last_chunk) or (
                    when == "after-last-chunk-scheduled" and last_chunk):
                engine.abort_request("p2")  # the step is in flight
                cancelled = True
        tokens = engine.runner.execute(out)
        for req in engine.scheduler.update_from_output(out, tokens):
            if cancelled and req is third:
                emitted_after_cancel.append(req.token_ids[-1])
    assert cancelled and emitted_after_cancel == []
    assert third.status == RequestStatus.FINISHED_ABORTED and third.status.finish_reason == "abort"
    assert third.num_output_tokens == 0
    assert engine.block_manager.num_free_blocks == free_at_start
    assert engine.block_manager.num_used_blocks == 0
    assert engine.scheduler.stats.num_cancelled_before_first_token == 1


@pytest.mark.parametrize("preempt", [False, True], ids=["roomy-pool", "tight-pool"])
def test_greedy_outputs_are_identical_with_prefix_caching_on_and_off(tiny_llama_dir, preempt):
    system = random_prompt(40, 99)  # a shared system prompt, as chat traffic has
    prompts = [system + random_prompt(n, 20 + n) for n in (3, 9, 17, 30, 5, 12)]
    prompts.append(list(prompts[0]))  # an exact repeat
    knobs = dict(token_budget=96, chunk_size=24, max_model_len=128, block_size=8)
    if preempt:
        knobs["num_kv_blocks"] = 40
    results = {}
    for caching in (False, True):
        engine = Engine.from_model(tiny_llama_dir, prefix_caching=caching, **knobs)
        results[caching] = engine.generate(prompts, greedy(24))
        stats = engine.stats()
        assert (stats.prefix_cache_hit_tokens > 0) == caching
        assert stats.kv_blocks_used == 0
        if preempt:
            assert stats.num_preemptions > 0
    assert results[True] == results[False] == hf_greedy(tiny_llama_dir, prompts, 24)


def test_batch_requests_displaced_by_interactive_arrivals_keep_their_greedy_outputs(tiny_llama_dir):
    """Two running slots held by batch decodes; interactive requests arrive and take them."""
    engine = Engine.from_model(tiny_llama_dir, token_budget=64, chunk_size=16, max_num_seqs=2, max_model_len=96)
    batch = [random_prompt(11, 31), random_prompt(23, 32)]
    inter = [random_prompt(7, 33), random_prompt(19, 34)]
    for i, prompt in enumerate(batch):
        engine.add_request(f"b{i}", prompt, greedy(30), arrival_time=float(i), traffic_class="batch")
    got: dict[str, list[int]] = {}
    for _ in range(4):  # both batch requests are decoding
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    for i, prompt in enumerate(inter):
        engine.add_request(f"i{i}", prompt, greedy(12), arrival_time=10.0 + i)
    for rid, tokens in run_to_completion(engine).items():
        got.setdefault(rid, []).extend(tokens)
    assert engine.scheduler.stats.num_admission_preemptions >= 2
    assert [got["b0"], got["b1"]] == hf_greedy(tiny_llama_dir, batch, 30)
    assert [got["i0"], got["i1"]] == hf_greedy(tiny_llama_dir, inter, 12)
    assert engine.block_manager.num_used_blocks == 0
