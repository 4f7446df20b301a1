"""The pod's role commands fail with one clear line, however early they fail."""

import yaml
from typer.testing import CliRunner

from orbit_runtime.cli import app


def test_learner_that_cannot_load_its_base_exits_with_one_line(tmp_path, monkeypatch):
    """The learner fails while it is still being built (no base where the config says): one error
    line and a non-zero exit, no traceback; its termination message is that line, not a status, with
    the value of every variable a Secret put into its environment masked (ORBIT_REDACT_ENV names them,
    whatever they are called), not the kubelet's raw copy of the log."""
    secret = "tok-3f9a7c21e8"
    monkeypatch.setenv("registry.Pass_word", secret)
    monkeypatch.setenv("ORBIT_REDACT_ENV", "registry.Pass_word")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(tmp_path / f"no-base-{secret}")}, "rewards": [{"function": "exact_match"}],
                                      "run": {"output_dir": str(tmp_path / "runs")}}))  # fmt: skip
    message = tmp_path / "termination-log"
    result = CliRunner().invoke(app, ["learner", str(config), "--wait-seconds", "1", "--termination-log", str(message)])
    assert result.exit_code == 2, (result.exit_code, result.exception, result.output)  # fail(): one line, exit 2
    assert "error:" in result.output and "no-base-***" in result.output and secret not in result.output, result.output
    written = message.read_text()
    assert written.startswith("error: ") and "no-base-***" in written and secret not in written
    assert not written.lstrip().startswith("{")  # not a status: the operator reads it as the learner's last words
