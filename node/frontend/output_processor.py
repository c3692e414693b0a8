"""The output processor: the core's token ids become client outputs.

For each :class:`~cadenza.node.core.messages.RequestDelta` of a step it runs the request's
incremental detokenizer (never broken UTF-8; a stop string held back until it can be ruled out,
then cut), and decides what the client sees. A stop string is the one finish the core cannot see
(it has no text): the processor ends the request's output as ``stop`` and reports the id, which
its caller sends to the core as an abort with the reason ``stop`` — so the core alone decides
"finished", and no further token is scheduled for it. Tokens the core produced for a request
after its stop (a step already in flight) are dropped here. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cadenza.node.core.messages import RequestDelta
from cadenza.node.core.request import SamplingParams
from cadenza.node.frontend.detokenizer import IncrementalDetokenizer
from cadenza.node.frontend.tokenizer import Tokenizer


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request, as the client sees it (a delta).

    Attributes:
        token_ids: tokens generated this step (at most one).
        text: newly decodable text; never a broken UTF-8 sequence, never part of a stop string.
        finish_reason: ``stop`` | ``length`` | ``abort`` once finished, else None.
        num_prompt_tokens, num_output_tokens: counts so far (usage).
        num_cached_tokens: prompt tokens served from the prefix cache.
        time: ``time.monotonic()`` when the step that produced it finished (seconds).
        logprobs: for a request that asked, one entry per token of ``token_ids`` that made text
            (:class:`~cadenza.node.core.messages.RequestDelta`'s form); None otherwise, and for
            the end-of-sequence or stop token that finishes a request (it makes no text).
        index: the choice it belongs to in a call of several (OpenAI ``n``; set by the engine
            client), 0 otherwise.
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    time: float = 0.0
    logprobs: list | None = None
    index: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    """Per-request detokenizer state and the stop-string rule.

    Args:
        tokenizer: the model's tokenizer; None streams token ids without text.
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._detokenizers: dict[str, IncrementalDetokenizer | None] = {}

    def add_request(self, request_id: str, sampling: SamplingParams) -> None:
        """Start tracking a request (before its first delta can arrive)."""
        self._detokenizers[request_id] = (IncrementalDetokenizer(self.tokenizer, sampling.stop)
                                          if self.tokenizer is not None else None)

    def drop(self, request_id: str) -> None:
        """Forget a request (aborted or failed): later deltas for it are ignored."""
        self._detokenizers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._detokenizers

    def __len__(self) -> int:
        return len(self._detokenizers)

    def process(self, deltas: Iterable[RequestDelta], time: float) -> tuple[list[RequestOutput], list[str]]:
        """Turn one step's deltas into outputs.

        Returns:
            The outputs of requests still tracked, in order; and the ids whose stop string
            completed in this step (the caller aborts them in the core with reason ``stop``).
        """
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        detokenizers = self._detokenizers
        for d in deltas:
            rid = d.request_id
            if rid not in detokenizers:
                continue  # finished here already (a stop string), or never ours
            detok = detokenizers[rid]
            finish = d.finish_reason
            text = ""
            if detok is not None:
                if finish != "stop":  # EOS and stop token ids add no text
                    for token in d.new_token_ids:
                        text += detok.add_token(token)
                        if detok.stopped:
                            break
                if detok.stopped:
                    if finish is None:
                        stopped.append(rid)  # the core still runs it: abort it with reason stop
                    finish = "stop"
                elif finish is not None:
                    text += detok.flush()
            if finish is not None:
                del detokenizers[rid]
            logprobs = d.logprobs if d.finish_reason != "stop" else None  # EOS and stop ids: no text, no entry
            outputs.append(RequestOutput(rid, d.new_token_ids, text, finish, d.num_prompt_tokens,
                                         d.num_output_tokens, d.num_cached_tokens, time, logprobs))
        return outputs, stopped
