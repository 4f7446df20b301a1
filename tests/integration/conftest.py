"""One real vLLM server (CPU build, fp16, runtime LoRA) shared by the integration tests.

Tests that load adapters use distinct version numbers: vLLM never sees a name twice.
"""

import json
import shutil

import pytest

from orbit_runtime.rollout.client import RolloutClient
from orbit_runtime.rollout.server import VLLMServer, VLLMServerConfig

RANK = 8
API_KEY = "orbit-test-run-key-7f3a9c"  # the run's key (orbit_runtime.api_key): every test client must send it


# An Instruct checkpoint's generation_config.json carries sampling defaults (Qwen2.5-Instruct:
# top_k 20, repetition_penalty 1.05). The served copy gets stronger ones, so a rollout engine
# that applied them silently would fail the parity tests instead of passing by luck.
INSTRUCT_SAMPLING_DEFAULTS = {"top_k": 5, "top_p": 0.5, "repetition_penalty": 1.5, "temperature": 0.3}


@pytest.fixture(scope="session")
def vllm_server(int4_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    served = tmp_path_factory.mktemp("served") / "base"
    shutil.copytree(int4_dir, served)
    generation = json.loads((served / "generation_config.json").read_text())
    (served / "generation_config.json").write_text(json.dumps({**generation, **INSTRUCT_SAMPLING_DEFAULTS}))
    # prefix caching and max_num_seqs at vLLM's CPU defaults: the flags Orbit passes are accepted by the real server
    config = VLLMServerConfig(served, dtype="float16", max_lora_rank=RANK, log_path=log, enable_prefix_caching=True,
                              max_num_seqs=128, api_key=API_KEY)  # fmt: skip
    with VLLMServer(config) as server:
        yield server


@pytest.fixture(scope="session")
def rollout_client(vllm_server):
    client = RolloutClient(vllm_server.base_url, api_key=API_KEY)
    yield client
    client.close()
