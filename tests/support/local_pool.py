"""A tiny ServingPool file and the environment for a ``cadenza up`` child, shared by local-mode tests."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import yaml


def pool_yaml(path: Path, model_dir: Path, **spec) -> Path:
    body = {
        "apiVersion": "serving.cadenza.dev/v1alpha1", "kind": "ServingPool",
        "metadata": {"name": "tiny", "namespace": "default"},
        "spec": {"model": {"name": "tiny", "source": {"path": str(model_dir)}}, "replicas": 2,
                 "engine": {"tokenBudget": 64, "chunkSize": 16, "maxModelLen": 256}, **spec},
    }
    path.write_text(yaml.safe_dump(body))
    return path


def up_env(tmp_path: Path) -> dict[str, str]:
    """The environment for a ``cadenza up`` child: its run folder (logs) lands in the test's tmp_path,
    and its replicas and gateway take one torch thread each (tests run side by side)."""
    return {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}


def stop_up(up: subprocess.Popen, log, log_path: Path) -> None:
    """Ctrl-C a ``cadenza up`` child and check it exits 0 within a minute (killed otherwise)."""
    up.send_signal(signal.SIGINT)
    try:
        assert up.wait(timeout=60) == 0, log_path.read_text()
    finally:
        if up.poll() is None:
            up.kill()
        log.close()
