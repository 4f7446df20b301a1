"""The vLLM launcher fails loudly: a server that cannot start is reported with its log."""

import json

import pytest

from orbit_runtime.errors import OrbitError
from orbit_runtime.rollout.server import VLLMServer, VLLMServerConfig


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(OrbitError, match="no config.json"):
        VLLMServer(VLLMServerConfig(tmp_path / "nothing")).start()


@pytest.mark.vllm
def test_server_that_dies_while_starting_reports_exit_code_and_log(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"], "model_type": "nosuch"}))
    server = VLLMServer(VLLMServerConfig(broken, log_path=tmp_path / "vllm.log"))
    with pytest.raises(RuntimeError, match="exited with code") as failure:
        server.start(timeout_s=120)
    assert "nosuch" in str(failure.value).lower() or "NoSuchModel" in str(failure.value)
    assert not server.alive()
