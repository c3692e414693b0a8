"""The embedded default: ``cadenza serve`` with no --model serves SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import time

import openai
import pytest

from server_process import cadenza_server


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
CAPITAL = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 40},
                                            "capital": {"type": "string", "maxLength": 40}},
           "required": ["country", "capital"], "additionalProperties": False}


@pytest.mark.slow  # a server process with the real 135M model
def test_embedded_smollm2_answers_that_paris_is_the_capital_of_france(smollm2_dir, tmp_path):
    with cadenza_server([], tmp_path / "serve.log") as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        ask = dict(model="SmolLM2-135M-Instruct", temperature=0,
                   messages=[{"role": "user", "content": "What is the capital of France?"}])
        resp = client.chat.completions.create(**ask, max_tokens=30)
        assert "Paris" in resp.choices[0].message.content
        # the same question as JSON of a schema (issue 33): it parses, validates and still knows
        shaped = client.chat.completions.create(**ask, max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL}})
        answer = json.loads(shaped.choices[0].message.content)
        assert set(answer) == {"country", "capital"} and "Paris" in answer["capital"]
        # a required tool call through SmolLM2's template (it has no tools: the fallback prompt)
        weather = dict(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=40, tools=[WEATHER],
                       tool_choice="required", messages=[{"role": "user", "content": "What is the weather in Paris?"}])
        called = client.chat.completions.create(**weather)
        (call,) = called.choices[0].message.tool_calls
        assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert "Paris" in json.loads(call.function.arguments)["city"]
        streamed = [d for chunk in client.chat.completions.create(**weather, stream=True) for c in chunk.choices
                    for d in c.delta.tool_calls or []]
        assert streamed[0].id and streamed[0].function.name == "get_weather"
        assert "".join(d.function.arguments or "" for d in streamed) == call.function.arguments


def test_replicas_starting_together_on_an_empty_cache_convert_once(tmp_path, monkeypatch):
    """``cadenza up`` starts its replicas at once: one converts, the others wait for it."""
    import threading

    from cadenza.node import embedded

    calls = []

    def slow_convert(model_dir):
        calls.append(model_dir)
        time.sleep(0.5)
        model_dir.mkdir(parents=True)
        (model_dir / embedded._STAMP).write_text("{}\n")
        (model_dir / "generation_config.json").write_text("{}\n")
        return model_dir

    monkeypatch.setattr(embedded, "_convert", slow_convert)
    target, results = tmp_path / "models" / "m", []
    threads = [threading.Thread(target=lambda: results.append(embedded.ensure_embedded_model(target)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [target] * 3 and len(calls) == 1


def test_a_conversion_by_an_older_cadenza_gets_the_model_cards_sampling_defaults(tmp_path, monkeypatch):
    from cadenza.node import embedded
    from cadenza.node.runner.models.generation import SamplingDefaults

    monkeypatch.setattr(embedded, "_convert", lambda model_dir: pytest.fail("must not convert again"))
    model_dir = tmp_path / "models" / "m"
    model_dir.mkdir(parents=True)
    (model_dir / embedded._STAMP).write_text("{}\n")
    (model_dir / "config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}\n')
    assert embedded.ensure_embedded_model(model_dir) == model_dir
    assert SamplingDefaults.from_model_dir(model_dir) == SamplingDefaults(temperature=0.2, top_p=0.9)
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
