"""The core loop answers what it was sent before it runs the next step: a busy core's step may take
seconds, and a caller waiting to know whether its request was queued must not wait for it."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

from cadenza.node.core.admission import AdmissionError
from cadenza.node.engine.loop import CoreLoop
from cadenza.node.core.messages import AddRequest, RequestsQueued, Shutdown, StepOutputs
from cadenza.node.core.request import SamplingParams


class BusyCore:
    """A core with work to do whose step blocks until released; it queues ``ok`` and refuses the rest."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.last_step_tokens = 1
        self.grammars = SimpleNamespace(warm=lambda: None)  # no structured outputs here

    def take_failures(self) -> list:
        return []

    def has_unfinished_requests(self) -> bool:
        return True

    def add_request(self, add: AddRequest) -> None:
        if add.request_id != "ok":
            raise AdmissionError(429, "the queue is full", "queue_full", retry_after=1)

    def step(self):
        self.release.wait(10)
        return [], None

    def stats(self):
        return None

    def close(self) -> None:
        pass


def test_acceptances_and_refusals_go_out_before_the_step():
    core, inbox, out = BusyCore(), queue.SimpleQueue(), queue.SimpleQueue()
    loop = threading.Thread(target=CoreLoop(core, inbox, out.put).run)
    for rid in ("ok", "full"):
        inbox.put(AddRequest(rid, [1, 2, 3], SamplingParams(max_tokens=1), acknowledge=True))
    loop.start()
    try:
        answers = [out.get(timeout=5) for _ in range(3)]  # the first stats, then the two answers
        queued = [m for m in answers if isinstance(m, RequestsQueued)]
        refused = [f for m in answers if isinstance(m, StepOutputs) for f in m.failures]
        assert not core.release.is_set()  # the step has not run yet
        assert queued[0].request_ids == ["ok"]
        assert [(f.request_id, f.status, f.retry_after) for f in refused] == [("full", 429, 1)]
    finally:
        inbox.put(Shutdown())
        core.release.set()
        loop.join(10)
