"""How many CPU threads this process may really use, for torch's intra-op pool.

torch sizes its pool from the machine's core count. In a container or on a shared machine that
oversubscribes: a pod with ``limits.cpu: 2`` on a 64-core node gets 64 threads that the kernel
throttles to two cores' worth of time, and every step waits on the slowest, throttled thread
(measured here: `make serve` 4x slower, ITL p50 221-274 ms instead of 61-71 ms). The usable
count is the smaller of

- the CPU affinity mask (``os.sched_getaffinity``: taskset, cpusets, Kubernetes' static CPU
  manager), and
- the cgroup CPU quota, rounded down, at least 1: cgroup v2 ``cpu.max`` (``quota period``, or
  ``max``) of this process's cgroup and its ancestors, or cgroup v1 ``cpu.cfs_quota_us`` /
  ``cpu.cfs_period_us`` (what a Kubernetes CPU limit becomes).

An explicit choice wins: ``--threads N``, else ``OMP_NUM_THREADS`` (set by ``cadenza up`` per
replica, or by the user). The file reads are injectable, so the parsing is tested without a cgroup.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

logger = logging.getLogger(__name__)

Reader = Callable[[str], str | None]


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (the machine's count where there is no mask)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cgroup_cpu_quota(read: Reader = _read) -> float | None:
    """The cgroup CPU quota in CPUs (``1.5`` = 150 ms per 100 ms), or None when unlimited.

    cgroup v2: the smallest ``cpu.max`` from this process's cgroup up to the root; cgroup v1:
    ``cpu.cfs_quota_us / cpu.cfs_period_us`` of the ``cpu`` controller.
    """
    quotas = []
    membership = read("/proc/self/cgroup") or ""
    for line in membership.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2: "0::/path"
            parts = [p for p in path.strip().split("/") if p]
            for depth in range(len(parts), -1, -1):
                folder = "/".join(["/sys/fs/cgroup", *parts[:depth]])
                if (quota := _v2_quota(read(f"{folder}/cpu.max"))) is not None:
                    quotas.append(quota)
        elif "cpu" in controllers.split(","):  # cgroup v1: "N:cpu,cpuacct:/path"
            own = path.strip().rstrip("/")
            for folder in (f"{base}{own}" for base in ("/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpu")):
                quota, period = read(f"{folder}/cpu.cfs_quota_us"), read(f"{folder}/cpu.cfs_period_us")
                if quota is not None and period is not None:
                    if (value := _v1_quota(quota, period)) is not None:
                        quotas.append(value)
                    break
    if not membership:  # no /proc: try the v2 root as a container sees it
        if (quota := _v2_quota(read("/sys/fs/cgroup/cpu.max"))) is not None:
            quotas.append(quota)
    return min(quotas) if quotas else None


def _v2_quota(text: str | None) -> float | None:
    if not text:
        return None
    fields = text.split()
    try:
        if len(fields) != 2 or fields[0] == "max":
            return None
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota.strip()), int(period.strip())
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


class ThreadChoice(NamedTuple):
    """How many intra-op threads, and why (for the start-up log line)."""

    threads: int
    reason: str


def choose_threads(requested: int | None = None, environ: dict[str, str] | None = None,
                   affinity: int | None = None, read: Reader = _read) -> ThreadChoice:
    """The intra-op thread count: ``requested`` (``--threads``), else ``OMP_NUM_THREADS``, else
    the usable CPUs (affinity, capped by the cgroup quota rounded down, at least 1).

    Args:
        environ, affinity, read: the environment, the affinity count and a file reader (default:
            this process's); tests pass their own.

    Raises:
        ValueError: ``requested`` or ``OMP_NUM_THREADS`` is not a positive integer.
    """
    env = os.environ if environ is None else environ
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"threads: must be a positive integer, got {requested!r}")
        return ThreadChoice(requested, "--threads")
    if "OMP_NUM_THREADS" in env:
        value = env["OMP_NUM_THREADS"].strip()
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"OMP_NUM_THREADS: must be a positive integer, got {value!r}")
        return ThreadChoice(int(value), "OMP_NUM_THREADS")
    cpus = affinity_cpus() if affinity is None else affinity
    limit = cgroup_cpu_quota(read)
    if limit is not None and math.floor(limit) < cpus:
        return ThreadChoice(max(1, math.floor(limit)), f"cgroup CPU quota {limit:g} of {cpus} CPUs in the affinity mask")
    return ThreadChoice(cpus, f"{cpus} CPUs in the affinity mask" + ("" if limit is None else f", quota {limit:g}"))


def apply_threads(choice: ThreadChoice) -> None:
    """Size torch's intra-op pool (call before the first forward pass) and log the choice."""
    import torch

    torch.set_num_threads(choice.threads)
    logger.info("torch intra-op threads: %d (%s)", choice.threads, choice.reason)
