"""Run ``cadenza serve`` as a real subprocess, the way users start it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def cadenza_server(args: list[str], log: Path, ready_timeout: float = 180.0,
                   env: dict[str, str] | None = None) -> Iterator[str]:
    """Start ``cadenza serve ARGS`` on a free port; yield its base URL (``.../v1``) once ready.

    The server takes one torch thread (``OMP_NUM_THREADS=1``) unless ``--threads`` or ``env``
    says otherwise: tests run side by side, one per core. ``env`` adds to (or, with "" values,
    clears from) this process's environment."""
    with cadenza_server_process(args, log, ready_timeout, env) as (url, _proc):
        yield url


def http_status(url: str) -> int:
    """The status ``GET url`` answers (an error status too), or 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError):
        return 0


def post_json(url: str, body: dict, timeout: float = 60):
    """``POST url`` with a JSON body; the open response (raises ``HTTPError`` on an error status)."""
    return urllib.request.urlopen(urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}), timeout=timeout)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie is dead, only not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux ``/proc``): a server's engine core process."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


@contextlib.contextmanager
def cadenza_server_process(args: list[str], log: Path, ready_timeout: float = 180.0,
                           env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """:func:`cadenza_server`, yielding the server's process too: ``(url, process)``."""
    port = free_port()
    cmd = [sys.executable, "-m", "cadenza.node.cli", "serve", "--port", str(port), *args]
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    environ = {k: v for k, v in environ.items() if v != "" or k not in (env or {})}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environ)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"cadenza serve exited with {proc.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"cadenza serve not ready after {ready_timeout}s:\n{log.read_text()}")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1", proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
