"""Admission control at arrival: refuse what cannot fit, and what overloads, clearly and at once.

A request that could never be served (prompt or prompt + ``max_tokens`` over ``max_model_len``,
a prompt above its tenant's queued-token quota) is refused with 400/413. One that would overload
a queue — the class's queue is at its depth limit, the tenant is at its concurrency or
queued-token quota — is refused with 429 and a ``Retry-After`` estimated from how fast that class's
queue drains. Nothing already admitted is ever dropped. No torch here.
"""

from __future__ import annotations

from collections import deque

from collections.abc import Callable

from cadenza.node.core.policy import Policy, PolicyError, check_class, check_tenant
from cadenza.node.core.request import Request
from cadenza.node.core.stats import EngineStats, retry_after


class AdmissionError(ValueError):
    """A refused request.

    Attributes:
        status: HTTP status: 400 (can never fit), 413 (larger than a quota), 429 (overload).
        retry_after: seconds to wait before retrying (429 only).
        reason: short machine-readable cause (``queue_full``, ``tenant_concurrency``, ...).
    """

    def __init__(self, status: int, message: str, reason: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.retry_after = retry_after


class DrainRate:
    """Requests leaving a queue per second, over the last ``window`` admissions that happened in
    the last ``horizon_s`` seconds: admissions from before an idle spell say nothing about how fast
    the queue drains now (counting them made a burst after idle answer ``Retry-After: 300`` for a
    queue that drained in seconds)."""

    def __init__(self, window: int = 64, horizon_s: float = 30.0) -> None:
        self._times: deque[float] = deque(maxlen=window)
        self.horizon_s = horizon_s

    def record(self, now: float) -> None:
        self._times.append(now)

    def per_second(self, now: float) -> float | None:
        """The recent rate, or None with fewer than two admissions inside the horizon."""
        times = self._times
        while times and now - times[0] > self.horizon_s:
            times.popleft()
        if len(times) < 2:
            return None
        span = max(now - times[0], 1e-3)
        return len(times) / span

    def retry_after(self, queued: int, now: float) -> int:
        """Seconds until ``queued`` requests ahead have drained (1 to 300)."""
        return retry_after(queued, self.per_second(now))


def canonicalize_class_and_tenant(req: Request) -> None:
    """Give ``req`` its canonical (lower-case) class name, checking it and the tenant's.

    Raises:
        AdmissionError: 400 ``bad_class_or_tenant``.
    """
    try:
        req.traffic_class = check_class(req.traffic_class)
        check_tenant(req.tenant)
    except PolicyError as exc:
        raise AdmissionError(400, str(exc), "bad_class_or_tenant") from None


def check_published(req: Request, policy: Policy, max_model_len: int, stats: EngineStats, count: int = 1) -> None:
    """:func:`check_admission` against an engine's last published stats: how the front end
    refuses at once, without asking the core (which checks again when the request arrives).
    ``count``: sequences of the request (OpenAI ``n``).

    Raises:
        AdmissionError: as :func:`check_admission`.
    """
    canonicalize_class_and_tenant(req)
    cls = stats.classes.get(req.traffic_class)
    tenant = stats.tenants.get(req.tenant)
    check_admission(req, policy, max_model_len, cls.waiting if cls else 0,
                    tenant.live if tenant else 0, tenant.queued_prompt_tokens if tenant else 0,
                    cls.retry_after if cls else (lambda _queued: 1), cls.queue_limit if cls else None, count)


def check_admission(
    req: Request,
    policy: Policy,
    max_model_len: int,
    class_depth: int,
    tenant_live: int,
    tenant_queued_tokens: int,
    retry_after: Callable[[int], int],
    queue_limit: int | None = None,
    count: int = 1,
) -> None:
    """Refuse ``req`` if it cannot or should not be queued now.

    A call of ``count`` sequences (OpenAI ``n``) counts ``count`` requests against the queue
    depth and the tenant's concurrency and ``count`` prompts against its queued-token quota;
    one that could never fit them is a 400 naming ``n`` (413 for the token quota, as one prompt).

    Args:
        class_depth: requests waiting in the request's class.
        queue_limit: most requests the class may have waiting (default: its policy's
            ``max_queue_depth``; the scheduler passes the bound derived from its capacity).
        count: sequences the request asks for (each queued as a request).
        tenant_live: the tenant's live requests (waiting or running).
        tenant_queued_tokens: the tenant's prompt tokens waiting.
        retry_after: seconds until a given number of the class's queued requests have drained.

    Raises:
        AdmissionError: with the status, a message for the client and ``Retry-After`` for 429.
    """
    total = req.num_prompt_tokens + req.sampling.max_tokens
    if total > max_model_len:
        raise AdmissionError(
            400, f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.sampling.max_tokens}) "
            f"exceeds max_model_len={max_model_len}", "too_long")
    limit = policy.classes[req.traffic_class].max_queue_depth if queue_limit is None else queue_limit
    if limit is not None and count > limit:
        raise AdmissionError(400, f"n: {count} sequences can never fit the {req.traffic_class} queue "
                             f"(at most {limit} requests)", "too_many_sequences")
    if limit is not None and class_depth + count > limit:
        raise AdmissionError(
            429, f"the {req.traffic_class} queue is full ({class_depth} requests waiting); retry later",
            "queue_full", retry_after(class_depth))
    tenant = policy.tenant(req.tenant)
    if tenant.max_concurrent is not None:
        if count > tenant.max_concurrent:
            raise AdmissionError(400, f"n: {count} sequences are more than tenant {req.tenant!r} may run at "
                                 f"once ({tenant.max_concurrent})", "too_many_sequences")
        if tenant_live + count > tenant.max_concurrent:
            raise AdmissionError(
                429, f"tenant {req.tenant!r} has {tenant_live} requests in flight, its limit; retry later",
                "tenant_concurrency", retry_after(1))
    limit = tenant.max_queued_prompt_tokens
    if limit is not None:
        tokens = count * req.num_prompt_tokens
        if tokens > limit:
            raise AdmissionError(
                413, f"the prompt ({req.num_prompt_tokens} tokens{f' x {count} sequences' if count > 1 else ''}) "
                f"is larger than tenant {req.tenant!r}'s queued-token quota ({limit})", "tenant_tokens_quota")
        if tenant_queued_tokens + tokens > limit:
            raise AdmissionError(
                429, f"tenant {req.tenant!r} has {tenant_queued_tokens} prompt tokens queued (limit {limit}); "
                "retry later", "tenant_tokens", retry_after(class_depth or 1))
