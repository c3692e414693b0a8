"""Drive a :class:`~cadenza.node.core.scheduler.Scheduler` without a model: a fake executor and clock.

Scheduler-level tests measure what matters — tokens per step, who got which row, when — in
steps, with a clock that advances a fixed time per step, so they are exact and fast.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from cadenza.node.core.block_manager import KVBlockManager
from cadenza.node.core.config import SchedulerConfig
from cadenza.node.core.policy import Policy, default_class_policies
from cadenza.node.core.request import Request, SamplingParams
from cadenza.node.core.scheduler import Scheduler
from cadenza.node.core.step import SchedulerOutput

_ids = itertools.count()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    token_budget=64, chunk_size=16, max_num_seqs=8, max_model_len=512, num_blocks=256, block_size=4,
    prefix_caching=True, clock=None, queue_depth=None, connector=None, **policy,
) -> Scheduler:
    """A scheduler over a fake KV pool. ``queue_depth`` bounds every class's queue (tests that flood
    queues on purpose; by default the bound derived from ``max_num_seqs`` applies); ``connector``
    loads remote KV."""
    if queue_depth is not None:
        classes = policy.get("classes") or default_class_policies()
        policy["classes"] = {name: dataclasses.replace(c, max_queue_depth=queue_depth) for name, c in classes.items()}
    config = SchedulerConfig(token_budget, chunk_size, max_num_seqs, max_model_len, prefix_caching, Policy(**policy))
    return Scheduler(config, KVBlockManager(num_blocks, block_size, prefix_caching), clock=clock or FakeClock(),
                     connector=connector)


def make_request(prompt_len: int, max_tokens: int = 4, arrival: float | None = None, tokens: list[int] | None = None,
                 **fields) -> Request:
    """A request with its own prompt tokens (no two share a prefix unless ``tokens`` says so)."""
    rid = next(_ids)
    prompt = tokens if tokens is not None else [(rid * 7919 + i * 31) % 30000 + 3 for i in range(prompt_len)]
    req = Request(f"r{rid}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), **fields)
    if arrival is not None:
        req.arrival_time = arrival
    return req


@dataclass
class Record:
    """What happened in the steps a :class:`FakeEngine` ran."""

    steps: list[SchedulerOutput] = field(default_factory=list)
    first_token_step: dict[str, int] = field(default_factory=dict)
    arrival_step: dict[str, int] = field(default_factory=dict)
    admitted_age: dict[str, float] = field(default_factory=dict)  # seconds waited before admission


class FakeEngine:
    """Schedules, 'runs' each step in ``step_seconds`` of fake time, feeds back token 5."""

    def __init__(self, sched: Scheduler, step_seconds: float = 0.05) -> None:
        self.sched = sched
        self.clock: FakeClock = sched.clock  # type: ignore[assignment]
        self.step_seconds = step_seconds
        self.record = Record()

    def add(self, req: Request) -> Request:
        req.arrival_time = self.clock.now
        self.sched.add_request(req)
        self.record.arrival_step[req.request_id] = len(self.record.steps)
        return req

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        for row in out.rows:
            req = row.request
            if req.admitted_time is not None and req.request_id not in self.record.admitted_age:
                self.record.admitted_age[req.request_id] = req.admitted_time - req.arrival_time
        self.clock.now += self.step_seconds
        self.sched.observe_step_time(out, self.step_seconds)
        updates = self.sched.update_from_output(out, [5] * out.num_sampled)
        index = len(self.record.steps)
        for req in updates:
            self.record.first_token_step.setdefault(req.request_id, index)
        self.record.steps.append(out)
        return out

    def run(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")
