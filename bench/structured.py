"""What a JSON schema costs: decode tok/s at concurrency 8, free against constrained, and the
grammar compile time of a 50-field schema.

The engine core (no server) decodes 8 requests of SmolLM2-135M-Instruct (fp32, this machine's
threads) two ways, interleaved round by round so the machine's drift falls on both alike: free
generation, and every request under ``response_format: json_schema`` with a 50-field schema
(strings with a ``maxLength``, the costliest case for llguidance's masks, integers with bounds,
enums, arrays, a nested object). Each step's masks are computed in the mask thread while the
forward runs (``node/engine/grammar.py``), applied to the logits, and each matcher advances by its
token. Sampling is seeded (temperature 1), the same for both ways; the measured steps come after
the prompts and the first token, inside the JSON (the schema's shortest instance is longer than
the window). Prefix caching is off; the prompts are fresh random ids.

Target (issue 33): constrained decode tok/s >= 0.9x free (``ratio``). Also printed: the compile
of the 50-field schema against SmolLM2's tokens (the engine's compile thread does it as a request
arrives; median of 5, cache cleared), and the server's tokenizer-free check of it.
``--quick``: the tests' tiny model, a few steps.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench.common import arguments, bench_model, machine, report
from cadenza.node.core import structured as structured_check
from cadenza.node.core.messages import AddRequest
from cadenza.node.core.request import SamplingParams, StructuredOutput
from cadenza.node.engine.engine_core import EngineCore

BATCH, PROMPT, STEPS, ROUNDS = 8, 64, 32, 5
TARGET = 0.9


def fifty_fields() -> dict:
    """A 50-field object schema: every kind OpenAI's strict mode allows, in turn."""
    kinds = [
        {"type": "string", "maxLength": 24},
        {"type": "integer", "minimum": 0, "maximum": 100000},
        {"enum": ["red", "green", "blue", "cyan"]},
        {"type": "boolean"},
        {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        {"type": "number"},
        {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string", "maxLength": 12}},
         "required": ["x", "y"], "additionalProperties": False},
        {"type": ["string", "null"], "maxLength": 16},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def decode_tok_s(core: EngineCore, constraint: StructuredOutput | None, steps: int, round_: int) -> float:
    """Decode tok/s of ``BATCH`` fresh requests, each under ``constraint`` (None: free)."""
    g = torch.Generator().manual_seed(round_)
    ids = [f"r{round_}-{constraint is not None}-{i}" for i in range(BATCH)]
    for i, rid in enumerate(ids):
        prompt = torch.randint(10, core.model_config.vocab_size, (PROMPT,), generator=g).tolist()
        sampling = SamplingParams(max_tokens=steps + 8, temperature=1.0, seed=round_ * BATCH + i,
                                  ignore_eos=True, structured=constraint)
        core.add_request(AddRequest(rid, prompt, sampling))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()):
        core.step()
    core.step()  # the first decode
    started = time.perf_counter()
    done = 0
    for _ in range(steps):
        deltas, _record = core.step()
        done += len(deltas)
    elapsed = time.perf_counter() - started
    assert done == BATCH * steps, "a constrained request ended inside the window: the schema is too short"
    for rid in ids:
        core.abort_request(rid)
    return done / elapsed


def compile_ms(core: EngineCore, constraint: StructuredOutput, repeats: int = 5) -> tuple[float, float]:
    """Median ms of compiling ``constraint`` against the model's tokens (the engine's compile), and
    of the server's tokenizer-free check."""
    import llguidance

    grammars = core.grammars
    tokenizer = grammars._llg_tokenizer()
    grammar = structured_check.grammar_of(constraint)
    engine, server = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        engine.append(time.perf_counter() - started)
        assert not matcher.is_error(), matcher.get_error()
        structured_check.check.cache_clear()
        started = time.perf_counter()
        structured_check.check(constraint)
        server.append(time.perf_counter() - started)
    return round(1000 * statistics.median(engine), 2), round(1000 * statistics.median(server), 2)


def main() -> None:
    args = arguments(__doc__)
    steps, rounds = (4, 2) if args.quick else (STEPS, ROUNDS)
    core = EngineCore.from_model(bench_model(args.quick), token_budget=512, chunk_size=None, prefix_caching=False,
                                 max_num_seqs=BATCH)
    constraint = StructuredOutput("json_schema", json.dumps(fifty_fields()))
    try:
        decode_tok_s(core, constraint, 2, rounds)  # warm: the grammar tokenizer (once) and the compile cache
        figures: dict[str, list[float]] = {"free": [], "json_schema": []}
        for r in range(rounds):
            figures["free"].append(decode_tok_s(core, None, steps, r))
            figures["json_schema"].append(decode_tok_s(core, constraint, steps, r))
        engine_ms, server_ms = compile_ms(core, constraint)
    finally:
        core.close()
    medians = {name: round(statistics.median(v), 2) for name, v in figures.items()}
    for name, value in medians.items():
        print(f"{name:<12} {value:>8} decode tok/s at concurrency {BATCH} (median of {rounds} rounds)")
    print(f"compile of the 50-field schema against the model's tokens: {engine_ms} ms (median of 5); "
          f"the server's check: {server_ms} ms")
    report({"benchmark": "structured", "ratio": round(medians["json_schema"] / medians["free"], 3), "target": TARGET,
            "decode_tok_s": medians, "batch": BATCH, "compile_50_fields_ms": engine_ms, "check_50_fields_ms": server_ms,
            "machine": machine()}, quick=args.quick)


if __name__ == "__main__":
    main()
