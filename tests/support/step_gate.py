"""Hold a served engine inside one step, so a test can say what happens *during* a step.

"Refused at once", "aborted mid-prefill", "answered while the engine is busy" are statements about
order, not about seconds: with the engine thread parked inside ``ModelRunner.execute`` the test
knows no step can end until it says so, whatever the machine's load.

    gate = StepGate(engine.runner, monkeypatch)
    try:
        gate.hold()              # the next step to start waits inside execute
        ...                      # start something
        await gate.held()        # the engine thread is now parked there
        ...                      # act, and check what was answered meanwhile
    finally:
        gate.release()           # always: a parked engine thread cannot shut down
"""

from __future__ import annotations

import threading
import time

from waiting import TIMEOUT_S, until


class StepGate:
    """Wraps ``runner.execute`` (through ``monkeypatch``); open until :meth:`hold`.

    Args:
        runner: the engine's model runner (``Engine.runner``).
        monkeypatch: pytest's fixture; the wrapper goes when the test ends.
        delay_s: seconds each step sleeps first, to simulate a slower model (0: none).
    """

    def __init__(self, runner, monkeypatch, delay_s: float = 0.0) -> None:
        self._open = threading.Event()
        self._open.set()
        self._parked = threading.Event()
        self.steps_started = 0
        original = runner.execute

        def execute(step, masks=None):
            self.steps_started += 1
            if delay_s:
                time.sleep(delay_s)
            if not self._open.is_set():
                self._parked.set()
                self._open.wait()
            return original(step, masks)

        monkeypatch.setattr(runner, "execute", execute)

    def hold(self) -> None:
        """Park the engine thread in the next step that reaches the model (the current one, if it
        has not yet passed the gate)."""
        self._parked.clear()
        self._open.clear()

    async def held(self, timeout: float = TIMEOUT_S) -> None:
        """Return once the engine thread is parked in a step."""
        await until(self._parked.is_set, timeout, "the engine to enter a held step")

    @property
    def is_held(self) -> bool:
        """The engine thread is parked in a step now."""
        return self._parked.is_set() and not self._open.is_set()

    def release(self) -> None:
        """Let the parked step (and every later one) run."""
        self._open.set()
