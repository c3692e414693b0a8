"""The engine core's busy loop: apply the messages that arrived, run a step, emit its outputs.

The same loop runs in the core's own process (:mod:`cadenza.node.engine.process`, messages over a
socket) and in a thread of the server's process (``--engine-process off``, messages through a
queue). Messages are applied between steps, so an aborted request's KV blocks are free before the
next step is scheduled and it gets no further token. Whatever one message raises answers its
sender (a :class:`~cadenza.node.core.messages.RequestFailure` or an error
:class:`~cadenza.node.core.messages.ReconfigureResult`) and never ends the loop; a failed step
fails the requests in flight, not the engine — unless a tensor-parallel rank is gone
(:class:`~cadenza.node.runner.collectives.TensorParallelError`): then the loop ends with it and the
caller reports the engine dead.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

from cadenza.node.core.admission import AdmissionError
from cadenza.node.engine.engine_core import EngineCore
from cadenza.node.core.knobs import config_view
from cadenza.node.core.messages import (
    AbortRequests,
    AddRequest,
    Reconfigure,
    ReconfigureResult,
    RequestFailure,
    RequestsQueued,
    Shutdown,
    StepOutputs,
)
from cadenza.node.core.stats import EngineStats
from cadenza.node.runner.collectives import TensorParallelError

logger = logging.getLogger(__name__)

STATS_PERIOD_S = 0.2  # stats ride with a step's outputs at most this often (and on finish / idle)
IDLE_WAIT_S = 1.0  # with nothing to run, wait this long for a message, then publish stats again
# So the loop sends something at least every max(IDLE_WAIT_S, one step): the front end's stall
# watch (cadenza.node.frontend.client) takes silence beyond its timeout for a stopped or stuck core.
STALLED_WAIT_S = 0.01  # the last step could schedule nothing (KV full): do not spin
TRANSFER_WAIT_S = 0.1  # idle, but a KV transfer holds blocks: free them soon after their lease ends


def announce(core, emit: Callable[[object], None]) -> None:
    """Tell the front end the core is ready: its first stats, then :class:`EngineReady`, so a
    reader that sees the core ready (``/ready``) never sees the empty placeholder stats."""
    emit(StepOutputs(time.monotonic(), stats=core.stats()))
    emit(core.ready())


class CoreLoop:
    """Runs ``core`` until a :class:`Shutdown` (or ``None``: the sender is gone) arrives.

    Args:
        core: the loaded engine core.
        inbox: messages from the front end (``None`` ends the loop, as Shutdown does).
        emit: sends one outgoing message; called from this loop's thread only.
    """

    def __init__(self, core: EngineCore, inbox: queue.SimpleQueue, emit: Callable[[object], None]) -> None:
        self.core = core
        self.inbox = inbox
        self.emit = emit
        self._stats_time = 0.0
        self._queued: list[str] = []  # added with ``acknowledge`` since the last RequestsQueued

    def run(self) -> None:
        """Loop until shut down (then the core is closed). An exception here is a bug the loop
        cannot go on from; it propagates (the caller reports the engine dead)."""
        try:
            self._run()
        finally:
            self.core.close()

    def _run(self) -> None:
        core = self.core
        stalled = transferring = False
        core.grammars.warm()  # in its thread: the first structured request finds it ready
        self.emit(StepOutputs(time.monotonic(), stats=self._stats(force=True)))  # readers start with real figures
        while True:
            busy = core.has_unfinished_requests()
            timeout = (0.0 if busy and not stalled else STALLED_WAIT_S if busy
                       else TRANSFER_WAIT_S if transferring else IDLE_WAIT_S)
            messages = self._receive(timeout)
            failures: list[RequestFailure] = []
            for message in messages:
                if message is None or isinstance(message, Shutdown):
                    return
                self._apply(message, failures)
            if self._queued:  # their callers answer now, not after the step
                self.emit(RequestsQueued(self._queued))
                self._queued = []
            if failures:  # and so do those refused (a busy core's next step may take seconds)
                self.emit(StepOutputs(time.monotonic(), failures=failures))
                failures = []
            if not core.has_unfinished_requests():
                transferring = core.poll()  # ended leases free their blocks even when idle
                stats = self._stats(force=not transferring)
                if failures or stats is not None:
                    self.emit(StepOutputs(time.monotonic(), failures=failures, stats=stats))
                continue
            try:
                deltas, record = core.step()
                stalled = core.last_step_tokens == 0
                if failed := core.take_failures():  # reported as failures, not as aborted outputs
                    ids = {failure.request_id for failure in failed}
                    deltas = [delta for delta in deltas if delta.request_id not in ids]
                    failures += failed
            except TensorParallelError:
                raise  # a rank is gone: the replica cannot step again (the caller reports it dead)
            except Exception as exc:  # keep serving: fail what was live, not the engine
                logger.exception("engine step failed; aborting the requests in flight")
                live = core.live_request_ids()
                for request_id in live:
                    core.abort_request(request_id)
                failures += [RequestFailure(rid, "step", f"engine step failed: {exc}") for rid in live]
                self.emit(StepOutputs(time.monotonic(), failures=failures, stats=self._stats(force=True)))
                continue
            finished = bool(failures) or any(d.finish_reason is not None for d in deltas)
            stats = self._stats(force=finished or not core.has_unfinished_requests())
            if deltas or record is not None or failures or stats is not None:
                self.emit(StepOutputs(time.monotonic(), deltas, record, stats, failures))

    def _receive(self, timeout: float) -> list:
        messages = []
        if timeout:
            try:
                messages.append(self.inbox.get(timeout=timeout))
            except queue.Empty:
                return messages
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                return messages

    def _stats(self, force: bool = False) -> EngineStats | None:
        now = time.monotonic()
        if not force and now - self._stats_time < STATS_PERIOD_S:
            return None
        self._stats_time = now
        return self.core.stats()

    def _apply(self, message: object, failures: list[RequestFailure]) -> None:
        """Apply one message; what it raises answers its sender, never ends the loop."""
        core = self.core
        if isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                try:
                    core.abort_request(request_id, message.reason)
                except Exception:  # pragma: no cover - a bug; the others still go
                    logger.exception("aborting %s failed", request_id)
        elif isinstance(message, AddRequest):
            self._add(message, failures)
        elif isinstance(message, Reconfigure):
            self.emit(self._reconfigure(message))
        else:
            logger.error("engine core: ignoring a %s message", type(message).__name__)

    def _add(self, add: AddRequest, failures: list[RequestFailure]) -> None:
        try:
            self.core.add_request(add)
            if add.acknowledge:
                self._queued.append(add.request_id)
        except AdmissionError as exc:
            failures.append(RequestFailure(add.request_id, "admission", str(exc), exc.status, exc.reason,
                                           exc.retry_after))
        except ValueError as exc:
            failures.append(RequestFailure(add.request_id, "invalid", str(exc), 400))
        except Exception as exc:
            logger.exception("adding request %s failed", add.request_id)
            try:  # it may be half-added: never leave it holding KV with nobody listening
                self.core.abort_request(add.request_id)
            except Exception:  # pragma: no cover - a second bug on the same request
                logger.exception("could not drop %s after its failed add", add.request_id)
            failures.append(RequestFailure(add.request_id, "internal", f"the request failed inside the engine: "
                                                                        f"{type(exc).__name__}: {exc}"))

    def _reconfigure(self, message: Reconfigure) -> ReconfigureResult:
        try:
            config = self.core.reconfigure(message.changes)
        except (ValueError, TypeError) as exc:  # the caller's input: a 400
            return ReconfigureResult(message.call_id, error=str(exc), error_kind="invalid")
        except Exception as exc:  # a bug: the caller gets a 500, the engine goes on
            logger.exception("reconfiguring the engine failed")
            return ReconfigureResult(message.call_id, error=f"{type(exc).__name__}: {exc}", error_kind="internal")
        return ReconfigureResult(message.call_id, config=config_view(config))
