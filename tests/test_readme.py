"""The README's commands, as a newcomer runs them after ``make serve``: each one parses with the real
``cadenza`` command line, what they need is what ``make serve`` installs, and what they write lands
in git-ignored folders (a first run leaves ``git status`` clean)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from cadenza.node.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
OUTPUT_OPTIONS = ("--json", "--plot", "--out", "--step-log", "--state-file")


def cadenza_argvs() -> list[list[str]]:
    """The README's ``.venv/bin/cadenza ...`` commands (in ``sh`` code blocks, continuation lines
    joined, comments and a trailing ``&`` dropped) as argument lists, without the program."""
    argvs = []
    for block in re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith(".venv/bin/cadenza "):
                words = [w for w in shlex.split(line, comments=True) if w != "&"]
                argvs.append(words[1:])
    return argvs


def test_the_readme_has_the_commands_these_tests_check():
    commands = {argv[0] for argv in cadenza_argvs()}
    assert {"bench", "up", "sim", "serve"} <= commands


@pytest.mark.parametrize("argv", cadenza_argvs(), ids=lambda argv: " ".join(argv[:2]))
def test_every_readme_cadenza_command_parses(argv):
    args = build_parser().parse_args(argv)  # an unknown or misspelled option exits 2 here
    assert args.func is not None


def make_serve_extras() -> set[str]:
    """The extras of cadenza that ``make serve`` installs into a new venv (from ``make -n``)."""
    dry = subprocess.run(["make", "-n", "-B", "install", "VENV=/nonexistent/venv"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    (extras,) = re.findall(r"pip install .*-e '\.\[([^\]]*)\]'", dry)
    return set(extras.split(","))


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_serve_installs_what_the_readme_commands_need():
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = {re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
                 for extra in make_serve_extras() for req in optional[extra]}
    plotting = [argv for argv in cadenza_argvs() if "--plot" in argv]
    assert plotting, "the README draws figures with --plot"
    assert "matplotlib" in installed, f"the README runs {' / '.join(a[0] for a in plotting)} --plot"


def readme_outputs() -> list[str]:
    """Every path the README's cadenza commands write to."""
    outputs = []
    for argv in cadenza_argvs():
        outputs += [argv[i + 1] for i, word in enumerate(argv[:-1]) if word in OUTPUT_OPTIONS]
    return outputs


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a checkout")
def test_what_the_readme_commands_write_is_git_ignored():
    outputs = readme_outputs()
    assert len(outputs) >= 5
    for path in outputs:
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", f"{path}/x" if "." not in
                                  Path(path).name else path], cwd=ROOT, check=False).returncode == 0
        assert ignored or path.startswith("/tmp/"), f"the README writes {path}, which git would list as untracked"


@pytest.mark.slow
def test_the_readme_simulation_shows_the_controller_acting(tmp_path):
    """The README's `cadenza sim` example, its `auto` policy alone: the run lasts long enough, with
    enough long prompts sent as batch, for the controller to act on what it sees."""
    import json

    from cadenza.node.cli import main

    (argv,) = [a for a in cadenza_argvs() if a[0] == "sim" and "--pool" in a]
    argv = argv[:argv.index("--compare")]  # the same pool, trace, load and classes
    out = tmp_path / "report.json"
    assert main([*argv, "--compare", "auto", "--json", str(out), "--no-progress"]) == 0
    run = json.loads(out.read_text())["policies"]["auto"]
    assert run["simulated_s"] > 150
    assert set(run["by_class"]) == {"interactive", "batch"}
    retunes = [a for a in run["actions"] if a["acted"] and a["action"] == "retune"]
    assert len(retunes) >= 2
    attainment = [share for _t, share in run["attainment_over_time"]["interactive"] if share is not None]
    assert min(attainment) < 0.9 and max(attainment) == 1.0  # something to act on, and its effect
