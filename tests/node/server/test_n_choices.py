"""OpenAI ``n``, ``stream_options.include_usage``, ``max_completion_tokens`` and the model card,
through the official ``openai`` client against a real ``cadenza serve`` process."""

from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest

from server_process import cadenza_server, post_json

pytestmark = pytest.mark.slow  # one `cadenza serve` process for the module

BLOCK = 16
PROMPT = [(13 * i) % 300 + 3 for i in range(70)]  # 4 full blocks and 6 tokens


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # no prefix caching: the siblings share the prompt's blocks by reference, not through the cache
    args = ["--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--max-model-len", "256",
            "--block-size", str(BLOCK), "--no-prefix-caching"]
    with cadenza_server(args, log) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key="unused", max_retries=0)


def prefill_tokens(base_url: str) -> int:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/ready", timeout=10) as resp:
        return json.load(resp)["prefill_tokens_admitted"]


def sse(base_url: str, path: str, body: dict) -> list:
    """The events of a streamed call, raw: JSON objects, and "[DONE]" as a string."""
    with post_json(base_url + path, {**body, "stream": True}) as resp:
        lines = resp.read().decode().splitlines()
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


SAMPLED = dict(model="tiny", max_tokens=8, temperature=1.0, seed=42, extra_body={"ignore_eos": True})


def test_n_choices_differ_repeat_for_the_seed_and_prefill_the_prompt_once(client, server):
    before = prefill_tokens(server)
    resp = client.completions.create(prompt=PROMPT, n=4, **SAMPLED)
    computed = prefill_tokens(server) - before
    assert len(PROMPT) <= computed <= len(PROMPT) + 4 * BLOCK  # not four prompts
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in resp.choices)
    texts = [c.text for c in resp.choices]
    assert len(set(texts)) == 4
    assert resp.usage.prompt_tokens == len(PROMPT) and resp.usage.completion_tokens == 4 * 8
    again = client.completions.create(prompt=PROMPT, n=4, **SAMPLED)
    assert [c.text for c in again.choices] == texts
    assert client.completions.create(prompt=PROMPT, n=1, **SAMPLED).choices[0].text == texts[0]


def test_n_choices_stream_with_their_index_each_finishing(client):
    messages = [{"role": "user", "content": "Tell me a story"}]
    stream = client.chat.completions.create(messages=messages, n=3, stream=True,
                                            stream_options={"include_usage": True}, **SAMPLED)
    chunks = list(stream)
    text, finishes, roles = {}, {}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        text[choice.index] = text.get(choice.index, "") + (choice.delta.content or "")
        roles.setdefault(choice.index, choice.delta.role)
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3 * 8
    whole = client.chat.completions.create(messages=messages, n=3, **SAMPLED)
    assert [text[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert len(set(text.values())) == 3


def test_n_above_the_limit_is_a_400_naming_n(client):
    with pytest.raises(openai.BadRequestError, match="n") as exc:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=2, n=17)
    assert exc.value.body["param"] == "n"


@pytest.mark.parametrize("path, body", [
    ("/completions", {"prompt": "Hello", "n": 1}),
    ("/completions", {"prompt": "Hello", "n": 2}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 1}),
    ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2}),
])
def test_include_usage_ends_every_stream_with_usage_and_null_before(server, path, body):
    events = sse(server, path, {"model": "tiny", "max_tokens": 3, "ignore_eos": True, "temperature": 0,
                                "stream_options": {"include_usage": True}, **body})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    *chunks, last = events[:-1]
    assert all("usage" in c and c["usage"] is None for c in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3 * body["n"]


def test_max_completion_tokens_wins_over_max_tokens(client):
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3


def test_the_model_card_has_the_fields_clients_read(client):
    (card,) = client.models.list().data
    assert card.id == "tiny" and card.object == "model" and card.owned_by == "cadenza"
    assert 0 < card.created <= time.time()
    assert card.root == "tiny" and card.parent is None and card.max_model_len == 256


def test_a_grammar_that_fails_in_the_engine_is_a_400_and_frees_every_choice(client, server):
    # a $ref cycle passes the server's check (it has no tokenizer) and matches no output at all
    cycle = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    fmt = {"type": "json_schema", "json_schema": {"name": "cycle", "schema": cycle}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="grammar failed in the engine") as caught:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=3,
                                           max_tokens=200, response_format=fmt, stream=stream, **{
                                               k: v for k, v in SAMPLED.items() if k not in ("model", "max_tokens")})
        assert caught.value.body["param"] == "response_format"
    deadline = time.monotonic() + 10  # the core publishes its counters after the aborts, not before the 400
    while True:
        with urllib.request.urlopen(server.removesuffix("/v1") + "/ready", timeout=10) as resp:
            ready = json.load(resp)
        if ready["num_running"] == ready["num_waiting"] == ready["kv_blocks_used"] == 0:
            break
        assert time.monotonic() < deadline, ready
        time.sleep(0.05)
    assert client.completions.create(prompt=PROMPT, **SAMPLED).choices[0].finish_reason == "length"  # serves on
