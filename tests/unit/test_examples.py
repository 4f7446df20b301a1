"""Every shipped example config validates, exactly as `orbit train` reads it."""

from pathlib import Path

import pytest

from orbit_runtime.config import load_job_spec

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_are_examples():
    assert EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates(path):
    spec = load_job_spec(path)
    assert Path(spec.model.path).is_absolute()  # resolved against the file's folder
    assert spec.run.output_dir.startswith(str(path.parent.parent))
