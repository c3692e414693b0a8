"""The embedded default: ``cadenza serve`` with no --model serves SmolLM2-135M-Instruct."""

from __future__ import annotations

import time

import openai

from server_process import cadenza_server


def test_embedded_smollm2_answers_that_paris_is_the_capital_of_france(smollm2_dir, tmp_path):
    with cadenza_server([], tmp_path / "serve.log") as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        resp = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=30,
        )
    assert "Paris" in resp.choices[0].message.content


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
