"""The official ``openai`` client against a real ``cadenza serve`` process (structured outputs too:
issue 33)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from json_schemas import PERSON
from server_process import cadenza_server

pytestmark = pytest.mark.slow  # one `cadenza serve` process for the module


@pytest.fixture(scope="module")
def client(tiny_llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ["--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--max-model-len", "256"]
    with cadenza_server(args, log) as base_url:
        yield openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion(client):
    resp = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5


def test_completion_stream(client):
    stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    full = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert text == full.choices[0].text


def test_chat(client):
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens <= 6


def test_chat_stream(client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_errors_surface_as_openai_exceptions(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hello", max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="Hello", max_tokens=0)


def test_structured_outputs_are_json_that_validates_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = dict(model="tiny", messages=[{"role": "user", "content": "Who are you?"}], max_tokens=150,
                temperature=1.0, seed=5, response_format=fmt)
    whole = client.chat.completions.create(**chat)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**chat, stream=True)
                       if c.choices)
    assert streamed == whole.choices[0].message.content
    done = client.completions.create(model="tiny", prompt="JSON:", max_tokens=150, temperature=1.0, seed=2,
                                     extra_body={"response_format": fmt})
    assert done.choices[0].finish_reason == "stop", done
    jsonschema.validate(json.loads(done.choices[0].text), PERSON)
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.chat.completions.create(**{**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "array", "uniqueItems": True}}}})
