"""Trace loading (Azure CSV, JSONL) and scaling for replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadenza.loadgen.trace import TraceRequest, load_trace, scale_trace

AZURE = Path(__file__).resolve().parents[2] / "data" / "traces" / "azure2023"
CONV = AZURE / "AzureLLMInferenceTrace_conv.csv"
CODE = AZURE / "AzureLLMInferenceTrace_code.csv"


def _jsonl(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _trace(*rows: tuple[float, int, int]) -> list[TraceRequest]:
    return [TraceRequest(*r) for r in rows]


# --- loading -------------------------------------------------------------------------------


def test_azure_csv_gives_offsets_from_the_first_request_and_both_lengths():
    trace = load_trace(CONV)
    # 2023-11-16 18:15:46.6805900,374,44 / 18:15:50.9951690,396,109 / 18:15:51.2224670,879,55
    assert trace[0] == TraceRequest(0.0, 374, 44)
    assert trace[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert (trace[1].input_len, trace[1].output_len) == (396, 109)
    assert trace[2].arrival_s == pytest.approx(4.541877, abs=1e-6)
    assert len(trace) == 19366  # as the data README says


def test_both_azure_traces_load_sorted_and_within_the_hour():
    for path, count in ((CONV, 19366), (CODE, 8819)):
        trace = load_trace(path)
        assert len(trace) == count
        arrivals = [r.arrival_s for r in trace]
        assert arrivals == sorted(arrivals)
        assert 0 < arrivals[-1] <= 3600


def test_jsonl_reads_milliseconds_and_ignores_other_keys(tmp_path):
    path = _jsonl(tmp_path, [
        {"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 20, "output_length": 4},
        {"timestamp": 4000.5, "input_length": 30, "output_length": 5, "note": "x"},
    ])
    assert load_trace(path) == _trace((0.0, 10, 3), (0.5, 20, 4), (3.0005, 30, 5))


def test_trace_is_sorted_by_arrival(tmp_path):
    path = _jsonl(tmp_path, [
        {"timestamp": 300, "input_length": 3, "output_length": 1},
        {"timestamp": 100, "input_length": 1, "output_length": 1},
        {"timestamp": 200, "input_length": 2, "output_length": 1},
    ])
    assert [r.input_len for r in load_trace(path)] == [1, 2, 3]
    assert load_trace(path)[2].arrival_s == pytest.approx(0.2)


def test_csv_with_extra_columns_a_zone_and_blank_lines_loads(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("id,TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "a,2024-05-10 00:00:00.009930+00:00,100,7\n\n"
                    "b,2024-05-10 00:00:01.509930+00:00,200,0\n")
    assert load_trace(path) == _trace((0.0, 100, 7), (1.5, 200, 0))


@pytest.mark.parametrize("content, message", [
    ('{"timestamp": 0, "input_length": 1, "output_length": 1}\n{"timestamp": 5, "input_',
     ":2: not a JSON object"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1}\n\n{"timestamp": 5}\n',
     ":3: missing key(s) input_length, output_length"),
    ('{"timestamp": "soon", "input_length": 1, "output_length": 1}\n', ":1: bad timestamp"),
    ('{"timestamp": 0, "input_length": 1.5, "output_length": 1}\n', ":1: bad input_length"),
    ('{"timestamp": 0, "input_length": 1, "output_length": -2}\n', ":1: negative output_length"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,2\nyesterday,10,2\n",
     ":3: bad TIMESTAMP"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,ten,2\n",
     ":2: bad ContextTokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10\n",
     ":2: expected 3 fields"),
    ("time,prompt,output\n1,2,3\n", ":1: not a JSONL trace and the CSV header lacks"),
    ("\n\n", "the trace is empty"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "holds no requests"),
])
def test_malformed_trace_raises_value_error_naming_the_line(tmp_path, content, message):
    path = tmp_path / "bad.trace"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        load_trace(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_missing_trace_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "nope.csv")


# --- scaling -------------------------------------------------------------------------------

TRACE = _trace((0.0, 100, 10), (1.0, 200, 20), (2.0, 301, 31), (4.0, 3, 1))


def test_time_scale_stretches_arrivals():
    scaled = scale_trace(TRACE, time_scale=2.0).requests
    assert [r.arrival_s for r in scaled] == [0.0, 2.0, 4.0, 8.0]
    assert [(r.input_len, r.output_len) for r in scaled] == [
        (100, 10), (200, 20), (301, 31), (3, 1)]


def test_time_scale_zero_sends_everything_at_once():
    assert {r.arrival_s for r in scale_trace(TRACE, time_scale=0).requests} == {0.0}


def test_length_scale_rounds_and_keeps_at_least_one_token():
    scaled = scale_trace(TRACE, length_scale=0.1).requests
    assert [(r.input_len, r.output_len) for r in scaled] == [(10, 1), (20, 2), (30, 3), (1, 1)]


def test_zero_lengths_become_one_token():
    scaled = scale_trace(_trace((0.0, 0, 0))).requests
    assert (scaled[0].input_len, scaled[0].output_len) == (1, 1)


def test_caps_apply_after_length_scaling():
    scaled = scale_trace(TRACE, length_scale=2.0, max_input_len=250, max_output_len=30).requests
    assert [(r.input_len, r.output_len) for r in scaled] == [
        (200, 20), (250, 30), (250, 30), (6, 2)]


def test_num_requests_keeps_the_first_n():
    assert scale_trace(TRACE, num_requests=2).requests == TRACE[:2]


def test_duration_keeps_arrivals_within_the_scaled_window():
    # After x0.5 the arrivals are 0, 0.5, 1.0, 2.0: a 1 s window keeps three (inclusive).
    scaled = scale_trace(TRACE, time_scale=0.5, duration_s=1.0).requests
    assert [r.arrival_s for r in scaled] == [0.0, 0.5, 1.0]


def test_duration_and_num_requests_together_keep_the_shorter_prefix():
    assert len(scale_trace(TRACE, duration_s=10.0, num_requests=3).requests) == 3
    assert len(scale_trace(TRACE, duration_s=1.5, num_requests=3).requests) == 2


def test_scaling_description_reports_what_was_done():
    scaling = scale_trace(TRACE, time_scale=2.0, length_scale=0.5, max_input_len=100,
                          num_requests=3).scaling
    assert scaling.as_dict() == {
        "time_scale": 2.0, "length_scale": 0.5, "max_input_len": 100, "max_output_len": None,
        "num_requests": 3, "duration_s": None, "original_requests": 4, "kept_requests": 3,
        "original_span_s": 4.0, "scaled_span_s": 4.0,
        "mean_input_len": pytest.approx((50 + 100 + 100) / 3),
        "mean_output_len": pytest.approx((5 + 10 + 16) / 3),
    }
    text = scaling.describe()
    for fact in ("x2", "0.5x the original request rate", "lengths x0.5", "capped at 100",
                 "first 3 requests", "Kept 3 of 4"):
        assert fact in text


@pytest.mark.parametrize("options", [
    {"time_scale": -1.0}, {"length_scale": 0.0}, {"duration_s": 0.0}, {"max_input_len": 0},
    {"max_output_len": 0}, {"num_requests": 0},
])
def test_invalid_scaling_options_are_rejected(options):
    with pytest.raises(ValueError):
        scale_trace(TRACE, **options)


def test_class_and_tenant_columns_are_read_when_present(tmp_path):
    path = _jsonl(tmp_path, [{"timestamp": 0, "input_length": 5, "output_length": 2, "class": "batch",
                              "tenant": "etl"},
                             {"timestamp": 10, "input_length": 6, "output_length": 3, "class": ""},
                             {"timestamp": 20, "input_length": 7, "output_length": 4}])
    loaded = load_trace(path)
    assert [(r.traffic_class, r.tenant) for r in loaded] == [("batch", "etl"), (None, None), (None, None)]
    scaled = scale_trace(loaded, time_scale=2.0, length_scale=2.0).requests
    assert (scaled[0].traffic_class, scaled[0].tenant, scaled[0].input_len) == ("batch", "etl", 10)
    csv = tmp_path / "trace.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,class,tenant\n"
                   "2023-11-16 18:15:46.0,10,2,interactive,chat\n2023-11-16 18:15:47.0,11,3,,\n")
    assert [(r.traffic_class, r.tenant) for r in load_trace(csv)] == [("interactive", "chat"), (None, None)]


def test_an_unknown_class_in_a_trace_names_the_line(tmp_path):
    path = _jsonl(tmp_path, [{"timestamp": 0, "input_length": 5, "output_length": 2, "class": "urgent"}])
    with pytest.raises(ValueError, match=r"trace.jsonl:1: bad class 'urgent'"):
        load_trace(path)


def test_infinite_scales_and_timestamps_are_refused(tmp_path):
    with pytest.raises(ValueError, match="finite"):
        scale_trace(_trace((0.0, 5, 5), (1.0, 5, 5)), time_scale=float("inf"))
    with pytest.raises(ValueError, match="finite"):
        scale_trace(_trace((0.0, 5, 5)), length_scale=float("nan"))
    path = tmp_path / "inf.jsonl"
    path.write_text('{"timestamp": Infinity, "input_length": 5, "output_length": 2}\n')
    with pytest.raises(ValueError, match="bad timestamp"):
        load_trace(path)
