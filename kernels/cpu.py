"""cadenza's compiled CPU kernels (``csrc/cpu_ops.cpp``): a decode step's ops without Python per op.

A decode step on a CPU is bound by reading the weights once; in eager PyTorch its ~70 small ops
per layer and a matrix-vector product that falls short of memory bandwidth cost more than that
read. This module builds ``cpu_ops.cpp`` once per machine with ``torch.utils.cpp_extension``
(``-O3 -march=native``; into ``$CADENZA_CACHE_DIR`` or ``$XDG_CACHE_HOME/cadenza``, else
``~/.cache/cadenza``, under ``torch_extensions``) and exposes the ops with the shapes of
:mod:`cadenza.kernels.reference`:

- :func:`linear_rows`: ``x [M, K] @ weight [N, K]^T (+ bias)`` for a few rows, each weight row
  streamed once for all of them (llama.cpp's approach to matrix-vector products);
- :func:`rms_norm` (residual add fused), :func:`rotary_embedding` (in place),
  :func:`silu_and_mul`;
- :func:`paged_attention`: the cache write fused with attention of the rows of at most
  ``SHORT_ROW`` query tokens (decodes, short chunks); longer rows go to the reference's SDPA path,
  which is faster for them;
- :func:`decode_layer`: a whole decoder layer from those kernels in one call, for decode steps
  (no Python frame, module call or view per op).

fp32 only. :func:`available` says whether the build succeeded (it needs a C++ compiler and
``ninja``); callers fall back to the references when it did not, and the reason is in
:func:`build_error`. The first build on a machine takes about a minute on two cores (a later
start loads the cached module in a moment): a log line says when it starts (or, when the cache
folder looked current, once loading has run for :data:`NOTICE_AFTER_S` seconds), another every
:data:`NOTICE_EVERY_S` seconds while it runs, and one how it ended. A build
interrupted by the user (Ctrl-C reaches ``ninja`` too) is not a failure to fall back from: it
raises :class:`BuildInterrupted`, a :class:`KeyboardInterrupt`, and nothing is remembered, so the
next start builds again. This module imports nothing of cadenza outside kernels (it logs
through the standard :mod:`logging` module).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import signal
import subprocess
import threading
import time
from pathlib import Path

import torch

from cadenza.kernels import reference

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.cpp"
SHORT_ROW = 16  # rows of at most this many query tokens are attended by the compiled kernel
NOTICE_AFTER_S = 5.0  # loading a built module takes about a second: one still running after this is a build
NOTICE_EVERY_S = 20.0  # while the kernels build, say it is still running this often
INTERRUPTED_EXIT_CODES = (130, -signal.SIGINT)  # ninja >= 1.12 on SIGINT; a build killed by SIGINT
_lock = threading.Lock()
_ops = None
_error: str | None = None


def _cpu_fingerprint() -> str:
    """A short hash of this CPU's feature flags: code built with ``-march=native`` on one machine
    must not be loaded on another (a shared home folder) whose CPU lacks an instruction."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def _build_dir() -> Path:
    """The folder the module is built in: one per torch version, CPU and source text, so that every
    checkout on a machine (a second clone, each CI run's fresh one) shares one build, and a changed
    source gets a folder of its own. The source is built from its copy there (:func:`_source_copy`):
    torch's build file names the source's path, and ninja rebuilds for a command that changed."""
    base = os.environ.get("CADENZA_CACHE_DIR")
    root = Path(base) if base else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cadenza"
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    path = root / "torch_extensions" / f"torch{torch.__version__.replace('+', '_')}-{_cpu_fingerprint()}-{digest}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _source_copy(build_dir: Path) -> Path:
    """The source's copy in ``build_dir``, written once (atomically: starts at once never see half
    of it); never rewritten, so its time stamp never makes ninja rebuild a current module."""
    copy = build_dir / SOURCE.name
    if not copy.exists():
        staging = build_dir / f".{SOURCE.name}.{os.getpid()}"
        staging.write_bytes(SOURCE.read_bytes())
        os.replace(staging, copy)
    return copy


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold ``build_dir`` for one loader at a time, across processes.

    torch's own build lock is a ``lock`` file (its ``FileBaton``). A process killed in the middle
    of a build (SIGKILL, or SIGTERM from a supervisor) leaves that file behind, and every later
    start then waits for it forever, saying "still building". This lock is an ``flock``, which the
    kernel drops when its holder dies. A ``lock`` file found while holding it is therefore stale,
    and it is removed before torch looks.
    """
    with open(build_dir / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _put_ninja_on_path() -> None:
    """torch's extension builder runs ``ninja`` from PATH; the ``ninja`` wheel (a dependency) puts
    it in the environment's folder, which is not on PATH when ``.venv/bin/cadenza`` runs directly."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


class BuildInterrupted(KeyboardInterrupt):
    """The build of the compiled kernels was interrupted by the user (SIGINT, Ctrl-C): not a
    failure to fall back from. Nothing is cached; the next start builds again."""


def _interrupted(exc: BaseException) -> bool:
    """Whether a failed build was stopped by SIGINT: torch raises its RuntimeError from ninja's
    ``CalledProcessError``, whose exit code (or, for older ninja, output) says so."""
    cause = exc.__cause__
    if isinstance(cause, subprocess.CalledProcessError) and cause.returncode in INTERRUPTED_EXIT_CODES:
        return True
    return "interrupted by user" in str(exc)


def _needs_build(build_dir: Path) -> bool:
    """Whether ``build_dir`` lacks the module (the folder is per torch version, CPU and source)."""
    return not (build_dir / "cadenza_cpu_ops.so").exists()


class _BuildNotice:
    """While a build runs: a log line at its start, one every :data:`NOTICE_EVERY_S` seconds, and
    how long it took at its end.

    Args:
        build_dir: where it builds.
        expected: no module built from the current source is there: say so at once. Otherwise
            (it will most likely just load) say so only if loading still runs after
            :data:`NOTICE_AFTER_S` seconds: ninja rebuilds for reasons a look at the folder misses
            (other compiler flags, a compiler upgraded since).
    """

    def __init__(self, build_dir: Path, expected: bool) -> None:
        self._dir, self._started = build_dir, time.monotonic()
        self._stop = threading.Event()
        self._said = False
        if expected:
            self._say()
        self._thread = threading.Thread(target=self._run, name="cadenza-cpu-kernels-notice", daemon=True)
        self._thread.start()

    def _say(self) -> None:
        self._said = True
        logger.info("building the compiled CPU kernels (%s) into %s, once for this machine: about a minute on two "
                    "cores; later starts load them at once", SOURCE.name, self._dir)

    def _run(self) -> None:
        if not self._said:
            if self._stop.wait(NOTICE_AFTER_S):
                return
            self._say()
        while not self._stop.wait(NOTICE_EVERY_S):
            logger.info("still building the compiled CPU kernels (%.0f s so far)", time.monotonic() - self._started)

    def stop(self, outcome: str) -> None:
        self._stop.set()
        self._thread.join()
        if self._said:
            logger.info("compiled CPU kernels: %s in %.0f s", outcome, time.monotonic() - self._started)


def _load():
    global _ops, _error
    with _lock:
        if _ops is not None or _error is not None:
            return _ops
        notice, outcome = None, "failed"
        try:  # everything here may fail (a read-only cache folder too): the references stay
            build_dir = _build_dir()
            notice = _BuildNotice(build_dir, expected=_needs_build(build_dir))
            from torch.utils.cpp_extension import load

            _put_ninja_on_path()
            with _build_lock(build_dir):
                _ops = load(
                    name="cadenza_cpu_ops",
                    sources=[str(_source_copy(build_dir))],
                    extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir),
                    verbose=False,
                )
            outcome = "built"
        except KeyboardInterrupt:
            outcome = "build interrupted"
            raise BuildInterrupted("the build of the compiled CPU kernels was interrupted") from None
        except Exception as exc:  # no compiler, no ninja, a read-only cache: keep the references
            if _interrupted(exc):
                outcome = "build interrupted"
                raise BuildInterrupted("the build of the compiled CPU kernels was interrupted") from None
            _error = _reason(exc)
            logger.warning("compiled CPU kernels unavailable (%s); using the torch references", _error)
        finally:
            if notice is not None:
                notice.stop(outcome)
        return _ops


def _reason(exc: Exception) -> str:
    """The useful line of a failed build: the compiler's or ninja's first error, not its last words."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or line.startswith("FAILED")]
    return f"{type(exc).__name__}: {' | '.join((errors or lines[-1:])[:2])[:400]}"


def available() -> bool:
    """Build (once per process; the compiled module is cached per machine) and report success.

    Raises:
        BuildInterrupted: the user interrupted the build (SIGINT).
    """
    return _load() is not None


def build_error() -> str | None:
    """Why :func:`available` is false, or ``None``."""
    _load()
    return _error


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T + bias [N]`` -> ``[M, N]``, fp32; meant for small ``M``.

    Raises:
        RuntimeError: not fp32 on the CPU, or the shapes disagree.
    """
    return _ops.linear_rows(x, weight, bias)


def rms_norm(x, weight, eps, residual=None):
    """As :func:`cadenza.kernels.reference.rms_norm` (``x [T, H]`` fp32)."""
    out = _ops.rms_norm(x, weight, float(eps), residual)
    return out[0] if residual is None else (out[0], out[1])


def rotary_embedding(positions, q, k, cos_sin_cache):
    """As :func:`cadenza.kernels.reference.rotary_embedding`, in place on ``q`` and ``k``."""
    _ops.rotary_embedding(positions, q, k, cos_sin_cache)
    return q, k


def silu_and_mul(x):
    """As :func:`cadenza.kernels.reference.silu_and_mul` (``x [T, 2I]`` fp32)."""
    return _ops.silu_and_mul(x)


def decode_layer(input_norm, w_qkv, b_qkv, w_o, post_norm, w_gate_up, b_gate_up, w_down, b_down, eps: float,
                 scale: float, num_heads: int, num_kv_heads: int, head_dim: int):
    """A Llama decoder layer bound to its fp32 weights (``w_*`` are ``[out, in]``, ``b_*`` optional),
    run in one call by its ``forward(x, residual, positions, cos_sin, k_cache, v_cache, slot_mapping,
    query_start_loc, seq_lens, block_tables) -> (x, residual)`` for a step whose rows all have at most
    :data:`SHORT_ROW` query tokens (``residual`` ``None`` before the first layer): RMSNorm, the fused
    q/k/v projection, RoPE, the cache write and attention, the output projection, RMSNorm with the
    residual add, SwiGLU and the down projection, as :mod:`cadenza.node.runner.models.llama`.

    Raises:
        RuntimeError: weights not fp32 and contiguous, or shapes that disagree with the head counts;
            at ``forward``, a longer row.
    """
    return _ops.DecodeLayer(input_norm, w_qkv, b_qkv, w_o, post_norm, w_gate_up, b_gate_up, w_down, b_down,
                            float(eps), float(scale), num_heads, num_kv_heads, head_dim, SHORT_ROW)


def paged_attention(q, k, v, k_cache, v_cache, slot_mapping, query_start_loc, seq_lens, block_tables, scale):
    """Write ``k, v`` at ``slot_mapping`` and attend every row, as
    :func:`cadenza.kernels.reference.write_kv_cache` then :func:`~cadenza.kernels.reference.paged_attention`.

    Rows of at most :data:`SHORT_ROW` query tokens run in the compiled kernel; the others in the
    reference's per-row SDPA. ``slot_mapping`` is int64; ``query_start_loc``, ``seq_lens`` and
    ``block_tables`` int32 (the runner's dtypes; no conversion per layer).

    Returns:
        ``[T, Hq, D]``.
    """
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    skipped = _ops.paged_attention_short(q, k, v, k_cache, v_cache, slot_mapping, query_start_loc, seq_lens,
                                         block_tables, float(scale), out, SHORT_ROW)
    if skipped:
        reference.attend_long_rows(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, out,
                                   min_query_len=SHORT_ROW + 1)
    return out
