"""The n sequences of one call (OpenAI ``n``): one prefill, the prompt's KV shared.

A call asking for ``n`` choices is ``n`` requests in the scheduler, admitted together (admission
control and the tenant quota count ``n`` sequences; all are queued or the call is refused). The
first, the *leader*, computes the prompt; the others, its *followers*, wait in their queue until
the leader's prompt KV exists. At that step (:meth:`SiblingGroup.prompt_computed`) the group takes
a reference on each of the leader's full prompt blocks under a holder id of its own, as a prefill
replica's lease does (:meth:`~cadenza.node.core.block_manager.KVBlockManager.share`): the blocks
outlive the leader — finished, aborted or preempted — until the last follower has adopted them.
A follower is then admitted with those blocks as its cached prefix, exactly like a prefix-cache
hit (with or without prefix caching), and computes only the rest of its prompt: the tokens after
the last full block it shares, 1 to ``block_size`` tokens (the prompt's last token is always
computed, so its logits exist and it never lands in a shared block). No copy-on-write: the
partial last block is recomputed per follower, which costs at most ``block_size`` tokens each.

Once admitted, a follower is an ordinary request: preempting it drops only its own references
(the shared blocks stay with the others, and its resume may hit the prefix cache), and aborting
the call aborts each sequence, the last one releasing the holder. If the leader ends before its
prompt is computed, the followers stop waiting and prefill as separate requests would. No torch
here.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class Request(Protocol):  # what a group reads of a request (:class:`~cadenza.node.core.request.Request`)
    request_id: str
    num_prompt_tokens: int
    traffic_class: str
    group: SiblingGroup | None

    @property
    def is_finished(self) -> bool: ...


class _Blocks(Protocol):  # the part of the KV block manager a group uses
    block_size: int

    def block_table(self, request_id: str) -> list[int]: ...
    def share(self, holder_id: str, blocks: Sequence[int]) -> None: ...
    def free(self, request_id: str, keep_hashes: bool = False) -> int: ...


class SiblingGroup:
    """The sequences of one call, and the prompt blocks their leader computed for them.

    Args:
        requests: the call's sequences, the leader (choice 0) first; at least two.

    Attributes:
        leader: the sequence that computes the prompt.
        waiting: followers not admitted yet, in choice order.
        holder_id: the block manager id under which the shared prompt blocks are held.
        blocks: the held prompt blocks once the leader's prompt is computed; None before.
    """

    __slots__ = ("leader", "waiting", "holder_id", "blocks")

    def __init__(self, requests: Sequence[Request]) -> None:
        if len(requests) < 2:
            raise ValueError("a sibling group needs at least two sequences")
        self.leader = requests[0]
        self.waiting: list[Request] = list(requests[1:])
        self.holder_id = f"{self.leader.request_id}#prompt"
        self.blocks: list[int] | None = None

    def waits(self, req: Request) -> bool:
        """``req`` is a follower that may not start yet: its leader is live and has not
        computed the prompt."""
        return self.blocks is None and req is not self.leader and not self.leader.is_finished and req in self.waiting

    def shared_prefix(self, req: Request) -> list[int] | None:
        """The blocks a waiting follower adopts as its cached prefix; None when it has none to
        adopt (the leader, an admitted follower, or a leader that ended before its prompt)."""
        if self.blocks is None or req not in self.waiting:
            return None
        return list(self.blocks)

    def prompt_computed(self, req: Request, kv: _Blocks) -> None:
        """Called when ``req`` has computed its whole prompt: if it is the leader and followers
        wait, hold its full prompt blocks for them (once)."""
        if req is not self.leader or self.blocks is not None:
            return
        full = (req.num_prompt_tokens - 1) // kv.block_size  # the last token is computed by each
        self.blocks = list(kv.block_table(req.request_id)[:full])
        if self.waiting and self.blocks:
            kv.share(self.holder_id, self.blocks)

    def left(self, req: Request, kv: _Blocks) -> None:
        """``req`` was admitted or ended: it no longer waits; the holder goes with the last."""
        if req in self.waiting:
            self.waiting.remove(req)
            if not self.waiting:
                kv.free(self.holder_id)


# -- the scheduler's hooks: each a no-op for a request that is a call of its own -----------------


def link(requests: Sequence[Request]) -> None:
    """Make ``requests`` (the leader first, its class checked) one call's sequences: one group,
    the leader's canonical class. A call of one is left as it is."""
    if len(requests) > 1:
        group = SiblingGroup(requests)
        for req in requests:
            req.group, req.traffic_class = group, requests[0].traffic_class


def waits(req: Request) -> bool:
    """``req`` may not be admitted yet: a sibling whose leader has not computed the prompt."""
    return req.group is not None and req.group.waits(req)


def shared_prefix(req: Request) -> list[int]:
    """The prompt blocks ``req`` adopts at admission (empty: none; look up the prefix cache)."""
    return (req.group.shared_prefix(req) or []) if req.group is not None else []


def prompt_computed(req: Request, kv: _Blocks) -> None:
    """``req`` has computed its prompt (see :meth:`SiblingGroup.prompt_computed`)."""
    if req.group is not None:
        req.group.prompt_computed(req, kv)


def left(req: Request, kv: _Blocks) -> None:
    """``req`` was admitted or ended (see :meth:`SiblingGroup.left`)."""
    if req.group is not None:
        req.group.left(req, kv)
