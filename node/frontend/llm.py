"""Offline, synchronous use of the engine: the core and the output processor in one call stack.

``Engine`` is what scripts, benchmarks and white-box tests drive: ``add_request`` / ``step`` /
``generate``, with text. It owns an :class:`~cadenza.node.engine.engine_core.EngineCore` and an
:class:`~cadenza.node.frontend.output_processor.OutputProcessor` and applies the same rule as the
server's front end: a stop string found in the text aborts the request in the core with reason
``stop`` before the next step, so "finished" has one owner. No event loop, no thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from cadenza.node.core.config import EngineConfig
from cadenza.node.engine.engine_core import EngineCore
from cadenza.node.core.messages import AddRequest
from cadenza.node.core.request import Request, SamplingParams, choice_request_id
from cadenza.node.core.stats import EngineStats
from cadenza.node.frontend.output_processor import OutputProcessor, RequestOutput
from cadenza.node.frontend.tokenizer import Tokenizer


class Engine:
    """An engine core with text in and out, driven step by step.

    Args:
        config: the engine configuration.
        load_tokenizer: load ``tokenizer.json`` (needed for text and stop strings).

    Raises:
        ConfigError, FileNotFoundError, ModelConfigError: as :class:`EngineCore`.
    """

    def __init__(self, config: EngineConfig, load_tokenizer: bool = True) -> None:
        self.tokenizer = Tokenizer.from_pretrained(config.model) if load_tokenizer else None
        self.core = EngineCore(config, self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.outputs = OutputProcessor(self.tokenizer)
        self.observer = None  # sees each step's record (a Telemetry), when set

    def close(self) -> None:
        """Stop the core's KV endpoint and tensor-parallel workers, if any (also at exit)."""
        self.core.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def from_model(cls, model: str | Path, load_tokenizer: bool = True, **knobs: object) -> "Engine":
        """``Engine.from_model(path, token_budget=64, ...)`` (any field of the configuration)."""
        return cls(EngineConfig.from_knobs(str(model), **knobs), load_tokenizer=load_tokenizer)

    # the core's parts, for tests and scripts
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def block_manager(self):
        return self.core.block_manager

    @property
    def runner(self):
        return self.core.runner

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def model_config(self):
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                    arrival_time: float | None = None, traffic_class: str = "interactive",
                    tenant: str = "default", cache_salt: str | None = None, n: int = 1) -> Request:
        """Queue a request (see :meth:`EngineCore.add_request` for what it raises); with ``n``
        above 1, its ``n`` sequences (outputs under :func:`choice_request_id` ids), prefilled
        once. Returns the first sequence's request."""
        req = self.core.add_request(AddRequest(request_id, list(prompt_token_ids), sampling, traffic_class, tenant,
                                               arrival_time or 0.0, cache_salt, n=n))
        for i in range(n):
            self.outputs.add_request(choice_request_id(request_id, i), sampling)
        return req

    def abort_request(self, request_id: str) -> bool:
        """Drop a request now, freeing its KV blocks; False if it was not live."""
        self.outputs.drop(request_id)
        return self.core.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one step; one output per request that got a token (a stop string ends its request
        in the core before the next step)."""
        deltas, record = self.core.step()
        now = time.monotonic()
        if record is not None and self.observer is not None:
            self.observer.on_step(record, now)
        outputs, stopped = self.outputs.process(deltas, now)
        for request_id in stopped:
            self.core.abort_request(request_id, "stop")
        return outputs

    def stats(self) -> EngineStats:
        return self.core.stats()

    def reconfigure(self, changes: dict):
        return self.core.reconfigure(changes)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion; the generated token ids of each, in order."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, sp in zip(ids, prompts, params):
            self.add_request(rid, prompt, sp)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished_requests():
            for o in self.step():
                results[o.request_id].extend(o.token_ids)
        return [results[rid] for rid in ids]
