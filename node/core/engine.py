"""The synchronous engine core: ``add_request``, ``abort_request``, ``step``.

One ``step()`` is one scheduler decision, one forward pass and one round of token updates: new
tokens are appended, detokenized incrementally, checked against stop conditions, and finished
requests release their KV blocks. The async server front (:mod:`cadenza.node.frontend.async_engine`)
drives this from a background thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from cadenza.node.core.block_manager import KVBlockManager
from cadenza.node.core.config import EngineConfig, SchedulerConfig, resolve_max_model_len
from cadenza.node.frontend.detokenizer import IncrementalDetokenizer
from cadenza.node.runner.model_runner import ModelRunner
from cadenza.node.runner.models.config import ModelConfig
from cadenza.node.runner.models.generation import SamplingDefaults
from cadenza.node.core.request import Request, RequestStatus, SamplingParams
from cadenza.node.core.scheduler import Scheduler, SchedulerOutput
from cadenza.node.frontend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (a delta).

    Attributes:
        token_ids: tokens generated this step (at most one).
        text: newly decodable text; never a broken UTF-8 sequence, never part of a stop string.
        finish_reason: ``stop`` | ``length`` | ``abort`` once finished, else None.
        num_prompt_tokens, num_output_tokens: counts so far (usage).
        num_cached_tokens: prompt tokens served from the prefix cache.
        time: ``time.monotonic()`` when the step that produced it finished (seconds).
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    time: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepObserver(Protocol):
    """Sees every step right after it ran, in the engine thread (telemetry attaches one)."""

    def on_step(self, out: SchedulerOutput, seconds: float, now: float) -> None:
        """``out``: the step's rows, preemptions and admissions; ``seconds``: its model time;
        ``now``: ``time.monotonic()`` at its end."""
        ...


class Engine:
    """Chunked-prefill engine over one model.

    Args:
        config: the engine configuration; checked again against the model here.
        load_tokenizer: load ``tokenizer.json`` (required for text; tests of token ids alone may
            skip it).

    Raises:
        ConfigError: a configuration that can never serve a request on this model.
        FileNotFoundError, ModelConfigError: the model folder is unusable.
    """

    def __init__(self, config: EngineConfig, load_tokenizer: bool = True) -> None:
        self.model_config = ModelConfig.from_pretrained(config.model)
        model_max = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            model_max = min(model_max, self.model_config.sliding_window)
        resolve_max_model_len(config.scheduler.max_model_len, model_max, model_max)  # refuse before loading
        rope_len = config.scheduler.max_model_len or model_max
        self.runner = ModelRunner(config, self.model_config, max_model_len=min(rope_len, model_max))
        capacity = self.runner.num_kv_blocks * config.cache.block_size
        max_model_len = resolve_max_model_len(config.scheduler.max_model_len, model_max, capacity)
        self.config = config.replace(scheduler=dataclasses.replace(config.scheduler, max_model_len=max_model_len))
        self.block_manager = KVBlockManager(
            self.runner.num_kv_blocks, config.cache.block_size, prefix_caching=config.scheduler.prefix_caching
        )
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager)
        self.tokenizer: Tokenizer | None = None
        if load_tokenizer:
            self.tokenizer = Tokenizer.from_pretrained(config.model)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= self.tokenizer.eos_token_ids
        self.eos_token_ids = frozenset(eos)
        self.sampling_defaults = SamplingDefaults.from_model_dir(config.model)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.last_step_tokens = 0  # tokens the last step computed (0: nothing was schedulable)
        self.step_time_s: deque[float] = deque(maxlen=1024)  # measured model time of recent steps
        self.observer: StepObserver | None = None  # telemetry, when attached

    @classmethod
    def from_model(cls, model: str | Path, **scheduler_and_cache: object) -> "Engine":
        """Convenience for scripts and tests: ``Engine.from_model(path, token_budget=64, ...)``."""
        from cadenza.node.core.config import CacheConfig, SchedulerConfig

        sched = {k: v for k, v in scheduler_and_cache.items() if k in SchedulerConfig.__dataclass_fields__}
        cache = {k: v for k, v in scheduler_and_cache.items() if k in CacheConfig.__dataclass_fields__}
        rest = {k: v for k, v in scheduler_and_cache.items() if k not in sched and k not in cache}
        load_tokenizer = bool(rest.pop("load_tokenizer", True))
        config = EngineConfig(model=str(model), scheduler=SchedulerConfig(**sched), cache=CacheConfig(**cache), **rest)
        return cls(config, load_tokenizer=load_tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len  # type: ignore[return-value]

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        arrival_time: float | None = None,
        traffic_class: str = "interactive",
        tenant: str = "default",
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request in its traffic class.

        ``cache_salt`` keeps its prefix-cache entries apart from those of requests with another
        salt (see :mod:`cadenza.node.core.block_manager`); the scheduler adds the tenant's name to it
        when the policy isolates tenants.

        Raises:
            ValueError: empty prompt, a token id outside the vocabulary, a duplicate id.
            AdmissionError: refused by admission control: 400/413 (can never fit: prompt +
                ``max_tokens`` over ``max_model_len``, a prompt above its tenant's quota) or 429
                (queue depth or tenant quota reached; ``retry_after`` says when to come back).
        """
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        req = Request(request_id, list(prompt_token_ids), sampling, eos_token_ids=self.eos_token_ids,
                      traffic_class=traffic_class, tenant=tenant, cache_salt=cache_salt)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self.scheduler.add_request(req)
        if self.tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, sampling.stop)
        return req

    def abort_request(self, request_id: str) -> bool:
        """Drop a request now, freeing its KV blocks; False if it was not live."""
        req = self.scheduler.abort_request(request_id)
        self._release(request_id)
        return req is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Schedule, run and apply one step; one output per request that got a token."""
        out = self.scheduler.schedule()
        self.last_step_tokens = out.num_tokens
        if out.is_empty:
            return []
        started = time.perf_counter()
        tokens = self.runner.execute(out)
        elapsed = time.perf_counter() - started
        self.scheduler.observe_step_time(out, elapsed)
        self.step_time_s.append(elapsed)
        now = time.monotonic()
        if self.observer is not None:
            self.observer.on_step(out, elapsed, now)
        outputs = []
        for req, token, finished in self.scheduler.update_from_output(out, tokens):
            text = ""
            detok = self._detokenizers.get(req.request_id)
            if detok is not None:
                if finished != RequestStatus.FINISHED_STOPPED:  # stop tokens add no text
                    text = detok.add_token(token)
                if detok.stopped and finished is None:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                    finished = RequestStatus.FINISHED_STOPPED
                elif detok.stopped:
                    req.status = finished = RequestStatus.FINISHED_STOPPED
                elif finished is not None:
                    text += detok.flush()
            if finished is not None:
                self._release(req.request_id)
            outputs.append(
                RequestOutput(
                    req.request_id, [token], text, finished.finish_reason if finished else None,
                    req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens, now,
                )
            )
        return outputs

    def _release(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self.runner.release(request_id)

    def stats(self) -> dict:
        """Queues per class, KV blocks by state, scheduler counters and step time (a snapshot)."""
        snapshot = self.scheduler.snapshot()
        if self.step_time_s:
            times = sorted(self.step_time_s)
            snapshot["step_time_ms_mean"] = round(1000 * sum(times) / len(times), 3)
            snapshot["step_time_ms_p99"] = round(1000 * times[min(len(times) - 1, int(0.99 * len(times)))], 3)
        return snapshot

    def reconfigure(self, changes: dict) -> SchedulerConfig:
        """Change knobs live, from the next step: ``token_budget``, ``chunk_size``,
        ``max_num_seqs``, ``prefix_caching`` and any policy setting (``step_time_target_ms``,
        ``classes``, ``tenants``, ``default_tenant``, ``max_preemptions``, ``watermark``).

        Returns:
            The configuration now in force.

        Raises:
            ConfigError, PolicyError: an unknown key or an invalid value; nothing changes.
        """
        current = self.scheduler.config
        knobs = {"token_budget", "chunk_size", "max_num_seqs", "prefix_caching"}
        policy_keys = set(changes) - knobs
        policy = current.policy.updated({k: changes[k] for k in policy_keys}) if policy_keys else current.policy
        config = dataclasses.replace(current, **{k: changes[k] for k in knobs & set(changes)}, policy=policy)
        self.scheduler.reconfigure(config)
        self.config = self.config.replace(scheduler=config)
        return config

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion (offline use); the generated token ids of each, in order."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, sp in zip(ids, prompts, params):
            self.add_request(rid, prompt, sp)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished_requests():
            for o in self.step():
                results[o.request_id].extend(o.token_ids)
        return [results[rid] for rid in ids]
