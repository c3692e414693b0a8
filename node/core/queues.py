"""Waiting requests of one traffic class: preempted ones first, then one FIFO per tenant.

Tenants share the class's prefill tokens by weighted fair queuing (start-time fair queuing on
*virtual service*: every prefill token a tenant is granted adds ``1 / weight`` to its service;
the tenant with the least service goes next — Demers, Keshav & Shenker, SIGCOMM 1989; Goyal et
al., SIGCOMM 1996). A tenant that was idle starts at the least service of the tenants now
waiting, so idleness banks no credit. No torch here.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from collections.abc import Iterable

from cadenza.node.core.request import Request


def _arrival(req: Request) -> float:
    return req.arrival_time


class ClassQueue:
    """FIFO per tenant, a resume list for preempted requests, and per-tenant WFQ service."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.resume: list[Request] = []  # preempted requests, oldest arrival first
        self.tenants: dict[str, deque[Request]] = {}
        self.service: defaultdict[str, float] = defaultdict(float)
        self.queued_prompt_tokens: defaultdict[str, int] = defaultdict(int)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, req: Request) -> None:
        """Queue a new request at the back of its tenant's FIFO."""
        queue = self.tenants.get(req.tenant)
        if not queue:
            self._activate(req.tenant)
            queue = self.tenants.setdefault(req.tenant, deque())
        queue.append(req)
        self.queued_prompt_tokens[req.tenant] += req.num_tokens
        self._count += 1

    def push_resume(self, req: Request) -> None:
        """Queue a preempted request; it goes before every new admission of the class."""
        bisect.insort(self.resume, req, key=_arrival)
        self.queued_prompt_tokens[req.tenant] += req.num_tokens
        self._count += 1

    def pop(self, req: Request) -> None:
        """Take ``req`` out (it is being admitted, or was aborted). Raises ValueError if absent."""
        if self.resume and req in self.resume:
            self.resume.remove(req)
        else:
            queue = self.tenants.get(req.tenant)
            if queue is None:
                raise ValueError(f"{req.request_id} is not queued in {self.name}")
            queue.remove(req)
            if not queue:
                del self.tenants[req.tenant]
        self.queued_prompt_tokens[req.tenant] -= req.num_tokens
        if not self.queued_prompt_tokens[req.tenant]:
            del self.queued_prompt_tokens[req.tenant]
        self._count -= 1

    def oldest(self) -> Request | None:
        """The request that has waited longest (O(tenants))."""
        heads: Iterable[Request] = (q[0] for q in self.tenants.values())
        candidates = [*self.resume[:1], *heads]
        return min(candidates, key=_arrival) if candidates else None

    def next_tenant(self, exclude: set[str]) -> str | None:
        """The waiting tenant with the least virtual service, skipping ``exclude``."""
        best, best_service = None, 0.0
        for tenant in self.tenants:
            if tenant in exclude:
                continue
            service = self.service[tenant]
            if best is None or service < best_service:
                best, best_service = tenant, service
        return best

    def charge(self, tenant: str, tokens: int, weight: float) -> None:
        """Account ``tokens`` of prefill granted to ``tenant``."""
        self.service[tenant] += tokens / weight

    def _activate(self, tenant: str) -> None:
        waiting = [self.service[t] for t in self.tenants if self.tenants[t]]
        if waiting:
            self.service[tenant] = max(self.service[tenant], min(waiting))
