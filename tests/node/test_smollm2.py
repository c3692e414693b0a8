"""The embedded default: ``cadenza serve`` with no --model serves SmolLM2-135M-Instruct."""

from __future__ import annotations

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
