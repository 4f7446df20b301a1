"""The pod's role commands fail with one clear line, however early they fail."""

import yaml
from typer.testing import CliRunner

from orbit_runtime.cli import app


def test_learner_that_cannot_load_its_base_exits_with_one_line(tmp_path):
    """The learner fails while it is still being built (no base where the config says): one error
    line and a non-zero exit, no traceback, and no termination message claiming a status."""
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(tmp_path / "no-base")}, "rewards": [{"function": "exact_match"}],
                                      "run": {"output_dir": str(tmp_path / "runs")}}))  # fmt: skip
    message = tmp_path / "termination-log"
    result = CliRunner().invoke(app, ["learner", str(config), "--wait-seconds", "1", "--termination-log", str(message)])
    assert result.exit_code == 2, (result.exit_code, result.exception, result.output)  # fail(): one line, exit 2
    assert "error:" in result.output and "no-base" in result.output, result.output
    assert not message.exists()
