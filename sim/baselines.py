"""Baseline scheduling policies the simulator compares cadenza's against, built from the same parts.

- **prefill-first, unchunked** (:class:`PrefillFirstScheduler`): vLLM's scheduler before chunked
  prefill (V0's default): a step takes whole waiting prompts when any can be admitted, and then
  runs no decode; decodes run only in steps with no prompt to admit. Configure it with
  ``chunk_size=None`` and a ``token_budget`` of at least the longest prompt, as vLLM required
  ``max_num_batched_tokens >= max_model_len``.
- **chunked FCFS** (Sarathi-Serve): cadenza's own scheduler with one traffic class and no step
  time target — a ``SchedulerConfig`` choice, not code.

Only the order of the parts differs: admission (the prefill adder, KV headroom, prefix cache) and
the decode pass are the engine's.
"""

from __future__ import annotations

from cadenza.node.core.decode import schedule_decodes
from cadenza.node.core.prefill import PrefillAdder
from cadenza.node.core.request import split_by_phase
from cadenza.node.core.scheduler import Scheduler
from cadenza.node.core.step import SchedulerOutput, Step


class PrefillFirstScheduler(Scheduler):
    """Prompts first, decodes wait: a step is all prefill when any prompt can start (or continue),
    else all decode."""

    def schedule(self) -> SchedulerOutput:
        self.stats.num_steps += 1
        step = Step(self.config.token_budget)
        _decoding, prefilling = split_by_phase(self.running)
        PrefillAdder(self._prefill_context(prefilling, False), step).run()
        if step.out.is_empty:
            step = Step(self.config.token_budget)
            schedule_decodes(step, self.running, self.block_manager, self.preemption, self.stats)
        self.stats.decode_tokens += step.out.num_decode_tokens
        if not step.out.is_empty:
            step.out.predicted_seconds = self.cost_model.predict(step.out.features())
        return step.out
