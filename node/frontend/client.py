"""The front end's client of the engine core: requests in, per-request output streams out.

The core runs in its own process by default (:class:`ProcessCore`: ``python -m
cadenza.node.engine.process`` over a Unix socket pair, msgpack frames) or in a thread of this
process (:class:`ThreadCore`, ``--engine-process off``: the same loop and the same message
objects through a queue, for tests and the simulator). Either way the event loop never runs model
code and HTTP code never touches engine objects: it calls :meth:`EngineClient.generate`,
:meth:`~EngineClient.reconfigure` and :meth:`~EngineClient.stats`.

Each step's :class:`~cadenza.node.core.messages.StepOutputs` arrives on the event loop; the
:class:`~cadenza.node.frontend.output_processor.OutputProcessor` detokenizes it and matches stop
strings, telemetry records the step and every token, and each request's ``asyncio.Queue`` gets
its delta. If the core dies — its process exits or is killed, its loop raises — every request in
flight gets :class:`EngineDeadError` at once and ``is_alive`` turns False (``/health`` answers 503;
the server then exits so that its supervisor restarts the replica).

The core is known alive by what it sends, not by its process id: its loop sends one message per
step, and stats at least every ``IDLE_WAIT_S`` (1 s) when there is nothing to step
(:mod:`cadenza.node.engine.loop`). Once it is ready, a core that sends nothing for
``stall_timeout_s`` — a process stopped (SIGSTOP, a frozen node) or a step that never returns (a
hung kernel or collective) — is declared dead the same way, and a core process is killed. The
timeout must be longer than the longest legitimate step; the default, :data:`STALL_TIMEOUT_S`,
is SGLang's ``--watchdog-timeout`` (300 s) for the same reason — first-run kernel compiles on a
GPU and huge prefill chunks on a CPU take tens of seconds (vLLM V0's iteration timeout,
``VLLM_ENGINE_ITERATION_TIMEOUT_S``, was 60 s, and users of long steps raise it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cadenza.node.core.admission import AdmissionError, check_published
from cadenza.node.core.config import EngineConfig
from cadenza.node.core.knobs import check_live_changes, policy_from_view
from cadenza.node.core.messages import (
    AbortRequests,
    AddRequest,
    EngineDead,
    EngineReady,
    Reconfigure,
    ReconfigureResult,
    RequestFailure,
    RequestsQueued,
    StepOutputs,
)
from cadenza.node.core.request import RemoteKV, Request, SamplingParams, choice_request_id
from cadenza.node.core.stats import EngineStats
from cadenza.node.frontend.errors import (
    ADD_FAILURES,
    CONFIG_ERRORS,
    EngineCommandError,
    EngineDeadError,
    EngineLoadError,
    failure_error,
)
from cadenza.node.frontend.input_processor import InputProcessor
from cadenza.node.frontend.output_processor import OutputProcessor, RequestOutput
from cadenza.node.frontend.transports import SHUTDOWN_TIMEOUT_S, ProcessCore, ThreadCore

if TYPE_CHECKING:
    from cadenza.node.engine.engine_core import EngineCore
    from cadenza.node.frontend.telemetry import Telemetry
    from cadenza.node.frontend.tokenizer import Tokenizer
    from cadenza.node.runner.threads import ThreadChoice

logger = logging.getLogger(__name__)

__all__ = ["EngineClient", "EngineCommandError", "EngineDeadError", "EngineLoadError", "Queued", "STALL_TIMEOUT_S"]

STALL_TIMEOUT_S = 300.0  # a ready core silent this long is dead (see the module docstring)


@dataclass(frozen=True, slots=True)
class Queued:
    """The first item :meth:`EngineClient.generate` yields with ``acknowledge``: the core's
    admission control has queued the request (its outputs follow)."""

    request_id: str


# -- the client ------------------------------------------------------------------------------------


class EngineClient:
    """Streams requests through an engine core and its outputs back to asyncio.

    Args:
        config: the engine configuration (its model folder holds the tokenizer).
        process: run the core in its own process (True) or in a thread (False).
        telemetry: records steps and tokens (optional).
        load_tokenizer: load the tokenizer (needed for text; token-id-only tests skip it).
        core_factory: with ``process`` False, builds the core (tests inject one); default
            ``EngineCore(config, eos_token_ids)``.
        threads: torch threads of a core process.
        stall_timeout_s: seconds a ready core may send nothing before it is declared dead (and a
            core process killed); None or 0: never.
    """

    def __init__(self, config: EngineConfig, process: bool = True, telemetry: "Telemetry | None" = None,
                 load_tokenizer: bool = True, core_factory: Callable[[list[int]], "EngineCore"] | None = None,
                 threads: "ThreadChoice | None" = None, stall_timeout_s: float | None = STALL_TIMEOUT_S) -> None:
        self.config = config
        self.telemetry = telemetry
        self._process = process
        self._load_tokenizer = load_tokenizer
        self._core_factory = core_factory
        self._threads = threads
        self.transport: ThreadCore | ProcessCore | None = None
        self.tokenizer: Tokenizer | None = None
        self.inputs: InputProcessor | None = None  # once ready, with a tokenizer
        self.outputs = OutputProcessor(None)
        self.info: EngineReady | None = None
        self.config_view: dict = {}
        self.error: BaseException | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._stats = EngineStats()
        self._policy = None
        self._rejected: Counter = Counter()  # refused at once here, by reason
        self._ready: asyncio.Event | None = None
        self._died: asyncio.Event | None = None
        self._starting: asyncio.Task | None = None
        self._stopping = False
        self.stall_timeout_s = stall_timeout_s or None
        self._last_heard = 0.0  # time.monotonic() of the core's last message
        self._watch: asyncio.Task | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start loading (returns at once; see :meth:`wait_ready`)."""
        loop = asyncio.get_running_loop()
        self._ready, self._died = asyncio.Event(), asyncio.Event()
        self._starting = loop.create_task(self._start(loop))

    async def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        eos: list[int] = []
        if self._load_tokenizer:
            from cadenza.node.frontend.tokenizer import Tokenizer

            try:
                self.tokenizer = await loop.run_in_executor(None, Tokenizer.from_pretrained, self.config.model)
            except Exception as exc:
                self._fail_start(EngineLoadError(str(exc)) if isinstance(exc, (ValueError, OSError)) else exc)
                return
            self.outputs = OutputProcessor(self.tokenizer)
            eos = sorted(self.tokenizer.eos_token_ids)
        if self._process:
            self.transport = ProcessCore(self.config, eos, self._threads)
        else:
            from cadenza.node.engine.engine_core import EngineCore

            factory = self._core_factory or (lambda ids: EngineCore(self.config, ids))
            self.transport = ThreadCore(lambda: factory(eos))
        self.transport.start(self._on_message, loop)

    def _fail_start(self, exc: BaseException) -> None:
        self.error = exc
        assert self._ready is not None
        self._ready.set()

    async def wait_ready(self) -> EngineReady:
        """Wait until the core has loaded.

        Raises:
            EngineDeadError: loading failed (the cause is chained).
        """
        assert self._ready is not None, "start() first"
        await self._ready.wait()
        if self.info is None:
            raise EngineDeadError(f"engine failed to start: {self.error}") from self.error
        return self.info

    async def wait_dead(self) -> BaseException | None:
        """Return once a loaded core has died; the error that ended it."""
        assert self._died is not None, "start() first"
        await self._died.wait()
        return self.error

    @property
    def is_ready(self) -> bool:
        return self.info is not None and self.is_alive

    @property
    def is_alive(self) -> bool:
        """The core runs (loading or serving) and has not failed."""
        if self.error is not None or self._ready is None or self._stopping:
            return False
        return self.transport is None or self.transport.alive() or self.info is None

    @property
    def core(self) -> "EngineCore | None":
        """The in-thread core (``process`` False) for white-box tests; None in process mode."""
        return self.transport.core if isinstance(self.transport, ThreadCore) else None

    @property
    def max_model_len(self) -> int:
        assert self.info is not None
        return self.info.max_model_len

    async def shutdown(self) -> None:
        """Stop the core after its current step; live requests end with EngineDeadError."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        if self._starting is not None and not self._starting.done():
            await asyncio.wait({self._starting}, timeout=SHUTDOWN_TIMEOUT_S)
        if self.transport is not None:
            await self.transport.stop()
        self._fail_all(EngineDeadError("server shutting down"))

    # -- messages from the core -----------------------------------------------------------------

    def _on_message(self, message: object) -> None:
        self._last_heard = time.monotonic()
        if isinstance(message, StepOutputs):
            self._on_step(message)
        elif isinstance(message, ReconfigureResult):
            self._on_reconfigured(message)
        elif isinstance(message, RequestsQueued):
            for request_id in message.request_ids:
                if (stream := self._streams.get(request_id)) is not None:
                    stream.put_nowait(Queued(request_id))
        elif isinstance(message, EngineReady):
            self.info = message
            self._set_config(message.config)
            if self.tokenizer is not None:
                from cadenza.node.runner.models.generation import SamplingDefaults

                self.inputs = InputProcessor(self.tokenizer, message, SamplingDefaults.from_model_dir(self.config.model),
                                             special_tokens_as_text=self.config.text_special_tokens == "plain")
            assert self._ready is not None
            self._ready.set()
            if self.stall_timeout_s is not None:  # from now on: loading may take any time, a step may not
                self._watch = asyncio.get_running_loop().create_task(self._watch_core(self.stall_timeout_s))
        elif isinstance(message, EngineDead):
            self._on_dead(message)

    async def _watch_core(self, timeout: float) -> None:
        """Declare the core dead once it has sent nothing for ``timeout`` seconds."""
        period = min(1.0, timeout / 4)
        while self.error is None and not self._stopping:
            await asyncio.sleep(period)
            if time.monotonic() - self._last_heard <= timeout:
                continue
            # This loop may itself have been held up (a stall of the event loop, not of the core):
            # let whatever arrived meanwhile be read before judging.
            await asyncio.sleep(period)
            silent = time.monotonic() - self._last_heard
            if silent > timeout and self.error is None and not self._stopping:
                self._on_dead(EngineDead(
                    f"the engine core sent nothing for {silent:.1f} s (stall timeout {timeout:g} s): its process "
                    "is stopped or a step never returned", loaded=True, kind="EngineStalled"))
                if self.transport is not None:
                    self.transport.kill()  # a stopped process takes SIGKILL; it holds the device meanwhile

    def _on_step(self, message: StepOutputs) -> None:
        if message.stats is not None:
            self._stats = message.stats
        telemetry = self.telemetry
        if message.step is not None and telemetry is not None:
            telemetry.on_step(message.step, message.time)
        streams = self._streams
        if message.outputs:
            outputs, stopped = self.outputs.process(message.outputs, message.time)
            if stopped:
                self._send(AbortRequests(stopped, "stop"))
            for out in outputs:
                if telemetry is not None:
                    telemetry.on_output(out)
                stream = streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)
        for failure in message.failures:
            self.outputs.drop(failure.request_id)
            stream = streams.get(failure.request_id)
            if stream is not None:
                stream.put_nowait(failure)  # generate() raises it, knowing which choice failed

    def _on_reconfigured(self, result: ReconfigureResult) -> None:
        future = self._calls.pop(result.call_id, None)
        if result.config is not None:
            self._set_config(result.config)
        if future is None or future.done():
            return
        if result.error_kind == "invalid":
            future.set_exception(ValueError(result.error))
        elif result.error is not None:
            future.set_exception(EngineCommandError(result.error))
        else:
            future.set_result(result.config)

    def _on_dead(self, message: EngineDead) -> None:
        assert self._ready is not None and self._died is not None
        if not message.loaded or self.info is None:
            kind = EngineLoadError if message.kind in CONFIG_ERRORS else RuntimeError
            self._fail_start(kind(message.error))
            return
        if self._stopping or self.error is not None:  # said already (a killed stalled core's EOF)
            return
        logger.error("the engine core died: %s", message.error)
        self.error = EngineDeadError(message.error)
        self._fail_all(EngineDeadError(f"engine stopped: {message.error}"))
        self._died.set()

    def _fail_all(self, exc: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.put_nowait(exc)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(exc)
        self._calls.clear()

    def _set_config(self, view: dict) -> None:
        self.config_view = view
        self._policy = policy_from_view(view)

    def _send(self, message: object) -> None:
        if self.transport is not None:
            self.transport.send(message)

    # -- requests -------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        traffic_class: str = "interactive",
        tenant: str = "default",
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        traceparent: str | None = None,
        remote_kv: RemoteKV | None = None,
        publish_kv: bool = False,
        acknowledge: bool = False,
        n: int = 1,
    ) -> AsyncIterator[RequestOutput | Queued]:
        """Submit a request and yield its outputs until one is finished (``remote_kv`` /
        ``publish_kv``: pull its prompt's KV from a prefill replica / hold it for a decode one).

        With ``n`` above 1 the request is ``n`` sequences sharing one prefill (OpenAI's ``n``;
        :mod:`cadenza.node.core.siblings`): the outputs of all of them are yielded as they come,
        each with its choice's ``index``, until every one is finished; each has its own stop
        strings. Admission counts ``n`` sequences and refuses the call whole.

        Admission control runs here first against the last published stats (a full queue or a
        tenant at its quota is refused at once, not after the core's current step); the core
        checks again, and its answer is the one that holds: with ``acknowledge`` the first item
        is :class:`Queued` once the core has queued the request, so a caller can promise it
        (a publish call's KV source) knowing the core will not refuse it. Leaving the iteration
        early (client gone, task cancelled) aborts the request: its KV blocks are freed before
        the core's next step.

        Raises:
            AdmissionError: refused (400/413/429 with ``retry_after``).
            ValueError: the engine refused the request (message for the client).
            EngineDeadError: the core is not running.
        """
        if not self.is_ready:
            raise EngineDeadError("engine is not ready")
        probe = Request(request_id, prompt_token_ids, sampling, traffic_class=traffic_class, tenant=tenant)
        try:
            check_published(probe, self._policy, self.max_model_len, self._stats, n)
        except AdmissionError as exc:
            self._rejected[exc.reason] += 1
            raise
        stream: asyncio.Queue = asyncio.Queue()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        add = AddRequest(request_id, list(prompt_token_ids), sampling, probe.traffic_class, tenant, arrival,
                         cache_salt, traceparent, remote_kv, publish_kv, acknowledge, n)
        index_of = {choice_request_id(request_id, i): i for i in range(n)}
        live = set(index_of)  # choices not finished yet
        for choice_id in index_of:
            self._streams[choice_id] = stream
            self.outputs.add_request(choice_id, sampling)
        try:
            try:
                self._send(add)
            except TypeError as exc:  # never reached the core: nothing to abort there
                live.clear()
                raise ValueError(f"the request holds a value the engine cannot take: {exc}") from None
            while True:
                item = await stream.get()
                if isinstance(item, RequestFailure):  # one choice failed: the call fails, and the
                    live.discard(item.request_id)  # finally aborts its other choices still running
                    if item.kind in ADD_FAILURES:
                        live.clear()
                    raise failure_error(item)
                if isinstance(item, BaseException):
                    live.clear()
                    raise item
                if isinstance(item, Queued):
                    yield item
                    continue
                item.index = index_of[item.request_id]
                if item.finished:
                    live.discard(item.request_id)
                yield item
                if not live:
                    return
        finally:
            for choice_id in index_of:
                self._streams.pop(choice_id, None)
            if live:  # one message: every sequence's KV is free before the core's next step
                for choice_id in live:
                    self.outputs.drop(choice_id)
                self._send(AbortRequests(sorted(live, key=index_of.__getitem__)))

    def abort(self, request_id: str) -> None:
        """Abort a request (from the event loop's thread)."""
        self.outputs.drop(request_id)
        self._send(AbortRequests([request_id]))

    async def reconfigure(self, changes: dict) -> dict:
        """Change live knobs in the core, effective from its next step.

        Returns:
            The configuration now in force, as ``GET /admin/config`` shows it.

        Raises:
            ValueError: an invalid change (nothing changed); EngineDeadError: not running;
            EngineCommandError: the change failed inside the engine (a bug; the engine goes on).
        """
        if not self.is_ready:
            raise EngineDeadError("engine is not ready")
        check_live_changes(changes)  # the registry's bounds: the same answer as the core would give
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(Reconfigure(call_id, changes))
        except TypeError as exc:
            del self._calls[call_id]
            raise ValueError(f"changes: a value the engine cannot take ({exc})") from None
        return await future

    def stats(self) -> EngineStats:
        """The core's counters as it last published them, with this front end's own refusals
        counted in ``rejected``."""
        return self._stats.with_rejected(self._rejected)
