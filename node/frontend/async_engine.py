"""Async front of the engine: the model steps in a background thread, the event loop never blocks.

The engine thread owns the :class:`~cadenza.node.core.engine.Engine` outright (it also loads it, so the
server answers ``/health`` while the weights load). The event loop talks to it through a
thread-safe command queue (add, abort) and gets each step's outputs back in one
``call_soon_threadsafe`` callback that fans them out to per-request ``asyncio.Queue`` streams.
Aborts are applied between steps, so an aborted request's KV blocks are free before the next step
is scheduled and it gets no further token. torch releases the GIL in its kernels, so the loop keeps
serving while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cadenza.node.core.admission import AdmissionError
from cadenza.node.core.engine import Engine, RequestOutput
from cadenza.node.core.request import Request, SamplingParams

if TYPE_CHECKING:
    from cadenza.node.frontend.telemetry import Telemetry

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (failed to load, or shut down)."""


class EngineCommandError(RuntimeError):
    """A command failed inside the engine for a reason that is not the caller's input (a bug); the
    engine goes on stepping. The server answers 500 with the message."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    traffic_class: str
    tenant: str
    cache_salt: str | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Reconfigure:
    changes: dict
    done: asyncio.Future


_STOP = object()
STATS_PERIOD_S = 0.2


class AsyncEngine:
    """Runs an :class:`Engine` in a thread and streams per-request outputs to asyncio.

    Args:
        factory: builds the engine; called in the engine thread.
    """

    def __init__(self, factory: Callable[[], Engine], telemetry: "Telemetry | None" = None) -> None:
        self._factory = factory
        self.telemetry = telemetry
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._died: asyncio.Event | None = None  # set (on the loop) when the running engine thread dies
        self.engine: Engine | None = None
        self.error: BaseException | None = None
        self._stats: dict = {}
        self._stats_time = 0.0
        self._rejected: Counter = Counter()  # refused at once on the caller's thread, by reason

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (returns at once; see :meth:`wait_ready`)."""
        self._loop = asyncio.get_running_loop()
        self._died = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="cadenza-engine", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> Engine:
        """Wait until the engine has loaded.

        Raises:
            EngineDeadError: loading failed (the cause is chained).
        """
        await asyncio.get_running_loop().run_in_executor(None, self._ready.wait)
        if self.engine is None:
            raise EngineDeadError(f"engine failed to start: {self.error}") from self.error
        return self.engine

    async def wait_dead(self) -> BaseException | None:
        """Return once a loaded engine's thread has died (a bug: a loop that cannot go on); the
        error that ended it. A server exits on it, so its supervisor restarts the replica."""
        assert self._died is not None, "start() first"
        await self._died.wait()
        return self.error

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.is_alive

    @property
    def is_alive(self) -> bool:
        """The engine thread runs (loading or serving) and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    async def shutdown(self) -> None:
        """Stop the thread after the current step; live requests end with ``abort``."""
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        for stream in list(self._streams.values()):
            stream.put_nowait(EngineDeadError("server shutting down"))
        self._streams.clear()

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
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until one is finished.

        Admission control runs here first (on the caller's thread, reading the scheduler's
        counters), so an overloaded queue refuses at once instead of after the current step.
        Leaving the iteration early (client gone, task cancelled) aborts the request: its KV
        blocks are freed before the next step.

        Raises:
            AdmissionError: refused (400/413/429 with ``retry_after``).
            ValueError: the engine refused the request (message for the client).
            EngineDeadError: the engine is not running.
        """
        if not self.is_ready:
            raise EngineDeadError("engine is not ready")
        probe = Request(request_id, prompt_token_ids, sampling, traffic_class=traffic_class, tenant=tenant)
        try:
            self.engine.scheduler.check_admission(probe)  # type: ignore[union-attr]
        except AdmissionError as exc:
            self._rejected[exc.reason] += 1
            raise
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._commands.put(_Add(request_id, prompt_token_ids, sampling, arrival, traffic_class, tenant, cache_salt))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread."""
        self._commands.put(_Abort(request_id))

    async def reconfigure(self, changes: dict):
        """Apply :meth:`Engine.reconfigure` in the engine thread, effective from the next step.

        Returns:
            The scheduler configuration now in force.

        Raises:
            ValueError: an invalid change (nothing changed); EngineDeadError: not running;
            EngineCommandError: the change failed inside the engine (a bug; the engine goes on).
        """
        if not self.is_ready:
            raise EngineDeadError("engine is not ready")
        done = asyncio.get_running_loop().create_future()
        self._commands.put(_Reconfigure(changes, done))
        return await done

    def stats(self) -> dict:
        """The engine's counters as the engine thread last published them (empty until loaded).

        The engine thread refreshes them at most every ``STATS_PERIOD_S``, whenever a request
        finishes and whenever it goes idle, so readers on other threads never walk scheduler
        structures that are changing under them.
        """
        if not self._rejected:
            return self._stats
        rejected = Counter(self._stats.get("rejected", {}))
        rejected.update(self._rejected)
        return {**self._stats, "rejected": dict(rejected)}

    # -- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._factory()
            self.engine.observer = self.telemetry
        except BaseException as exc:  # reported through wait_ready
            if not isinstance(exc, (ValueError, FileNotFoundError)):  # config errors need no traceback
                logger.exception("engine failed to load")
            self.error = exc
            self._ready.set()
            return
        self._refresh_stats(force=True)
        self._ready.set()
        try:
            self._loop_forever(self.engine)
        except BaseException as exc:  # a bug, not a bad request: fail everyone loudly, never hang
            logger.exception("engine thread died")
            self.error = exc
            self._publish([(rid, EngineDeadError(f"engine stopped: {exc}")) for rid in list(self._streams)])
            self._call_soon(self._died.set)  # type: ignore[union-attr]

    def _loop_forever(self, engine: Engine) -> None:
        stalled = False  # the last step scheduled nothing: do not spin, wait for a command
        while True:
            timeout = 1.0 if not engine.has_unfinished_requests() else 0.01 if stalled else 0.0
            try:
                commands = [self._commands.get(timeout=timeout)] if timeout else []
            except queue.Empty:
                commands = []
                if not engine.has_unfinished_requests():
                    self._refresh_stats(force=True)
                    continue
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            failures: list[tuple[str, BaseException]] = []
            for cmd in commands:
                if cmd is _STOP:
                    return
                self._apply(engine, cmd, failures)
            if failures:
                self._publish(failures)
            if not engine.has_unfinished_requests():
                self._refresh_stats(force=True)
                continue
            try:
                outputs = engine.step()
                stalled = engine.last_step_tokens == 0
            except Exception as exc:  # keep serving: fail what was live, not the server
                logger.exception("engine step failed; aborting the requests in flight")
                live = list(engine.scheduler.requests)
                for request_id in live:
                    engine.abort_request(request_id)
                self._publish([(rid, RuntimeError(f"engine step failed: {exc}")) for rid in live])
                continue
            self._refresh_stats(force=any(o.finished for o in outputs) or not engine.has_unfinished_requests())
            if outputs:
                self._publish(outputs)

    def _apply(self, engine: Engine, cmd: _Add | _Abort | _Reconfigure, failures: list) -> None:
        """Run one command. Whatever it raises answers its caller — a ValueError (bad input:
        400), anything else (a bug: 500, logged) — and never ends the loop."""
        if isinstance(cmd, _Reconfigure):
            self._settle(cmd.done, engine.reconfigure, cmd.changes)
            return
        try:
            if isinstance(cmd, _Abort):
                engine.abort_request(cmd.request_id)
            else:
                engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.sampling, cmd.arrival_time,
                                   cmd.traffic_class, cmd.tenant, cmd.cache_salt)
        except ValueError as exc:  # AdmissionError included
            failures.append((cmd.request_id, exc))
        except Exception as exc:
            logger.exception("engine command %s for %s failed", type(cmd).__name__.lstrip("_"), cmd.request_id)
            if isinstance(cmd, _Add):
                try:  # it may be half-added: never leave it holding KV with nobody listening
                    engine.abort_request(cmd.request_id)
                except Exception:  # pragma: no cover - a second bug on the same request
                    logger.exception("could not drop %s after its failed add", cmd.request_id)
                failures.append((cmd.request_id, EngineCommandError(f"the request failed inside the engine: "
                                                                    f"{type(exc).__name__}: {exc}")))

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._stats_time >= STATS_PERIOD_S:
            self._stats = self.engine.stats()  # type: ignore[union-attr]
            self._stats_time = now

    def _settle(self, future: asyncio.Future, fn, *args) -> None:
        """Run ``fn`` here (the engine thread) and hand its result or error to ``future``."""
        try:
            result, error = fn(*args), None
        except (ValueError, TypeError) as exc:  # the caller's input: a 400
            result, error = None, exc
        except Exception as exc:  # a bug: the caller gets a 500, the engine goes on
            logger.exception("engine command %s failed", getattr(fn, "__name__", fn))
            result, error = None, EngineCommandError(f"{type(exc).__name__}: {exc}")

        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        self._call_soon(settle)

    def _publish(self, items: list) -> None:
        self._call_soon(self._dispatch, items)

    def _call_soon(self, fn, *args) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening
            pass

    def _dispatch(self, items: list) -> None:
        telemetry = self.telemetry
        for item in items:
            if isinstance(item, RequestOutput):
                if telemetry is not None:
                    telemetry.on_output(item)
                stream = self._streams.get(item.request_id)
                if stream is not None:
                    stream.put_nowait(item)
            else:
                request_id, exc = item
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.put_nowait(exc)
