"""Traffic-class headers and W3C trace context on replayed requests (fake server: conftest.py)."""

from __future__ import annotations

import re

import pytest

from cadenza.loadgen.client import ReplayConfig, replay
from cadenza.loadgen.headers import ClassRule, new_traceparent, request_headers
from cadenza.loadgen.trace import TraceRequest

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-01$")


def _config(base: str, **kw) -> ReplayConfig:
    return ReplayConfig(base_url=f"{base}/v1", model="fake-model", **kw)


def test_batch_above_sends_long_prompts_as_batch_and_the_rest_as_interactive():
    rule = ClassRule(batch_above=100)
    assert [rule.class_for(n) for n in (1, 99, 100, 5000)] == [
        "interactive", "interactive", "batch", "batch"]


def test_a_fixed_class_applies_to_every_prompt_and_no_rule_sends_no_class():
    assert {ClassRule(fixed="background").class_for(n) for n in (1, 10_000)} == {"background"}
    assert ClassRule().class_for(10_000) is None


@pytest.mark.parametrize("kwargs", [{"fixed": "urgent"}, {"batch_above": 0},
                                    {"fixed": "batch", "batch_above": 10}])
def test_a_class_rule_rejects_unknown_classes_bad_thresholds_and_both_at_once(kwargs):
    with pytest.raises(ValueError):
        ClassRule(**kwargs)


def test_traceparents_are_version_00_sampled_with_random_nonzero_ids():
    parents = [new_traceparent() for _ in range(200)]
    for header, trace_id in parents:
        match = TRACEPARENT.match(header)
        assert match and match.group(1) == trace_id
        assert match.group(1).strip("0") and match.group(2).strip("0")
    assert len({p.trace_id for p in parents}) == 200


def test_request_headers_leave_out_what_is_not_given():
    assert request_headers() == {}
    assert request_headers("k", "batch", "00-x") == {
        "Authorization": "Bearer k", "x-cadenza-class": "batch", "traceparent": "00-x"}


async def test_replay_sends_each_request_with_the_class_its_prompt_length_picks(
        fake_base_url, fake_app, fake):
    trace = [TraceRequest(0.0, n, 2) for n in (5, 30, 12, 31)]
    prompts = ["x" * r.input_len for r in trace]
    result = await replay(trace, prompts, _config(fake_base_url, classes=ClassRule(batch_above=30)))

    sent = {h["prompt"]: h["headers"].get("x-cadenza-class") for h in fake_app[fake.RECEIVED_HEADERS]}
    assert sent == {"x" * 5: "interactive", "x" * 30: "batch", "x" * 12: "interactive",
                    "x" * 31: "batch"}
    assert [r.traffic_class for r in result.records] == ["interactive", "batch", "interactive", "batch"]
    assert [r.as_dict()["class"] for r in result.records] == ["interactive", "batch", "interactive", "batch"]


async def test_replay_with_a_fixed_class_sends_it_on_every_request(fake_base_url, fake_app, fake):
    trace = [TraceRequest(0.0, n, 2) for n in (5, 500)]
    result = await replay(trace, ["a" * 5, "b" * 500],
                          _config(fake_base_url, classes=ClassRule(fixed="background")))
    assert [h["headers"]["x-cadenza-class"] for h in fake_app[fake.RECEIVED_HEADERS]] == [
        "background", "background"]
    assert {r.as_dict()["class"] for r in result.records} == {"background"}


async def test_replay_without_a_class_sends_no_class_header_and_records_null(
        fake_base_url, fake_app, fake):
    result = await replay([TraceRequest(0.0, 4, 2)], ["abcd"], _config(fake_base_url))
    (received,) = fake_app[fake.RECEIVED_HEADERS]
    assert "x-cadenza-class" not in received["headers"]
    assert result.records[0].as_dict()["class"] is None


async def test_every_request_carries_a_distinct_traceparent_whose_id_is_in_its_record(
        fake_base_url, fake_app, fake):
    trace = [TraceRequest(0.0, 3 + i, 2) for i in range(6)] + [TraceRequest(0.0, 20, fake.FAIL_MAX_TOKENS)]
    prompts = ["p" * r.input_len for r in trace]
    result = await replay(trace, prompts, _config(fake_base_url))

    sent = {h["prompt"]: h["headers"]["traceparent"] for h in fake_app[fake.RECEIVED_HEADERS]}
    assert len(sent) == len(trace)
    assert all(TRACEPARENT.match(h) for h in sent.values())
    assert len({h.split("-")[1] for h in sent.values()}) == len(trace)  # fresh trace ids
    assert len({h.split("-")[2] for h in sent.values()}) == len(trace)  # and parent span ids
    for record, prompt in zip(result.records, prompts):
        assert record.as_dict()["trace_id"] == TRACEPARENT.match(sent[prompt]).group(1)
    assert not result.records[-1].ok  # a failed request keeps its trace id too
