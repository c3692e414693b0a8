"""Sampling and stop conditions: greedy, temperature, top-k, top-p, seeds, stop strings, EOS."""

from __future__ import annotations


import pytest
import torch

from cadenza.node.frontend.llm import Engine
from cadenza.node.core.request import Request, RequestStatus, SamplingParams
from cadenza.node.runner.sampler import make_generator, sample

PROBS = [0.5, 0.3, 0.15, 0.05]


def frequencies(sp: SamplingParams, n: int = 4000, seed: int = 0) -> list[float]:
    logits = torch.tensor([PROBS]).log()
    g = make_generator(seed, torch.device("cpu"))
    counts = [0] * len(PROBS)
    for _ in range(n):
        counts[sample(logits, [sp], [g])[0]] += 1
    return [c / n for c in counts]


def test_temperature_zero_is_greedy():
    logits = torch.tensor([[0.1, 2.0, 1.9], [3.0, -1.0, 0.0]])
    greedy = SamplingParams(temperature=0)
    assert sample(logits, [greedy, greedy], [None, None]) == [1, 0]


def test_temperature_one_samples_the_model_distribution():
    freq = frequencies(SamplingParams(temperature=1.0))
    assert all(abs(f - p) < 0.03 for f, p in zip(freq, PROBS))


def test_low_temperature_sharpens_the_distribution():
    freq = frequencies(SamplingParams(temperature=0.25))
    z = sum(p**4 for p in PROBS)
    assert all(abs(f - p**4 / z) < 0.03 for f, p in zip(freq, PROBS))


def test_top_k_keeps_only_the_k_most_likely_tokens():
    freq = frequencies(SamplingParams(temperature=1.0, top_k=2))
    assert freq[2] == freq[3] == 0
    assert abs(freq[0] - 0.5 / 0.8) < 0.03


def test_top_p_keeps_the_smallest_set_reaching_p():
    freq = frequencies(SamplingParams(temperature=1.0, top_p=0.6))  # {0.5, 0.3} reaches 0.6
    assert freq[2] == freq[3] == 0 and freq[1] > 0.3


def test_top_p_always_keeps_the_most_likely_token():
    assert frequencies(SamplingParams(temperature=1.0, top_p=0.01), n=200) == [1.0, 0, 0, 0]


def test_one_batch_applies_each_rows_own_parameters():
    logits = torch.tensor([PROBS] * 4).log()
    rows = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1 + 1),
            SamplingParams(temperature=1.0, top_p=0.01), SamplingParams(temperature=1.0)]
    seen: list[set[int]] = [set() for _ in rows]
    gens = [None] + [make_generator(i, torch.device("cpu")) for i in range(3)]
    for _ in range(300):
        for i, token in enumerate(sample(logits, rows, gens)):
            seen[i].add(token)
    assert seen == [{0}, {0, 1}, {0}, {0, 1, 2, 3}]


def test_a_rows_draw_depends_only_on_its_own_generator():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sp = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)

    def draws(batch_rows: int) -> list[int]:
        g = make_generator(7, torch.device("cpu"))
        others = [make_generator(100 + i, torch.device("cpu")) for i in range(batch_rows - 1)]
        return [sample(logits[:batch_rows], [sp] * batch_rows, [g, *others])[0] for _ in range(20)]

    assert draws(1) == draws(3)


@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", 0), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("stop", ("",))],
)
def test_invalid_sampling_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_eos_finishes_a_request_unless_ignore_eos():
    req = Request("a", [5, 6], SamplingParams(max_tokens=10), eos_token_ids=frozenset({2}))
    assert req.append_token(2) == RequestStatus.FINISHED_STOPPED
    req = Request("b", [5, 6], SamplingParams(max_tokens=10, ignore_eos=True), eos_token_ids=frozenset({2}))
    assert req.append_token(2) is None


# -- through the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Engine:
    return Engine.from_model(tiny_llama_dir, token_budget=64, chunk_size=16, max_model_len=256)


def run(engine: Engine, prompt: list[int], sp: SamplingParams, rid: str = "r"):
    engine.add_request(rid, prompt, sp)
    tokens, text, reason = [], "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.token_ids
                text += out.text
                reason = out.finish_reason or reason
    return tokens, text, reason


PROMPT = [10, 20, 30, 40, 50, 60, 70, 80]


def test_the_same_seed_reproduces_the_output_whatever_shares_the_batch(engine):
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone, _, _ = run(engine, PROMPT, sp)
    engine.add_request("neighbour", [7] * 50, SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True))
    crowded, _, _ = run(engine, PROMPT, sp)
    other, _, _ = run(engine, PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=4321, ignore_eos=True))
    assert alone == crowded
    assert other != alone


def test_max_tokens_finishes_with_length(engine):
    tokens, _, reason = run(engine, PROMPT, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(tokens) == 5 and reason == "length"


def test_stop_token_ids_finish_with_stop_and_add_no_text(engine):
    first = run(engine, PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0][0]
    tokens, text, reason = run(engine, PROMPT, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(first,)))
    assert tokens == [first] and text == "" and reason == "stop"


def test_eos_from_the_model_finishes_with_stop(engine, monkeypatch):
    first = run(engine, PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0][0]
    monkeypatch.setattr(engine.core, "eos_token_ids", frozenset({first}))
    tokens, _, reason = run(engine, PROMPT, SamplingParams(max_tokens=10, temperature=0))
    assert tokens == [first] and reason == "stop"


def test_stop_string_truncates_the_text_before_it(engine):
    _, full, _ = run(engine, PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), "the tiny model should produce visible text"
    _, text, reason = run(engine, PROMPT, SamplingParams(max_tokens=40, temperature=0, stop=(stop,), ignore_eos=True))
    assert reason == "stop"
    assert text == full[: full.index(stop)]


def test_streamed_text_deltas_concatenate_to_the_decoded_output(engine):
    tokens, text, _ = run(engine, PROMPT, SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True))
    assert text == engine.tokenizer.decode(tokens)


def test_a_degenerate_distribution_falls_back_to_argmax_instead_of_failing():
    logits = torch.tensor([[float("nan"), 1.0, 2.0]])
    g = make_generator(0, torch.device("cpu"))
    assert sample(logits, [SamplingParams(temperature=1.0)], [g]) in ([0], [1], [2])
    assert sample(torch.tensor([[0.0, 5.0, 1.0]]), [SamplingParams(temperature=1e-30)], [g]) == [1]


def test_a_stop_string_ends_the_request_in_the_core_so_no_further_token_is_scheduled(engine):
    _, full, _ = run(engine, PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    finished, aborted = engine.stats().num_finished, engine.stats().num_aborted
    engine.add_request("s", PROMPT, SamplingParams(max_tokens=40, temperature=0, stop=(stop,), ignore_eos=True))
    while True:
        (out,) = [o for o in engine.step() if o.request_id == "s"]
        if out.finished:
            break
    assert out.finish_reason == "stop" and out.num_output_tokens < 40
    assert "s" not in engine.scheduler.requests and not engine.block_manager.holds("s")
    assert engine.scheduler.schedule().is_empty  # the next step has no row for it
    stats = engine.stats()
    assert stats.num_finished == finished + 1 and stats.num_aborted == aborted  # finished as stopped
