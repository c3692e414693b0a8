"""One process ``cadenza up`` supervises (a replica or the gateway), and the free port it listens on.

A process runs in its own session (a Ctrl-C in the terminal reaches the supervisor only, which
stops the children in order), logs to its file, and on Linux dies with the supervisor, even one
killed by SIGKILL (``PR_SET_PDEATHSIG``). Restarted, it keeps its port.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick; a replica binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to send SIGTERM to this child when the supervisor dies, even by SIGKILL."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Process:
    """One supervised process (a replica or the gateway), restarted on the same port."""

    name: str
    cmd: list[str]
    port: int
    log: Path
    host: str = "127.0.0.1"
    role: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # over this process's environment; "" unsets
    proc: subprocess.Popen | None = None
    restarts: int = 0
    restart_at: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def start(self) -> None:
        # Its own session: a Ctrl-C in the terminal reaches the supervisor only, which stops the
        # children in order (gateway first) instead of all at once. An empty value in `env` unsets.
        env = {k: v for k, v in {**os.environ, **self.env}.items() if self.env.get(k) != ""}
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=env, preexec_fn=_die_with_parent)
        self.started = time.monotonic()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"http://{host}:{self.port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
