"""The engine core: the scheduler, the KV block manager and the model runner, over token ids.

One :meth:`EngineCore.step` is one scheduler decision, one forward pass and one round of token
updates; it returns each request's new token ids and finish reason
(:class:`~cadenza.node.core.messages.RequestDelta`) and the step's record for telemetry. The core
never sees text: the front end tokenizes, detokenizes and matches stop strings, and ends a request
on a stop string by aborting it here with the reason ``stop`` — so "finished" has one owner. The
busy loop that feeds it messages, in its own process or in a thread, is
:mod:`cadenza.node.engine.loop`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path

from cadenza.node.core import disagg_rule
from cadenza.node.core.block_manager import KVBlockManager
from cadenza.node.core.config import EngineConfig, SchedulerConfig, resolve_max_model_len
from cadenza.node.core.knobs import config_view, reconfigured
from cadenza.node.engine.kv_link import ASSUMED_LINK_BYTES_PER_S, KVLink
from cadenza.node.core.parallel import check_tensor_parallel
from cadenza.node.core.messages import AddRequest, EngineReady, KVEndpoint, RequestDelta, RequestFailure, StepRecord
from cadenza.node.core.request import MAX_N, Request, RequestStatus, choice_request_id, choice_sampling
from cadenza.node.core.scheduler import Scheduler
from cadenza.node.core.stats import EngineStats
from cadenza.node.credentials import require_kv_token
from cadenza.node.kv_transfer.protocol import DTYPE_BYTES, Fingerprint
from cadenza.node.model_digest import model_digest
from cadenza.node.engine.grammar import GrammarFailure, Grammars
from cadenza.node.engine.tp_workers import Workers
from cadenza.node.runner.collectives import TensorParallelError
from cadenza.node.runner.model_runner import ModelRunner
from cadenza.node.runner.models.config import ModelConfig


class EngineCore:
    """Chunked-prefill engine over one model, token ids in and out.

    Args:
        config: the engine configuration; checked again against the model here.
        extra_eos_token_ids: end-of-sequence ids besides the model's own (the tokenizer's
            ``eos_token``, which only the front end reads).
        weights_seed: draw the weights from this seed instead of loading them (benchmarks of a
            model's shapes: ``config.model`` then needs only its ``config.json``); see
            :class:`~cadenza.node.runner.model_runner.ModelRunner`.

    Raises:
        ConfigError: a configuration that can never serve a request on this model, or a KV
            transfer endpoint without the pool's token.
        FileNotFoundError, ModelConfigError: the model folder is unusable.
    """

    def __init__(self, config: EngineConfig, extra_eos_token_ids: Iterable[int] = (),
                 weights_seed: int | None = None) -> None:
        require_kv_token(config.kv_transfer_port)
        self._weights_seed = weights_seed
        self.model_config = ModelConfig.from_pretrained(config.model)
        model_max = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            model_max = min(model_max, self.model_config.sliding_window)
        resolve_max_model_len(config.scheduler.max_model_len, model_max, model_max)  # refuse before loading
        rope_len = min(config.scheduler.max_model_len or model_max, model_max)
        self.workers = None
        if config.tensor_parallel_size > 1:
            mc = self.model_config  # refuse before starting a process
            check_tensor_parallel(config.tensor_parallel_size, mc.num_attention_heads, mc.num_key_value_heads,
                                  mc.intermediate_size, config.model_name)
            self.workers = self._start_workers(config, rope_len, weights_seed)
        try:
            self.runner = ModelRunner(config, self.model_config, max_model_len=rope_len, weights_seed=weights_seed,
                                      collectives=None if self.workers is None else self.workers.collectives)
        except BaseException:
            if self.workers is not None:
                self.workers.kill()
            raise
        if self.workers is not None:
            self.workers.started()
        self.kv_link = None
        try:
            capacity = self.runner.num_kv_blocks * config.cache.block_size
            max_model_len = resolve_max_model_len(config.scheduler.max_model_len, model_max, capacity)
            self.config = config.replace(scheduler=dataclasses.replace(config.scheduler, max_model_len=max_model_len))
            self.block_manager = KVBlockManager(
                self.runner.num_kv_blocks, config.cache.block_size, prefix_caching=config.scheduler.prefix_caching
            )
            self.kv_link = None if config.kv_transfer_port is None else KVLink(
                self._fingerprint(), self.runner, self.block_manager, config.kv_transfer_host, config.kv_transfer_port,
                config.kv_lease_s, config.kv_max_hold_s)
        except BaseException:
            self.close()  # no worker outlives a core that failed to start
            raise
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager, connector=self.kv_link)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | frozenset(extra_eos_token_ids)
        self.grammars = Grammars(config.model, self.model_config.vocab_size, self.eos_token_ids)
        self.last_step_tokens = 0  # tokens the last step computed (0: nothing was schedulable)
        self._failures: list[RequestFailure] = []  # requests the last steps ended as failed (take_failures)
        self.step_time_s: deque[float] = deque(maxlen=1024)  # measured model time of recent steps

    def _start_workers(self, config: EngineConfig, rope_len: int, weights_seed: int | None) -> Workers:
        """Ranks 1 .. N-1 (:mod:`cadenza.node.engine.tp_workers`). The ranks share this process's
        torch threads (the pod's CPUs), at least one each: on the CPU they compute, on GPUs they
        only launch, and more threads than CPUs would throttle either."""
        import torch

        self._threads_before = torch.get_num_threads()
        threads = max(1, self._threads_before // config.tensor_parallel_size)
        torch.set_num_threads(threads)
        return Workers(config, rope_len, weights_seed, threads)

    def _fingerprint(self) -> Fingerprint:
        """This engine's KV layout and the digest of its model's files (hashed once per file:
        :mod:`cadenza.node.model_digest`), which a peer's must equal for KV to move."""
        mc = self.model_config
        return Fingerprint(self.config.model_name, str(self.runner.dtype).removeprefix("torch."),
                           self.config.cache.block_size, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                           weights=model_digest(self.config.model) if self._weights_seed is None
                           else f"drawn from seed {self._weights_seed}",
                           tensor_parallel_size=self.config.tensor_parallel_size)

    def close(self) -> None:
        """Stop the KV transfer endpoint and the tensor-parallel workers, if any (the rest goes
        with the process)."""
        if self.kv_link is not None:
            self.kv_link.close()
        if (grammars := getattr(self, "grammars", None)) is not None:
            grammars.close()
        if self.workers is not None:
            workers, self.workers = self.workers, None
            workers.close(self.runner.stop_workers)
            if (threads := getattr(self, "_threads_before", None)) is not None:
                import torch

                torch.set_num_threads(threads)

    @classmethod
    def from_model(cls, model: str | Path, **knobs: object) -> "EngineCore":
        """Convenience for scripts and tests: ``EngineCore.from_model(path, token_budget=64, ...)``."""
        return cls(EngineConfig.from_knobs(str(model), **knobs))

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len  # type: ignore[return-value]

    def ready(self) -> EngineReady:
        """What the front end needs to know of this engine."""
        link = self.kv_link
        kv = None if link is None else KVEndpoint(link.host, link.port, link.boot_id)
        return EngineReady(self.max_model_len, self.model_config.vocab_size, sorted(self.eos_token_ids),
                           self.block_manager.num_blocks, self.block_manager.block_size,
                           config_view(self.scheduler.config), kv)

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, add: AddRequest) -> Request:
        """Queue a request in its traffic class: its ``n`` sequences, admitted together.

        ``cache_salt`` keeps its prefix-cache entries apart from those of requests with another
        salt (see :mod:`cadenza.node.core.block_manager`); the scheduler adds the tenant's name
        to it when the policy isolates tenants.

        A request with a structured output starts compiling its grammar here, in a thread
        (:mod:`cadenza.node.engine.grammar`), while its prompt is prefilled; each choice gets
        its own matcher.

        Returns:
            The request of its first choice (the others': :func:`choice_request_id`).

        Raises:
            ValueError: empty prompt, a token id outside the vocabulary, a duplicate id, ``n``
                outside 1 to ``MAX_N`` (or above 1 on a call that publishes its KV), a
                structured output on a model folder without a tokenizer.
            AdmissionError: refused by admission control: 400/413 (can never fit) or 429
                (queue depth or tenant quota reached; ``retry_after`` says when to come back).
        """
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in add.prompt_token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        if add.publish_kv and self.kv_link is None:
            raise ValueError("publish_kv: this engine has no KV transfer endpoint (kv_transfer_port)")
        if not 1 <= add.n <= MAX_N or (add.n > 1 and add.publish_kv):
            raise ValueError(f"n: must be from 1 to {MAX_N} (1 for a call that publishes its KV), got {add.n}")
        reqs = [Request(choice_request_id(add.request_id, i), list(add.prompt_token_ids),
                        choice_sampling(add.sampling, i), eos_token_ids=self.eos_token_ids,
                        traffic_class=add.traffic_class, tenant=add.tenant, cache_salt=add.cache_salt,
                        remote_kv=add.remote_kv if i == 0 else None)
                for i in range(add.n)]
        if add.arrival_time:
            for req in reqs:
                req.arrival_time = add.arrival_time
        structured = add.sampling.structured
        if structured is not None and not self.grammars.can_match:
            raise ValueError("response_format: structured outputs need the model's tokenizer.json, which this "
                             "model folder lacks")
        self.scheduler.add_requests(reqs)
        if structured is not None:
            for req in reqs:
                self.grammars.add(req.request_id, structured)
        if add.publish_kv:
            self.kv_link.publish(reqs[0])
        return reqs[0]

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        """End a request now, freeing its KV blocks; False if it was not live.

        ``reason``: ``abort`` (a client gone: counted as aborted) or ``stop`` (a stop string the
        front end matched: it finishes as stopped, and no further token is scheduled).
        """
        if reason == "stop":
            found = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
        else:
            found = self.scheduler.abort_request(request_id) is not None
            if self.kv_link is not None:
                self.kv_link.unpublish(request_id)
        self.runner.release(request_id)
        self.grammars.release(request_id)
        return found

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def poll(self) -> bool:
        """Apply what the KV transfer produced (received blocks, finished loads, ended leases);
        True while it still has work in flight. ``step`` does this first; an idle loop calls it.

        Raises:
            TensorParallelError: a tensor-parallel worker died (the replica cannot step again).
        """
        if self.workers is not None and self.workers.failure is not None:
            raise TensorParallelError(self.workers.failure)
        if self.kv_link is None:
            return False
        self.kv_link.drain(self.scheduler)
        return self.kv_link.busy

    def live_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    # -- steps ----------------------------------------------------------------------------------

    def step(self) -> tuple[list[RequestDelta], StepRecord | None]:
        """Schedule, run and apply one step.

        Returns:
            One delta per request that got a token (in row order), and the step's record; None
            for the record when nothing was schedulable.
        """
        began = time.perf_counter()
        self.poll()
        out = self.scheduler.schedule()
        self.last_step_tokens = out.num_tokens
        if out.is_empty:
            return [], None
        grammars = self.grammars if self.grammars.active else None
        masks = grammars.begin(out) if grammars is not None else None  # computed while the forward runs
        started = time.perf_counter()
        try:
            tokens = self.runner.execute(out, masks)
        except TensorParallelError as exc:  # name the rank that died, where the watcher saw it
            raise TensorParallelError(self.workers.failure or str(exc)) from exc
        elapsed = time.perf_counter() - started
        if self.kv_link is not None:
            self.kv_link.after_forward(out)  # before the step is applied: a finished request frees its blocks
        self.scheduler.observe_step_time(out, elapsed)
        self.step_time_s.append(elapsed)
        deltas = []
        append = deltas.append
        release = self.runner.release
        logprobs, self.runner.last_logprobs = self.runner.last_logprobs, {}
        for req in self.scheduler.update_from_output(out, tokens):
            reason = None
            if grammars is not None and req.request_id in grammars:
                ended = grammars.accept(req)  # complete (stopped), or failed
                if isinstance(ended, GrammarFailure):
                    self._failures.append(RequestFailure(
                        req.request_id, "grammar", f"response_format: the grammar failed in the engine: {ended.reason}",
                        400, "response_format"))
                    if req.is_finished:  # the failed grammar let the end-of-sequence token through
                        req.status = RequestStatus.FINISHED_ABORTED  # its output is not complete
                    ended = RequestStatus.FINISHED_ABORTED
                if ended is not None and not req.is_finished:
                    self.scheduler.finish_request(req.request_id, ended)
                if req.is_finished:
                    grammars.release(req.request_id)
            if req.is_finished:
                release(req.request_id)
                reason = req.status.finish_reason
            entry = logprobs.get(req.request_id) if logprobs else None
            append(RequestDelta(req.request_id, req.token_ids[-1:], reason, req.num_prompt_tokens,
                                len(req.token_ids) - req.num_prompt_tokens, req.num_cached_tokens,
                                None if entry is None else [entry]))
        record = StepRecord(
            elapsed, out.predicted_seconds, out.num_prefill_tokens, out.num_decode_tokens,
            [(req.request_id, req.traffic_class, phase, waited) for req, phase, waited in out.admitted],
            [(row.request.request_id, row.start, row.num_tokens) for row in out.prefill_rows],
            [(req.request_id, req.num_preemptions) for req in out.preempted],
            self.scheduler.remote.drain_ended(),
            out.decode_context_tokens, out.prefill_attention_tokens, out.num_rows, out.num_sampled,
            time.perf_counter() - began - elapsed, self.runner.last_step_graphed,
        )
        return deltas, record

    def take_failures(self) -> list[RequestFailure]:
        """The requests that steps since the last call ended as failed rather than finished (a
        grammar that failed in the engine: a 400 for ``response_format``). Their deltas still say
        ``abort``; the loop reports the failure in their place, so the caller learns why."""
        failures, self._failures = self._failures, []
        return failures

    # -- knobs and counters -----------------------------------------------------------------------

    def reconfigure(self, changes: dict) -> SchedulerConfig:
        """Change live knobs from the next step (see :mod:`cadenza.node.core.knobs`).

        Returns:
            The configuration now in force.

        Raises:
            ConfigError, PolicyError: an unknown key or an invalid value; nothing changes.
        """
        config = reconfigured(self.scheduler.config, changes)
        self.scheduler.reconfigure(config)
        self.config = self.config.replace(scheduler=config)
        return config

    def stats(self) -> EngineStats:
        """Queues per class, KV blocks by state, scheduler counters and step time (a snapshot)."""
        stats = self.scheduler.snapshot()
        if self.step_time_s:
            times = sorted(self.step_time_s)
            stats.step_time_ms_mean = round(1000 * sum(times) / len(times), 3)
            stats.step_time_ms_p99 = round(1000 * times[min(len(times) - 1, int(0.99 * len(times)))], 3)
        if (link := self.kv_link) is not None:
            served, pulled = link.producer.stats, link.stats
            stats.kv_transfer_published, stats.kv_transfer_received_bytes = pulled.published, pulled.bytes_received
            stats.kv_transfer_sent_bytes, stats.kv_transfer_expired = served.bytes_sent, served.expired
            stats.kv_transfer_pull_failures = dict(pulled.failures)
            stats.kv_transfer_serve_failures = dict(served.failures)
            bandwidth = link.consumer.bandwidth
            stats.kv_transfer_bandwidth = None if bandwidth is None else round(bandwidth)
            if (rule := link.rule(self.scheduler.cost_model)) is not None:
                stats.kv_transfer_rule, stats.kv_transfer_min_prompt_tokens = rule.header(), rule.min_prompt_tokens()
        else:  # no KV link (a colocated replica): the threshold still tells the controller what would move
            stats.kv_transfer_min_prompt_tokens = self.min_prompt_tokens()
        return stats

    def min_prompt_tokens(self) -> int | None:
        """The selective rule's threshold of a replica without a KV link (tokens): the shortest
        prompt worth prefilling on an idle prefill replica for this one, were it joined to one over
        the assumed pod network (:data:`~cadenza.node.engine.kv_link.ASSUMED_LINK_BYTES_PER_S`:
        nothing has measured a link here). None before the cost model is calibrated, or when no
        prompt is worth moving."""
        dtype_bytes = DTYPE_BYTES.get(str(self.runner.dtype).removeprefix("torch."))
        if dtype_bytes is None:
            return None
        found = disagg_rule.rule(self.scheduler.cost_model, self.model_config.kv_bytes_per_token(dtype_bytes),
                                 ASSUMED_LINK_BYTES_PER_S)
        return None if found is None else found.min_prompt_tokens()
