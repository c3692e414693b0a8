"""The distribution: one wheel with every subpackage, mapped folders without __init__.py, layering."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {folder: f"cadenza/{folder}" for folder in
          ("node", "kernels", "gateway", "loadgen", "pool", "control", "operator", "local", "sim")}


def source_packages() -> set[str]:
    """Every folder under the mapped roots that holds Python, as its path inside the wheel."""
    found = set()
    for folder, target in MAPPED.items():
        for py in (ROOT / folder).rglob("*.py"):
            found.add(str(Path(target) / py.parent.relative_to(ROOT / folder)).rstrip("/."))
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True, capture_output=True,
    )
    (path,) = out.glob("cadenza-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_contains_every_subpackage_and_module(wheel):
    names = set(wheel.namelist())
    packages = {str(Path(n).parent) for n in names if n.endswith(".py")}
    assert source_packages() <= packages
    for folder, target in MAPPED.items():
        for py in (ROOT / folder).rglob("*.py"):
            assert f"{target}/{py.relative_to(ROOT / folder)}" in names


def test_wheel_carries_the_cpu_kernels_source_it_builds_at_first_use(wheel):
    names = set(wheel.namelist())
    for cpp in (ROOT / "kernels" / "csrc").glob("*.cpp"):
        assert f"cadenza/kernels/csrc/{cpp.name}" in names


def test_wheel_carries_the_simulators_model_configs(wheel):
    names = set(wheel.namelist())
    configs = list((ROOT / "sim" / "models").glob("*.json"))
    assert configs and all(f"cadenza/sim/models/{c.name}" in names for c in configs)


def test_wheel_declares_the_cadenza_console_script(wheel):
    entry_points = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    assert "cadenza = cadenza.node.cli:main" in wheel.read(entry_points).decode()


def test_mapped_folders_hold_no_init_so_operator_never_shadows_the_stdlib():
    for folder in MAPPED:
        assert not (ROOT / folder / "__init__.py").exists()
    import operator

    assert hasattr(operator, "itemgetter")


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from cadenza.node import metric_names` imports the module cadenza.node.metric_names
            modules = [f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")]
            names |= set(modules) or {node.module}
    return names


def _is_module(name: str) -> bool:
    """``cadenza.<folder>.<...>`` names a module or package of this repository."""
    parts = name.split(".")
    if parts[0] != "cadenza" or len(parts) < 3:
        return False
    path = ROOT.joinpath(*parts[1:])
    return path.with_suffix(".py").is_file() or path.is_dir()


def test_kernels_import_nothing_of_cadenza_outside_kernels():
    for py in (ROOT / "kernels").rglob("*.py"):
        outside = [n for n in imports_of(py) if n.startswith("cadenza") and not n.startswith("cadenza.kernels")]
        assert not outside, f"{py.name} imports {outside}"


# The layers, bottom to top: each top-level package and the cadenza packages it may import
# besides itself. docs/architecture.md ("What each package may import") draws the same map.
MAY_IMPORT = {
    "kernels": set(),
    "node": {"kernels"},
    "gateway": {"node"},
    "loadgen": {"node"},
    "pool": {"node"},
    "control": {"node", "pool"},
    "operator": {"node", "pool", "control"},
    "local": {"node", "pool", "control"},
    "sim": {"node", "pool", "control", "gateway", "loadgen"},
}
# What of the node the control plane may use: its contracts (knobs and their checks, the
# tensor-parallel size rule, traffic classes, header and metric names, the pool's credentials, how
# a process reads OTEL_*, a Hub download, the embedded model, the KV-transfer rule) - never the
# engine, runner, front end or server. The gateway also serves HTTP with the node's plumbing; the simulator runs the scheduler.
NODE_CONTRACTS = {"cadenza.node.core.config", "cadenza.node.core.policy", "cadenza.node.core.knobs",
                  "cadenza.node.core.parallel", "cadenza.node.wire",
                  "cadenza.node.credentials", "cadenza.node.metric_names", "cadenza.node.otel", "cadenza.node.hub",
                  "cadenza.node.embedded", "cadenza.node.kv_transfer.threshold"}
NODE_ALSO = {"gateway": ("cadenza.node.http.",), "sim": ("cadenza.node.core.",)}
CONTROL_PLANE = ("gateway", "loadgen", "pool", "control", "operator", "local", "sim")


def package_imports(folder: str) -> dict[Path, set[str]]:
    """Each module of a top-level package and the cadenza modules it imports (lazy ones too)."""
    return {py: {n for n in imports_of(py) if n.startswith("cadenza")} for py in (ROOT / folder).rglob("*.py")}


@pytest.mark.parametrize("folder", list(MAY_IMPORT))
def test_each_package_readme_says_what_it_may_import(folder):
    # the folder's README is the package's docstring (a mapped folder holds no __init__.py)
    line = next(line for line in (ROOT / folder / "README.md").read_text().splitlines() if line.startswith("May import:"))
    said = {word.strip(" ,") for word in re.sub(r"\(.*?\)", "", line.removeprefix("May import:")).split(",")} - {""}
    assert said == MAY_IMPORT[folder]


@pytest.mark.parametrize("folder", list(MAY_IMPORT))
def test_each_package_imports_only_the_layers_below_it(folder):
    allowed = {f"cadenza.{p}" for p in (*MAY_IMPORT[folder], folder)}
    for py, names in package_imports(folder).items():
        bad = [n for n in names if ".".join(n.split(".")[:2]) not in allowed and n != "cadenza"]
        assert not bad, f"{py.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("folder", CONTROL_PLANE)
def test_the_control_plane_uses_only_the_nodes_contracts(folder):
    for py, names in package_imports(folder).items():
        bad = [n for n in names if n.startswith("cadenza.node")
               and n not in NODE_CONTRACTS and not n.startswith(NODE_ALSO.get(folder, ()))]
        assert not bad, f"{py.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("folder", ["pool", "control", "gateway", "loadgen", "sim"])
def test_only_the_operator_and_the_gateways_kubernetes_source_talk_to_kubernetes(folder):
    # the pool model and the controller are pure: the operator, `cadenza up` and the simulator
    # share them; the gateway reads EndpointSlices in one module
    for py in (ROOT / folder).rglob("*.py"):
        if (folder, py.name) == ("gateway", "kubernetes_source.py"):
            continue
        bad = [n for n in imports_of(py) if n.split(".")[0] in ("kubernetes", "kopf")]
        assert not bad, f"{py.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("folder", CONTROL_PLANE)
def test_no_module_of_the_control_plane_is_over_about_four_hundred_lines(folder):
    long = {str(py.relative_to(ROOT)): n for py in (ROOT / folder).rglob("*.py")
            if (n := len(py.read_text().splitlines())) > 400}
    assert not long


def test_the_simulator_never_imports_torch_the_runner_or_the_servers():
    for py in (ROOT / "sim").rglob("*.py"):
        bad = [n for n in imports_of(py) if n == "torch" or n.startswith(("torch.", "cadenza.node.runner", "cadenza.node.server",
                                                                           "cadenza.node.frontend", "cadenza.kernels"))]
        assert not bad, f"{py.name} imports {bad}"


def cadenza_imports(folder: str) -> dict[Path, set[str]]:
    """Each module under ``node/<folder>`` and the cadenza modules it imports (lazy ones too)."""
    return {py: names for py, names in package_imports("node").items() if (ROOT / "node" / folder) in py.parents}


def test_the_core_never_imports_the_engine_runner_front_end_or_server():
    # vLLM's v1/core and v1/engine: the scheduler, KV manager and contract types sit below the
    # engine that drives them with the runner
    for py, names in cadenza_imports("core").items():
        outside = [n for n in names if n.startswith(("cadenza.node.engine", "cadenza.node.runner",
                                                     "cadenza.node.frontend", "cadenza.node.server",
                                                     "cadenza.node.http"))]
        assert not outside, f"core/{py.name} imports {outside}"


def test_the_runner_never_imports_the_engine_that_drives_it():
    for py, names in cadenza_imports("runner").items():
        assert not [n for n in names if n.startswith("cadenza.node.engine")], f"runner/{py.name}"


def test_the_runner_imports_only_step_data_of_the_scheduler():
    # of the core: the step's rows (step.py), the configuration and request types they carry, and
    # the tensor-parallel size rule the shards follow (parallel.py)
    allowed = {"cadenza.node.core.step", "cadenza.node.core.config", "cadenza.node.core.request",
               "cadenza.node.core.parallel"}
    for py, names in cadenza_imports("runner").items():
        core = [n for n in names if n.startswith("cadenza.node.core") and n not in allowed]
        assert not core, f"runner/{py.name} imports {core}"
        assert not [n for n in names if n.startswith(("cadenza.node.frontend", "cadenza.node.server"))]


def test_the_front_end_and_server_never_import_the_runner_or_the_scheduler():
    # they see the core through its messages, stats, config and knobs (and, for the offline
    # Engine and the in-thread core, the EngineCore class) - never scheduler or runner internals
    internals = ("cadenza.node.core.scheduler", "cadenza.node.core.prefill", "cadenza.node.core.decode",
                 "cadenza.node.core.block_manager", "cadenza.node.runner.model_runner", "cadenza.node.runner.backend")
    for folder in ("frontend", "server"):
        for py, names in cadenza_imports(folder).items():
            assert not [n for n in names if n.startswith(internals)], f"{folder}/{py.name} reaches into the core"


def test_kv_transfer_imports_nothing_of_cadenza_but_itself_and_never_torch():
    # the wire moves bytes: the engine adapts its blocks to it, never the other way round
    for py, names in cadenza_imports("kv_transfer").items():
        outside = [n for n in names if not n.startswith("cadenza.node.kv_transfer")]
        assert not outside, f"kv_transfer/{py.name} imports {outside}"
        assert not [n for n in imports_of(py) if n == "torch" or n.startswith("torch.")], f"kv_transfer/{py.name}"


def test_there_is_no_import_cycle():
    graph: dict[str, set[str]] = {}
    for folder in MAPPED:
        for py, names in package_imports(folder).items():
            graph[".".join(("cadenza", folder, *py.relative_to(ROOT / folder).with_suffix("").parts))] = names
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path[path.index(module):], module))
        if module in done or module not in graph:
            return
        for name in graph[module]:
            visit(name, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())


def test_no_scheduler_or_kv_module_is_over_about_three_hundred_lines():
    long = {py.name: n for py in (ROOT / "node" / "core").glob("*.py") if (n := len(py.read_text().splitlines())) > 330}
    assert not long


def test_scheduler_and_block_manager_never_import_torch():
    code = (
        "import sys; import cadenza.node.core.scheduler, cadenza.node.core.block_manager, "
        "cadenza.node.core.messages, cadenza.node.core.knobs; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ruff_finds_no_errors():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", *MAPPED, "bench", "tests"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_the_architecture_docs_module_map_names_every_module():
    # docs/architecture.md maps each module in one line; a module added or moved is added there
    text = (ROOT / "docs" / "architecture.md").read_text()
    mapped = set(re.findall(r"^\| `([\w/.]+\.py)` \|", text, re.M))
    modules = {str(py.relative_to(ROOT)) for folder in MAPPED for py in (ROOT / folder).rglob("*.py")}
    assert not modules - mapped, f"not in the module map: {sorted(modules - mapped)}"
    assert not mapped - modules, f"mapped but gone: {sorted(mapped - modules)}"
