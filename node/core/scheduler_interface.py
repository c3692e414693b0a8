"""The scheduler's contract: what the engine core, the simulator and the tests may call.

Modelled on vLLM V1's ``SchedulerInterface`` (``vllm/v1/core/sched/interface.py``): a request's
only progress state is ``num_computed_tokens`` catching up with ``num_tokens``; :meth:`schedule`
decides the next step's rows under the token budget, the caller runs them (a model, or a cost
model in ``cadenza sim``) and hands the sampled tokens to :meth:`update_from_output`. Nothing here
touches torch, text or time beyond the injected clock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from cadenza.node.core.config import SchedulerConfig
from cadenza.node.core.request import Request, RequestStatus
from cadenza.node.core.stats import EngineStats
from cadenza.node.core.step import SchedulerOutput


class SchedulerInterface(ABC):
    """Builds each step's mixed batch and applies its results."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a request in its traffic class.

        Args:
            request: a new request (``WAITING``, nothing computed).

        Raises:
            ValueError: its id is already live.
            AdmissionError: refused by admission control (400/413/429 with ``retry_after``).
        """

    @abstractmethod
    def check_admission(self, request: Request, count: int = 1) -> None:
        """Would :meth:`add_request` refuse ``request`` now (``count``: as many sequences of it,
        OpenAI ``n``)? Reads state only.

        Raises:
            AdmissionError: as :meth:`add_request`.
        """

    @abstractmethod
    def abort_request(self, request_id: str) -> Request | None:
        """Drop a live request now and free its KV blocks.

        Returns:
            The request (``FINISHED_ABORTED``), or None if it was not live.
        """

    @abstractmethod
    def finish_request(self, request_id: str, status: RequestStatus) -> bool:
        """End a request for a reason found outside the scheduler (a stop string matched by the
        front end); its KV is freed and it is never scheduled again.

        Returns:
            False if it was not live.
        """

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Choose the rows of the next step.

        Returns:
            Decode rows first, then prefill chunks; never more than ``token_budget`` tokens, and
            ``predicted_seconds`` once the cost model is calibrated. Empty when nothing can run.
        """

    @abstractmethod
    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: Sequence[int]) -> list[Request]:
        """Apply a step that ran.

        Args:
            output: the step, as :meth:`schedule` returned it.
            sampled_token_ids: one token per row with ``sample`` set, in row order.

        Returns:
            The live requests that sampled a token, in row order: each one's new token is the
            last of its ``token_ids``, and it is finished (:attr:`Request.is_finished`, its
            ``status`` saying why: EOS, a stop token, ``max_tokens``) when that token ended it;
            finished requests' KV is freed.

        Raises:
            ValueError: not one token per sampling row; nothing is applied.
        """

    @abstractmethod
    def observe_step_time(self, output: SchedulerOutput, seconds: float) -> None:
        """Feed a measured step duration (seconds of model time) to the cost model."""

    @abstractmethod
    def reconfigure(self, config: SchedulerConfig) -> None:
        """Apply new knobs from the next step.

        Raises:
            ValueError: a change that cannot be made live (``max_model_len``).
        """

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""

    @abstractmethod
    def snapshot(self) -> EngineStats:
        """Counters and gauges now (queues per class, KV blocks by state, counters)."""
