"""Logprobs (issue 33): each generated token's log-probability and the most likely tokens', from
the distribution the token was sampled from before temperature (vLLM's default, ``raw_logprobs``),
equal ``log_softmax`` of transformers' logits at the same position; only the requests that ask get
them; and the OpenAI API serves them in OpenAI's shapes, streamed and not, through the official
client, with named 400s for bounds."""

from __future__ import annotations

import pytest
import torch

from cadenza.node.core.request import SamplingParams
from cadenza.node.frontend.llm import Engine
from cadenza.node.runner.sampler import token_logprobs
from tiny_models import load_reference


def collect(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, tuple[list, list]]:
    """Every request's tokens and the logprobs entries the core sent with them."""
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, sp)
    got: dict[str, tuple[list, list]] = {str(i): ([], []) for i in range(len(prompts))}
    while engine.core.has_unfinished_requests():
        deltas, _record = engine.core.step()
        for d in deltas:
            tokens, entries = got[d.request_id]
            tokens += d.new_token_ids
            entries += d.logprobs or [None] * len(d.new_token_ids)
    return got


def test_logprobs_equal_log_softmax_of_transformers_logits_and_only_askers_get_them(tiny_llama_dir):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (5, 40, 17)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),  # does not ask
              SamplingParams(max_tokens=6, temperature=1.7, top_k=20, seed=3, ignore_eos=True, logprobs=0)]
    with Engine.from_model(tiny_llama_dir, max_model_len=320, token_budget=32, chunk_size=16) as engine:
        got = collect(engine, prompts, params)
    reference = load_reference(tiny_llama_dir)
    assert got["1"][1] == [None] * 6
    for rid, top in (("0", 5), ("2", 0)):
        tokens, entries = got[rid]
        ids = torch.tensor([prompts[int(rid)] + tokens])
        with torch.no_grad():
            logits = reference(ids).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)[len(prompts[int(rid)]) - 1: -1]  # the positions that sampled
        for position, (token, (logprob, best)) in enumerate(zip(tokens, entries)):
            assert logprob == pytest.approx(expected[position, token].item(), abs=1e-4)
            assert len(best) == top
            values, indices = expected[position].topk(top) if top else (torch.empty(0), torch.empty(0))
            assert [i for i, _ in best] == indices.tolist()
            assert [v for _, v in best] == pytest.approx(values.tolist(), abs=1e-4)
    # greedy: the token is the most likely, so its logprob heads the list
    assert all(best[0] == [token, logprob] for token, (logprob, best) in zip(*got["0"]))


def test_token_logprobs_reads_only_the_rows_that_asked():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    entries = token_logprobs(logits, torch.tensor([2, 0, 1]), [0, 2], [2, 0])
    lp = torch.log_softmax(logits, dim=-1)
    assert entries[0][0] == pytest.approx(lp[0, 2].item())
    assert [i for i, _ in entries[0][1]] == [2, 1]
    assert entries[1] == [pytest.approx(lp[2, 1].item()), []]


def test_a_logprobs_count_out_of_bounds_is_refused():
    with pytest.raises(ValueError, match="logprobs: must be an integer from 0 to 20"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=True)


@pytest.mark.slow
def test_the_openai_client_gets_logprobs_in_openais_shapes_streamed_and_not(tmp_path, tiny_llama_dir):
    import openai

    from server_process import cadenza_server

    args = ["--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--max-model-len", "320"]
    with cadenza_server(args, tmp_path / "serve.log") as url:
        client = openai.OpenAI(base_url=url, api_key="unused")
        chat = dict(model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=8,
                    temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
        whole = client.chat.completions.create(**chat)
        content = whole.choices[0].logprobs.content
        assert len(content) == 8 and all(len(t.top_logprobs) == 3 for t in content)
        text = b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace")
        assert text == whole.choices[0].message.content
        assert all(bytes(t.bytes).decode("utf-8", "replace") == t.token for t in content)
        assert all(t.top_logprobs[0].logprob == t.logprob for t in content)  # greedy: the most likely
        streamed = [entry for chunk in client.chat.completions.create(**chat, stream=True)
                    if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
        assert [t.token for t in streamed] == [t.token for t in content]
        assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)
        plain = client.chat.completions.create(**{**chat, "logprobs": False, "top_logprobs": None})
        assert plain.choices[0].logprobs is None

        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2,
                                         extra_body={"ignore_eos": True})
        lp = done.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert all(len(top) <= 2 for top in lp.top_logprobs)  # (a token holding part of a character shows U+FFFD)
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(5)]

        for call, message in (
            (lambda: client.chat.completions.create(**{**chat, "top_logprobs": 21}), "top_logprobs: must be"),
            (lambda: client.chat.completions.create(**{**chat, "logprobs": False}), "needs logprobs set to true"),
            (lambda: client.completions.create(model="tiny", prompt="x", logprobs=6), "logprobs: must be"),
        ):
            with pytest.raises(openai.BadRequestError, match=message):
                call()
