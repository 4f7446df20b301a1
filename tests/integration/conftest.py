"""One real vLLM server (CPU build, fp16, runtime LoRA) shared by the integration tests.

Tests that load adapters use distinct version numbers: vLLM never sees a name twice.
"""

import pytest

from orbit_runtime.rollout.client import RolloutClient
from orbit_runtime.rollout.server import VLLMServer, VLLMServerConfig

RANK = 8


@pytest.fixture(scope="session")
def vllm_server(int4_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    config = VLLMServerConfig(int4_dir, dtype="float16", max_lora_rank=RANK, log_path=log)
    with VLLMServer(config) as server:
        yield server


@pytest.fixture(scope="session")
def rollout_client(vllm_server):
    client = RolloutClient(vllm_server.base_url)
    yield client
    client.close()
