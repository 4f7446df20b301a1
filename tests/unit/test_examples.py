"""Every shipped example validates: runtime configs exactly as `orbit train` reads them,
RLTrainingJob manifests (rljob*.yaml, see tests/unit/test_operator_manifests.py) as the operator does."""

from pathlib import Path

import pytest

from orbit_runtime.config import load_job_spec

EXAMPLES = sorted(p for p in (Path(__file__).resolve().parents[2] / "examples").glob("*.yaml") if not p.name.startswith("rljob"))


def test_there_are_examples():
    assert EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path):
    spec = load_job_spec(path)
    assert Path(spec.model.path).is_absolute()  # resolved against the file's folder
    assert spec.run.output_dir.startswith(str(path.parent.parent))
