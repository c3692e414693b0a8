"""The worker processes of a tensor-parallel engine: ``python -m cadenza.node.engine.tp_workers``.

With ``tensor_parallel_size N > 1`` the engine core is rank 0 and starts ranks ``1 .. N-1`` here,
one process per device (vLLM's multiprocessing executor, for the same reason as the core's own
process: each rank's Python owns its interpreter). Rank 0 writes what a worker needs — the engine
configuration, the RoPE length, the weights' seed, its threads — into a private folder (mode 0700,
under ``/dev/shm`` where it exists) together with the shared-memory file of the collectives
(:mod:`cadenza.node.runner.collectives`); gloo and NCCL meet through a ``FileStore`` in the same
folder. No TCP port is opened for the rendezvous; gloo's and NCCL's own connections stay on the
node (loopback, NVLink, PCIe). Each worker then loads its shard and runs
:meth:`~cadenza.node.runner.model_runner.ModelRunner.serve_worker` until rank 0 says stop.

Failure: a worker's death is the replica's death. :class:`Workers` watches its processes; when one
exits before it was told to stop, the collectives are aborted (so the step in flight fails at
once) and :attr:`Workers.failure` says which, which the engine raises on its next step or idle
poll (:meth:`cadenza.node.engine.engine_core.EngineCore.poll`): the core process reports itself
dead and exits, the server answers ``/health`` 503 and exits. A worker dies with its parent
(a thread of it watches rank 0's process; ``PR_SET_PDEATHSIG`` too when rank 0 starts it from its
main thread: the signal follows the thread that forked, not the process, so a worker started from
a thread that then ends would be killed with a live rank 0), so no rank outlives the replica.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

from cadenza.node.core.config import EngineConfig

logger = logging.getLogger("cadenza.tp")

COLLECTIVES_ENV = "CADENZA_TP_COLLECTIVES"  # shm (default on the CPU) | gloo; NCCL on CUDA whatever it says
STOP_GRACE_S = 10.0
PARENT_CHECK_S = 0.25  # how often a worker checks that rank 0's process still lives
_ARENA, _START, _STORE = "collectives", "start.json", "store"
_PR_SET_PDEATHSIG = 1


def backends(device: str) -> tuple[str, str]:
    """``(device collectives, host collectives)`` for a replica on ``device``: ``nccl`` and ``shm``
    on CUDA; on the CPU ``shm`` for both, or ``gloo`` for both under ``CADENZA_TP_COLLECTIVES=gloo``.

    Raises:
        ValueError: an unknown ``CADENZA_TP_COLLECTIVES``.
    """
    choice = os.environ.get(COLLECTIVES_ENV, "shm")
    if choice not in ("shm", "gloo"):
        raise ValueError(f"{COLLECTIVES_ENV} must be shm or gloo, got {choice!r}")
    if device.startswith("cuda"):
        return "nccl", "shm"
    return choice, choice


def connect(folder: Path, rank: int, size: int, device: str, timeout_s: float = 120.0):
    """This rank's :class:`~cadenza.node.runner.collectives.Collectives` over ``folder``'s shared
    file and store (rank 0 creates the shared file first: :class:`Workers`)."""
    from datetime import timedelta

    import torch.distributed as dist

    from cadenza.node.runner.collectives import Collectives, ShmGroup, TorchGroup

    device_kind, host_kind = backends(device)
    shm = ShmGroup(folder / _ARENA, rank, size) if "shm" in (device_kind, host_kind) else None
    torch_group = None
    if device_kind != "shm":
        store = dist.FileStore(str(folder / _STORE), size)
        store.set_timeout(timedelta(seconds=timeout_s))
        if device_kind == "nccl":
            import torch

            torch.cuda.set_device(rank_device_index(device, rank))
        torch_group = TorchGroup(device_kind, store, rank, size, timeout_s=600.0)
    dev = torch_group if torch_group is not None else shm
    host = shm if host_kind == "shm" else torch_group
    return Collectives(dev, host)


def rank_device_index(device: str, rank: int) -> int:
    """The CUDA device index of ``rank`` for ``cuda`` / ``cuda:K``."""
    _, _, index = device.partition(":")
    return (int(index) if index else 0) + rank


class Workers:
    """Ranks ``1 .. N-1`` of a tensor-parallel engine, started and watched from rank 0.

    Args:
        config: the engine configuration (``tensor_parallel_size`` ranks).
        max_model_len: rows of the RoPE table every rank builds.
        weights_seed: draw each rank's weights from this seed (benchmarks) instead of loading them.
        threads: torch intra-op threads of each worker.

    After construction :attr:`collectives` is rank 0's; the workers load their shards while rank 0
    loads its own. Raises ``OSError`` when the folder or a process cannot be created.
    """

    def __init__(self, config: EngineConfig, max_model_len: int, weights_seed: int | None, threads: int) -> None:
        from cadenza.node.runner.collectives import create_arena

        self.size = config.tensor_parallel_size
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        _sweep(Path(base or tempfile.gettempdir()))
        self.folder = Path(tempfile.mkdtemp(prefix=f"cadenza-tp-{os.getpid()}-", dir=base))  # mode 0700
        self.failure: str | None = None
        self._stopping = False
        self._procs: dict[int, subprocess.Popen] = {}
        try:
            create_arena(self.folder / _ARENA, self.size)
            (self.folder / _START).write_text(json.dumps({
                "config": config.to_dict(), "max_model_len": max_model_len, "weights_seed": weights_seed,
                "threads": threads, "collectives": os.environ.get(COLLECTIVES_ENV, "shm")}))
            for rank in range(1, self.size):
                self._procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", "cadenza.node.engine.tp_workers", "--folder", str(self.folder),
                     "--rank", str(rank), "--parent", str(os.getpid()),
                     "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())],
                    stdin=subprocess.DEVNULL,
                    # the death signal follows the forking thread: only the main thread lives as long as rank 0
                    preexec_fn=_die_with_parent if threading.current_thread() is threading.main_thread() else None)
            self.collectives = connect(self.folder, 0, self.size, config.device)
        except BaseException:
            self.kill()
            raise
        # An engine dropped without close() (a script, a test) takes its workers with it.
        self._reaper = weakref.finalize(self, _reap, list(self._procs.values()), self.folder)
        host = self.collectives.host
        if hasattr(host, "watch"):
            for rank, proc in self._procs.items():
                host.watch(rank, proc.pid)  # a wait on a worker that died before mapping the file fails
        self._watcher = threading.Thread(target=self._watch, name="cadenza-tp-watch", daemon=True)
        self._watcher.start()

    def started(self) -> None:
        """Every rank has connected and loaded: the folder (start file, shared file, store) is no
        longer needed, and goes now rather than with a clean exit only (the mappings stay)."""
        shutil.rmtree(self.folder, ignore_errors=True)

    @property
    def pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self._procs.items()}

    def _watch(self) -> None:
        """Wait for any worker to exit; one that exits unasked fails the replica."""
        while not self._stopping:
            for rank, proc in self._procs.items():
                code = proc.poll()
                if code is not None and not self._stopping:
                    how = f"signal {-code}" if code < 0 else f"exit code {code}"
                    self.failure = f"tensor-parallel worker rank {rank} (pid {proc.pid}) died ({how})"
                    logger.error("%s: the replica cannot step again", self.failure)
                    self.collectives.abort()
                    return
            time.sleep(0.05)

    def close(self, stop: Callable[[], None] | None = None) -> None:
        """Stop the workers: run ``stop`` (rank 0's broadcast of the end) unless a worker died, wait
        for them to exit, kill the ones that have not within :data:`STOP_GRACE_S` (a stopped or hung
        worker never takes the end: the wait is then aborted), and remove the folder."""
        from cadenza.node.runner.collectives import TensorParallelError

        self._stopping = True
        deadline = time.monotonic() + STOP_GRACE_S
        if stop is not None and self.failure is None:
            said = threading.Event()

            def say_stop() -> None:
                try:
                    stop()
                except TensorParallelError:
                    pass
                finally:
                    said.set()

            threading.Thread(target=say_stop, name="cadenza-tp-stop", daemon=True).start()
            if not said.wait(STOP_GRACE_S):
                logger.warning("a tensor-parallel worker did not take the end within %.0f s: killing it", STOP_GRACE_S)
                self.collectives.abort()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        collectives = getattr(self, "collectives", None)
        if collectives is not None:
            collectives.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        if (reaper := getattr(self, "_reaper", None)) is not None:
            reaper.detach()

    def kill(self) -> None:
        """Stop the workers now (rank 0 failed: nothing will broadcast the end)."""
        self._stopping = True
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
        self.close()


def _sweep(base: Path) -> None:
    """Remove the folders of engines whose process is gone (one killed while its ranks started,
    before they had all connected: :meth:`Workers.started` removes the folder after that)."""
    for folder in base.glob("cadenza-tp-*-*"):
        try:
            os.kill(int(folder.name.split("-")[2]), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (ValueError, PermissionError, OSError):
            pass  # not one of ours, or another user's live engine


def _reap(procs: list[subprocess.Popen], folder: Path) -> None:
    """Kill what is left of a :class:`Workers` that was never closed."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def watch_parent(parent: int, period_s: float = PARENT_CHECK_S) -> None:
    """Exit this process once ``parent`` (rank 0) is gone: the worker is then re-parented. Runs in a
    daemon thread of every worker; ``os._exit`` ends the process whatever its main thread waits on."""
    while os.getppid() == parent:
        time.sleep(period_s)
    logger.error("rank 0 (pid %d) is gone; exiting", parent)
    os._exit(1)


def serve(folder: Path, rank: int) -> int:
    """Run rank ``rank`` of the replica whose start file is in ``folder``; the exit code."""
    from cadenza.node.runner.collectives import TensorParallelError
    from cadenza.node.runner.model_runner import ModelRunner
    from cadenza.node.runner.models.config import ModelConfig
    from cadenza.node.runner.threads import ThreadChoice, apply_threads

    start = json.loads((folder / _START).read_text())
    os.environ[COLLECTIVES_ENV] = start["collectives"]
    config = EngineConfig.from_dict(start["config"])
    apply_threads(ThreadChoice(start["threads"], f"tensor-parallel rank {rank}"))
    collectives = connect(folder, rank, config.tensor_parallel_size, config.device)
    try:
        runner = ModelRunner(config, ModelConfig.from_pretrained(config.model), start["max_model_len"],
                             start["weights_seed"], collectives)
        runner.serve_worker()
    except TensorParallelError as exc:
        logger.error("tensor-parallel rank %d: %s; exiting", rank, exc)
        return 1
    finally:
        collectives.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cadenza.node.engine.tp_workers")
    parser.add_argument("--folder", type=Path, required=True, help="rank 0's private folder")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True, help="rank 0's pid: this worker exits with it")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the workers stop
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.getppid() != args.parent:  # rank 0 died before this process asked to die with it
        return 1
    threading.Thread(target=watch_parent, args=(args.parent,), name="cadenza-tp-parent", daemon=True).start()
    if not os.environ.get("TRITON_INTERPRET"):
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    return serve(args.folder, args.rank)


if __name__ == "__main__":
    sys.exit(main())
