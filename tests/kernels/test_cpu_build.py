"""Building the compiled CPU kernels: what the user is told while it runs, and a Ctrl-C during it.

The build itself takes about a minute, so the fast tests here replace torch's extension loader;
the slow one interrupts a real first build inside ``cadenza serve``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from pathlib import Path

import pytest
import torch.utils.cpp_extension

from cadenza.kernels import cpu
from waiting import wait_until


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The module as in a new process, building into an empty cache folder."""
    monkeypatch.setattr(cpu, "_ops", None)
    monkeypatch.setattr(cpu, "_error", None)
    monkeypatch.setenv("CADENZA_CACHE_DIR", str(tmp_path))

    def use_loader(loader):
        monkeypatch.setattr(torch.utils.cpp_extension, "load", loader)

    return use_loader


def ninja_failure(returncode: int, output: bytes) -> RuntimeError:
    """What torch raises when ninja fails: a RuntimeError from the CalledProcessError."""
    try:
        raise subprocess.CalledProcessError(returncode, ["ninja", "-v"], output)
    except subprocess.CalledProcessError as exc:
        try:
            raise RuntimeError(f"Error building extension 'cadenza_cpu_ops': {output.decode()}") from exc
        except RuntimeError as error:
            return error


def test_a_first_build_says_so_while_it_runs_and_how_long_it_took(fresh, monkeypatch, caplog):
    monkeypatch.setattr(cpu, "NOTICE_EVERY_S", 0.05)

    def slow_build(**_):
        time.sleep(0.3)
        return "the module"

    fresh(slow_build)
    with caplog.at_level(logging.INFO, logger="cadenza.kernels.cpu"):
        assert cpu.available()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("building the compiled CPU kernels") and "about a minute" in lines[0]
    assert any(line.startswith("still building") for line in lines[1:-1])
    assert lines[-1].startswith("compiled CPU kernels: built in")


def test_loading_kernels_already_built_says_nothing(fresh, caplog):
    build_dir = cpu._build_dir()
    (build_dir / "cadenza_cpu_ops.so").touch()  # newer than the source
    fresh(lambda **_: "the module")
    with caplog.at_level(logging.INFO, logger="cadenza.kernels.cpu"):
        assert cpu.available()
    assert caplog.records == []


@pytest.mark.parametrize("returncode, output", [(130, b"ninja: build stopped: interrupted by user.\n"),
                                                (2, b"ninja: build stopped: interrupted by user.\n"),  # ninja < 1.12
                                                (-signal.SIGINT, b"")])
def test_an_interrupted_build_is_an_interrupt_not_a_fallback_to_the_references(fresh, caplog, returncode, output):
    def interrupted(**_):
        raise ninja_failure(returncode, output)

    fresh(interrupted)
    with caplog.at_level(logging.INFO, logger="cadenza.kernels.cpu"), pytest.raises(KeyboardInterrupt):
        cpu.available()
    assert "build interrupted" in caplog.records[-1].getMessage()
    assert not any("torch references" in r.getMessage() for r in caplog.records)
    fresh(lambda **_: "the module")  # nothing was remembered: the next try builds
    assert cpu.available() and cpu.build_error() is None


def test_a_lock_left_by_a_build_that_was_killed_does_not_wedge_later_starts(fresh):
    # torch's lock file outlives a builder killed mid-build; its next start used to wait forever
    seen = []

    def loader(**kwargs):
        seen.append((Path(kwargs["build_directory"]) / "lock").exists())
        return "ops"

    fresh(loader)
    stale = cpu._build_dir() / "lock"
    stale.touch()
    assert cpu._load() == "ops" and seen == [False]


def test_a_failed_build_still_falls_back_to_the_references(fresh, caplog):
    def broken(**_):
        raise ninja_failure(1, b"FAILED: cpu_ops.o\nerror: no such instruction\n")

    fresh(broken)
    with caplog.at_level(logging.INFO, logger="cadenza.kernels.cpu"):
        assert not cpu.available()
    assert "no such instruction" in cpu.build_error()
    assert any("using the torch references" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_ctrl_c_during_the_first_build_stops_serve_cleanly_and_says_why(tmp_path, tiny_llama_dir):
    from server_process import free_port

    log_path = tmp_path / "serve.log"
    env = {**os.environ, "CADENZA_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:  # its own process group, as a terminal's foreground job
        serve = subprocess.Popen([sys.executable, "-m", "cadenza.node.cli", "serve", "--model", str(tiny_llama_dir),
                                  "--port", str(free_port())], stdout=log, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
    try:
        wait_until(lambda: "building the compiled CPU kernels" in log_path.read_text(), 120,
                   "the build to start and say so")
        os.killpg(serve.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group, ninja included
        assert serve.wait(timeout=60) == 0
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
    text = log_path.read_text()
    assert "build interrupted" in text and "loading interrupted" in text, text
    assert "torch references" not in text and "model loaded" not in text and "Traceback" not in text


def test_a_rebuild_the_cache_folder_did_not_predict_is_still_told(fresh, monkeypatch, caplog):
    """A module already in the folder looks current, but ninja rebuilds it when its command changed
    (other flags, another compiler): once loading runs long, the log says it is a build."""
    monkeypatch.setattr(cpu, "NOTICE_AFTER_S", 0.05)
    (cpu._build_dir() / "cadenza_cpu_ops.so").touch()

    def rebuild(**_):
        time.sleep(0.3)
        return "the module"

    fresh(rebuild)
    with caplog.at_level(logging.INFO, logger="cadenza.kernels.cpu"):
        assert cpu.available()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("building the compiled CPU kernels") and lines[-1].startswith("compiled CPU kernels: built")


def test_checkouts_at_other_paths_share_one_build_and_a_changed_source_gets_its_own(fresh, monkeypatch, tmp_path):
    """Each checkout (a second clone, each CI run's fresh one) built the same source at its own
    path, so ninja, whose command names the path, rebuilt it for every checkout in turn."""
    built = []

    def loader(**kwargs):
        built.append((kwargs["build_directory"], kwargs["sources"]))
        return "the module"

    for checkout, text in (("one", "// the kernels"), ("two", "// the kernels"), ("three", "// changed")):
        source = tmp_path / checkout / "csrc" / "cpu_ops.cpp"
        source.parent.mkdir(parents=True)
        source.write_text(text)
        monkeypatch.setattr(cpu, "SOURCE", source)
        monkeypatch.setattr(cpu, "_ops", None)  # a new process
        fresh(loader)
        assert cpu.available()
    (dir_one, sources_one), (dir_two, sources_two), (dir_three, sources_three) = built
    assert (dir_one, sources_one) == (dir_two, sources_two)  # the same build command: nothing to rebuild
    assert not sources_one[0].startswith(str(tmp_path / "one"))
    assert dir_three != dir_one and open(sources_three[0]).read() == "// changed"


def test_a_cache_folder_that_cannot_be_written_keeps_the_references(fresh, monkeypatch, tmp_path, caplog):
    """The build folder is made before the build: a read-only cache raised out of available()."""
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("CADENZA_CACHE_DIR", str(blocked))
    fresh(lambda **_: "the module")
    with caplog.at_level(logging.INFO, logger="cadenza.kernels.cpu"):
        assert not cpu.available()
    assert cpu.build_error() and any("torch references" in r.getMessage() for r in caplog.records)
