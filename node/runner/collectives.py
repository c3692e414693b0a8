"""The collectives of a tensor-parallel replica: all-reduce, gather and the step's broadcast.

A replica of tensor-parallel size ``N`` runs ``N`` ranks, one process each, on one node. Per step
they need three things (:mod:`cadenza.node.runner.tp_shards` says why):

- rank 0 sends the step's input arrays (a few KB) to the others: :meth:`Collectives.broadcast`;
- two all-reduces per layer of ``[T, hidden]`` activations, and one after the embedding;
- the LM head's vocabulary slices gathered on rank 0, which samples.

Two implementations of one small interface (:class:`Group`):

- :class:`ShmGroup`: shared memory on the host. Every rank maps one file in ``/dev/shm``; an op
  writes the rank's part into its slot, publishes the op's sequence number, waits until every rank
  has published it, then reads what it needs. Slots alternate between two sets by sequence, so a
  rank may start op ``k + 1`` while a slower one still reads op ``k``: it cannot reach op ``k + 2``
  (which reuses ``k``'s set) before every rank has entered ``k + 1``, i.e. finished reading ``k``.
  Every rank sums the slots in rank order, so all ranks hold bit-identical results. Tensors larger
  than a slot go through in pieces. This is the CPU engine's default: on this project's machine a
  decode step's all-reduce (64 KiB) takes 29 us here and 383 us over gloo's TCP, whose background
  threads also compete with the compute for the cores (``bench/tensor_parallel.py``,
  docs/benchmarks.md). vLLM's CPU backend uses a shared-memory all-reduce for the same reason. Waits spin, then yield, then sleep (an idle replica's workers do not burn their cores).
  Stores are ordered as x86-64 orders them (total store order: a slot's data is visible before its
  sequence number); other architectures use gloo.
- :class:`TorchGroup`: a ``torch.distributed`` backend built without the global process group
  (several engines, and tests, share a process): NCCL for CUDA tensors, gloo for CPU ones.

A GPU replica all-reduces and gathers over NCCL and broadcasts its host arrays over shared memory;
a CPU replica does everything over shared memory, or over gloo with ``CADENZA_TP_COLLECTIVES=gloo``.

Failure: any rank may :meth:`~Group.abort` the group (the engine does so when a worker process
dies); every wait then raises :class:`TensorParallelError` instead of waiting forever, and so does
a wait whose peer process is gone.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

SLOT_BYTES = 4 << 20  # one rank's part of one op, per slot set; larger tensors go in pieces
MAX_RANKS = 16
_CONTROL_BYTES = 4096
_ABORT, _SEQ, _PID = 0, 8, 8 + MAX_RANKS  # control words: abort flag, each rank's op sequence, each rank's pid
SPIN_S = 0.002  # a wait spins briefly, yields the core until this long, then sleeps
_SLEEP_MAX_S = 0.0005
PEER_CHECK_S = 0.5  # how often a long wait checks that its peers' processes still live
# A TorchGroup's broadcast: a worker waits in one for rank 0's next step for as long as the replica
# idles (a dead peer still fails it at once: its connection closes)
BROADCAST_TIMEOUT = timedelta(days=365)


class TensorParallelError(RuntimeError):
    """A rank of the replica is gone or the group was aborted: the replica cannot step again."""


class Group(Protocol):
    """What a rank needs of its peers. Every rank calls every op, in the same order."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape everywhere), in rank order, on rank 0; None elsewhere."""

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (a contiguous CPU tensor of the same size); returns it."""

    def abort(self) -> None:
        """Make every rank's current and next wait raise :class:`TensorParallelError`."""

    def close(self) -> None: ...


def arena_bytes(size: int) -> int:
    """Bytes of the shared file of a :class:`ShmGroup` of ``size`` ranks."""
    return _CONTROL_BYTES + 2 * size * SLOT_BYTES


def create_arena(path: Path, size: int) -> None:
    """Create the zeroed shared file of a group of ``size`` ranks at ``path`` (mode 0600).

    Raises:
        ValueError: ``size`` outside ``[1, MAX_RANKS]``.
        OSError: the file cannot be created or sized.
    """
    if not 1 <= size <= MAX_RANKS:
        raise ValueError(f"a shared-memory group has 1 to {MAX_RANKS} ranks, got {size}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, arena_bytes(size))
    finally:
        os.close(fd)


class ShmGroup:
    """A group over a shared file (:func:`create_arena`) that every rank maps.

    Args:
        path: the file; rank 0 may unlink it once every rank has mapped it.
        rank, size: this rank and the group's size.
        peers: the other ranks' process ids where known (a wait on a dead one raises), else read
            from the file as each rank maps it.
    """

    def __init__(self, path: Path, rank: int, size: int) -> None:
        if not 0 <= rank < size <= MAX_RANKS:
            raise ValueError(f"rank {rank} of {size}: outside the group")
        self.rank, self.size = rank, size
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != arena_bytes(size):
                raise ValueError(f"{path}: not the shared file of a group of {size}")
            self._map = mmap.mmap(fd, arena_bytes(size))
        finally:
            os.close(fd)
        self._control = np.frombuffer(self._map, dtype=np.int64, count=_CONTROL_BYTES // 8)
        self._slots = [[np.frombuffer(self._map, dtype=np.uint8, count=SLOT_BYTES,
                                      offset=_CONTROL_BYTES + (s * size + r) * SLOT_BYTES) for r in range(size)]
                       for s in range(2)]
        self._control[_PID + rank] = os.getpid()
        self._seq = int(self._control[_SEQ + rank])
        self._checked = 0.0

    # -- the protocol -------------------------------------------------------------------------

    def _round(self, mine: memoryview | None) -> list[np.ndarray]:
        """One op: publish ``mine`` (at most a slot), wait for every rank; the slots of this op."""
        self._seq += 1
        slots = self._slots[self._seq % 2]
        if mine is not None:
            slots[self.rank][: len(mine)] = np.frombuffer(mine, dtype=np.uint8)
        self._control[_SEQ + self.rank] = self._seq
        self._wait(self._seq)
        return slots

    def _wait(self, seq: int) -> None:
        control, first, started = self._control, _SEQ, time.perf_counter()
        spins, sleep = 0, 0.0
        while True:
            if control[_ABORT]:
                raise TensorParallelError("the tensor-parallel group was aborted (a rank is gone)")
            if control[first: first + self.size].min() >= seq:
                return
            spins += 1
            if spins < 64:  # the peer is usually a few microseconds away
                continue
            now = time.perf_counter()
            if now - started < SPIN_S:  # then give the core to whoever waits for it (the peer, when
                os.sched_yield()        # more ranks than cores run): free when nobody does
                continue
            if now - self._checked > PEER_CHECK_S:
                self._checked = now
                self._check_peers()
            sleep = min(_SLEEP_MAX_S, sleep + 0.00005)
            time.sleep(sleep)

    def _check_peers(self) -> None:
        for r in range(self.size):
            pid = int(self._control[_PID + r])
            if r != self.rank and pid:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    self.abort()
                    raise TensorParallelError(f"tensor-parallel rank {r} (pid {pid}) is gone") from None
                except PermissionError:  # pragma: no cover - a pid reused by another user's process
                    pass

    # -- ops ----------------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1)
        per = SLOT_BYTES // x.element_size()
        for start in range(0, flat.numel(), per):
            part = flat[start: start + per]
            src = part.detach().contiguous()
            slots = self._round(_bytes(src))
            n = src.numel() * src.element_size()
            total = torch.frombuffer(slots[0][:n], dtype=x.dtype).clone()
            for r in range(1, self.size):
                total += torch.frombuffer(slots[r][:n], dtype=x.dtype)
            part.copy_(total)
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        out = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        flat = x.detach().contiguous().view(-1)
        per = SLOT_BYTES // x.element_size()
        for start in range(0, max(1, flat.numel()), per):
            part = flat[start: start + per]
            slots = self._round(_bytes(part))
            if out is not None:
                n = part.numel() * part.element_size()
                for r in range(self.size):
                    out[r].view(-1)[start: start + part.numel()].copy_(torch.frombuffer(slots[r][:n], dtype=x.dtype)
                                                                      if n else part)
        return out

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        raw = x.view(-1).view(torch.uint8)
        for start in range(0, max(1, raw.numel()), SLOT_BYTES):
            part = raw[start: start + SLOT_BYTES]
            slots = self._round(_bytes(part) if self.rank == 0 else None)
            if self.rank:
                part.copy_(torch.from_numpy(slots[0][: part.numel()]))
        return x

    def watch(self, rank: int, pid: int) -> None:
        """Record ``rank``'s process id before that rank maps the file (rank 0 starts the others):
        a wait on a rank that died before it got here fails too."""
        self._control[_PID + rank] = pid

    def abort(self) -> None:
        self._control[_ABORT] = 1

    @property
    def aborted(self) -> bool:
        return bool(self._control[_ABORT])

    def close(self) -> None:
        self._control = self._slots = None  # the views go first: mmap refuses to close under them
        try:
            self._map.close()
        except BufferError:  # pragma: no cover - a tensor still views the map: the process exit unmaps it
            pass


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


class TorchGroup:
    """A ``torch.distributed`` backend (``ProcessGroupNCCL`` or ``ProcessGroupGloo``) used directly,
    without ``init_process_group``: several groups can live in one process.

    Args:
        backend: ``nccl`` (CUDA tensors) or ``gloo`` (CPU tensors).
        store: the rendezvous store (a ``torch.distributed.FileStore`` in a private folder).
        rank, size: this rank and the group's size.
        timeout_s: how long an all-reduce or gather may wait on a peer before it fails; a broadcast
            waits up to :data:`BROADCAST_TIMEOUT` (a worker waits in one while the replica idles).
    """

    def __init__(self, backend: str, store, rank: int, size: int, timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        self.rank, self.size, self._dist, self._backend = rank, size, dist, backend
        timeout = timedelta(seconds=timeout_s)
        if backend == "nccl":
            self._pg = dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
        elif backend == "gloo":
            self._pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        else:
            raise ValueError(f"backend must be nccl or gloo, got {backend!r}")
        self._aborted = False
        # Connect now, while the rendezvous store exists (NCCL would connect at its first op).
        self.all_reduce(torch.zeros(1, device="cuda" if backend == "nccl" else "cpu"))

    def _run(self, work) -> None:
        if self._aborted:
            raise TensorParallelError("the tensor-parallel group was aborted (a rank is gone)")
        try:
            work.wait()
        except RuntimeError as exc:  # a peer's connection closed, a timeout
            raise TensorParallelError(f"tensor-parallel collective failed: {exc}") from exc

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._run(self._pg.allreduce([x]))
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        opts = self._dist.GatherOptions()
        opts.rootRank = 0
        out = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        self._run(self._pg.gather(out, [x.contiguous()], opts))
        return out[0] if self.rank == 0 else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        opts = self._dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = BROADCAST_TIMEOUT  # the group's timeout would end an idle replica's workers
        self._run(self._pg.broadcast([x], opts))
        return x

    def abort(self) -> None:
        """Fail this rank's waits from now on; NCCL's ``abort`` also ends an op in flight (a dead
        peer otherwise leaves it waiting forever)."""
        self._aborted = True
        if self._backend == "nccl":
            try:
                self._pg.abort()
            except RuntimeError:  # pragma: no cover - already torn down
                pass

    def close(self) -> None:
        """Release the group. NCCL's is aborted rather than shut down: a communicator whose
        collectives a CUDA graph captured can hang in ``ncclCommDestroy`` (pytorch/pytorch#115388),
        and a replica's exit must not wait on it."""
        end = getattr(self._pg, "abort" if self._backend == "nccl" else "shutdown", None)
        if end is not None:
            try:
                end()
            except RuntimeError:  # pragma: no cover - a peer already gone
                pass


@dataclass
class Collectives:
    """One rank's collectives: ``device`` moves the model's tensors (all-reduce, gather), ``host``
    the step's input arrays (broadcast); both the same group on a CPU."""

    device: Group
    host: Group

    @property
    def rank(self) -> int:
        return self.device.rank

    @property
    def size(self) -> int:
        return self.device.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.device.all_reduce(x)

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        return self.device.gather(x)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        return self.host.broadcast(x)

    def abort(self) -> None:
        for group in {id(self.device): self.device, id(self.host): self.host}.values():
            group.abort()

    def close(self) -> None:
        for group in {id(self.device): self.device, id(self.host): self.host}.values():
            group.close()
