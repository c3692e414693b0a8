"""Structured outputs (issue 33): a request's ``response_format`` compiles to an llguidance
grammar, whose token mask is computed in a thread while the forward runs and applied before
sampling. Whatever the model, the output parses and validates against the schema — under chunked
prefill, preemption by recompute and random sampling; schemas the engine cannot enforce are named
400s. (Through the official openai client, streamed and not: ``server/test_openai_client.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from cadenza.node.core.request import SamplingParams, StructuredOutput
from cadenza.node.core.structured import GrammarError, check
from cadenza.node.frontend.llm import Engine
from cadenza.node.runner.sampler import apply_token_bitmask
from json_schemas import PERSON


def schema_of(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


def run(engine: Engine, prompts, params) -> tuple[list[str], list[str]]:
    """Each request's text and finish reason."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, sp in zip(ids, prompts, params):
        engine.add_request(rid, prompt, sp)
    tokens = {rid: [] for rid in ids}
    reasons = {}
    while engine.core.has_unfinished_requests():
        deltas, _record = engine.core.step()
        for d in deltas:
            tokens[d.request_id] += d.new_token_ids
            if d.finish_reason:
                reasons[d.request_id] = d.finish_reason
    tokenizer = Tokenizer.from_file(str(Path(engine.config.model) / "tokenizer.json"))
    return [tokenizer.decode(tokens[rid]) for rid in ids], [reasons[rid] for rid in ids]


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


# -- bounded schemas, so that a random model always reaches the end of one ------------------------

_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(-50, 50).map(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 99}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.one_of(st.integers(-9, 9), st.sampled_from(["x", "yes", None, True])), min_size=1, max_size=4,
             unique_by=repr).map(lambda values: {"enum": values}),
    st.sampled_from(["red", "blue"]).map(lambda v: {"const": v}),
)


def _objects(children):
    names = st.lists(st.from_regex(r"[a-z_]{1,6}", fullmatch=True), min_size=1, max_size=3, unique=True)
    return names.flatmap(lambda keys: st.lists(children, min_size=len(keys), max_size=len(keys)).map(
        lambda values: {"type": "object", "properties": dict(zip(keys, values)), "required": keys,
                        "additionalProperties": False}))


_schemas = st.recursive(_leaf, lambda children: st.one_of(
    _objects(children),
    children.map(lambda item: {"type": "array", "items": item, "maxItems": 2}),
    st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
), max_leaves=6)


@pytest.fixture(scope="module")
def tight_engine(tiny_llama_dir):
    """Chunked prefill (chunks of 8 in a budget of 24) and a KV cache small enough to preempt."""
    with Engine.from_model(tiny_llama_dir, max_model_len=320, token_budget=24, chunk_size=8, block_size=8,
                           num_kv_blocks=40) as engine:
        yield engine


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_objects(_schemas), seed=st.integers(0, 2**31))
def test_outputs_always_validate_under_chunked_prefill_and_preemption(tight_engine, schema, seed):
    check(schema_of(schema))
    prompts = prompts_of([30, 9, 41, 17], seed=seed % 1000)
    params = [SamplingParams(max_tokens=270, temperature=1.3, seed=seed + i, structured=schema_of(schema))
              for i in range(len(prompts))]
    texts, reasons = run(tight_engine, prompts, params)
    assert reasons == ["stop"] * len(prompts)  # every grammar here is finite: each request completes it
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert tight_engine.block_manager.num_used_blocks == 0


def test_json_object_mode_gives_an_object_and_preemption_changes_no_token(tiny_llama_dir):
    prompts = prompts_of([20, 33, 40, 47, 12, 60], seed=4)
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured=schema_of(PERSON) if i % 2 else
                             StructuredOutput("json_object")) for i in range(len(prompts))]
    with Engine.from_model(tiny_llama_dir, max_model_len=320, token_budget=64, chunk_size=16) as roomy:
        expected = run(roomy, prompts, params)
    with Engine.from_model(tiny_llama_dir, max_model_len=160, token_budget=24, chunk_size=8, block_size=8,
                           num_kv_blocks=20) as tight:
        got = run(tight, prompts, params)
        assert tight.core.stats().num_preemptions > 0
    assert got == expected  # the sampler's noise depends on (seed, position) only; matchers never roll back
    for i, (text, reason) in enumerate(zip(*expected)):
        if reason == "stop":
            value = json.loads(text)
            assert isinstance(value, dict)
            if i % 2:
                jsonschema.validate(value, PERSON)
        else:  # json_object allows any object: a random model may still be inside it at max_tokens
            assert reason == "length" and text.startswith("{")


def test_greedy_and_logprobs_follow_the_mask_and_free_requests_are_untouched(tiny_llama_dir):
    prompt = prompts_of([25], seed=9)[0]
    enum = {"enum": ["alpha", "beta", "gamma"]}
    with Engine.from_model(tiny_llama_dir, max_model_len=320) as engine:
        free = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        alone = engine.generate([prompt], free)[0]
        texts, reasons = run(engine, [prompt, prompt], [
            SamplingParams(max_tokens=30, temperature=0, logprobs=2, structured=schema_of(enum)), free])
        assert engine.core.grammars.active is False  # finished requests leave no matcher behind
    assert json.loads(texts[0]) in enum["enum"] and reasons[0] == "stop"
    tokenizer = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    assert texts[1] == tokenizer.decode(alone)  # a structured neighbour changes nothing for a free request


def test_the_engine_reports_the_grammar_s_logprobs_over_allowed_tokens_only(tiny_llama_dir):
    with Engine.from_model(tiny_llama_dir, max_model_len=320) as engine:
        engine.add_request("c", prompts_of([10])[0], SamplingParams(
            max_tokens=10, temperature=0, logprobs=5, structured=schema_of({"enum": [True, False]})))
        entries = []
        while engine.core.has_unfinished_requests():
            deltas, _ = engine.core.step()
            entries += [e for d in deltas for e in d.logprobs or []]
    first_logprob, best = entries[0]
    assert len(best) == 5 and best[0][1] == first_logprob
    assert sum(lp > float("-inf") for _t, lp in best) == 2  # "t" or "f" starts the only two values
    assert sum(torch.tensor([lp for _t, lp in best if lp > float("-inf")]).exp()) == pytest.approx(1.0, abs=1e-5)


def test_each_of_n_choices_follows_its_own_matcher(tiny_llama_dir):
    with Engine.from_model(tiny_llama_dir, max_model_len=320) as engine:
        engine.add_request("c", prompts_of([21])[0], SamplingParams(max_tokens=120, temperature=1.2, seed=3,
                                                                    structured=schema_of(PERSON)), n=3)
        texts = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                texts[out.request_id] = texts.get(out.request_id, "") + out.text
        assert engine.core.grammars.active is False
    assert sorted(texts) == ["c", "c#1", "c#2"] and len(set(texts.values())) == 3  # each its own seed
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_a_compiled_grammar_is_reused_and_a_failure_ends_only_its_request(tiny_llama_dir):
    with Engine.from_model(tiny_llama_dir, max_model_len=320) as engine:
        grammars = engine.core.grammars
        same = SamplingParams(max_tokens=60, temperature=1.0, seed=1, structured=schema_of(PERSON))
        run(engine, prompts_of([8, 9, 10]), [same] * 3)
        assert list(grammars._compiled) == [schema_of(PERSON)]  # compiled once for three requests
        # a constraint the server would refuse (it checks first) fails in the engine: that request
        # ends aborted, its neighbour goes on
        bad = SamplingParams(max_tokens=20, structured=schema_of({"type": "array", "uniqueItems": True}))
        _texts, reasons = run(engine, prompts_of([8, 9]), [bad, SamplingParams(max_tokens=5, ignore_eos=True)])
        assert reasons == ["abort", "length"]


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
NESTED_REPEAT = {"type": "string", "pattern": "^(([a-z]{1,50}){1,50}){1,50}$"}


@pytest.mark.parametrize("schema, reason", [
    (CYCLE, "NoExtensionBias"),  # passes the server's check; matches no output at all
    (NESTED_REPEAT, "too many expressions"),  # llguidance's lexer gives up part way through the string
])
def test_a_grammar_that_fails_in_the_engine_fails_its_request_never_finishes_it_as_stopped(
        tiny_llama_dir, schema, reason):
    check(schema_of(schema))  # the server lets both through
    with Engine.from_model(tiny_llama_dir, max_model_len=320) as engine:
        # seed 1: the model does not close the string before llguidance's lexer gives up
        bad = SamplingParams(max_tokens=200, temperature=1.0, seed=1, ignore_eos=True, structured=schema_of(schema))
        _texts, reasons = run(engine, prompts_of([8, 9]), [bad, SamplingParams(max_tokens=5, ignore_eos=True)])
        assert reasons == ["abort", "length"]  # never "stop": its output is not a complete JSON value
        [failure] = engine.core.take_failures()
        assert failure.request_id == "r0" and failure.kind == "grammar" and failure.status == 400
        assert failure.reason == "response_format" and reason in failure.message and "<state>" not in failure.message
        assert engine.core.take_failures() == [] and not engine.core.grammars.active


def test_a_model_folder_without_a_tokenizer_refuses_structured_requests(tmp_path, tiny_llama_dir):
    import shutil

    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / name, tmp_path / name)
    with Engine.from_model(tmp_path, load_tokenizer=False, max_model_len=320) as engine:
        with pytest.raises(ValueError, match="tokenizer.json"):
            engine.add_request("x", [5, 6], SamplingParams(structured=StructuredOutput("json_object")))
        assert not engine.core.has_unfinished_requests()


def test_the_bitmask_forbids_exactly_the_unset_bits():
    logits = torch.zeros(3, 70)
    words = torch.zeros(2, 3, dtype=torch.int32)
    words[0, 0] = 0b101  # row 0: tokens 0 and 2
    words[1, 1] = 1 << 4  # row 2: token 36
    words[1, 2] = -(2**31)  # and token 95, past the 70 logits: ignored
    apply_token_bitmask(logits, [0, 2], words)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[1]).all()
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [36]


@pytest.mark.parametrize("schema, message", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "float"}, "float"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "string", "pattern": "(("}, "regex"),
])
def test_what_the_engine_cannot_enforce_is_refused_with_a_reason(schema, message):
    with pytest.raises(GrammarError, match=message):
        check(schema_of(schema))


def test_a_schema_too_large_or_not_an_object_is_refused():
    with pytest.raises(GrammarError, match="at most"):
        check(StructuredOutput("json_schema", json.dumps({"enum": ["x" * 70_000]})))
    with pytest.raises(GrammarError, match="must be a JSON object"):
        check(StructuredOutput("json_schema", "[1]"))
    with pytest.raises(ValueError, match="needs its schema"):
        StructuredOutput("json_schema")
