"""The vLLM launcher fails loudly: a server that cannot start is reported with its log."""

import json

import httpx
import pytest

from orbit_runtime.api_key import auth_headers
from orbit_runtime.errors import OrbitError
from orbit_runtime.rollout.server import VLLMServer, VLLMServerConfig

from .conftest import API_KEY


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


@pytest.mark.vllm
def test_seeded_sampling_is_reproducible_across_a_chunk_sized_batch(rollout_client):
    # 16 prompts x 8 samples x 33 tokens > vLLM's 2048-token step budget: with chunked prefill,
    # vLLM's CPU build dies on seeded requests ("CPU Generator does not use offset"); Orbit
    # starts it without chunked prefill, and the same seed must give the same samples.
    prompts = [[5 + (i % 7)] * 33 for i in range(16)]
    first = rollout_client.generate(prompts, n=8, max_tokens=3, temperature=1.0, seed=11)
    second = rollout_client.generate(prompts, n=8, max_tokens=3, temperature=1.0, seed=11)
    other = rollout_client.generate(prompts, n=8, max_tokens=3, temperature=1.0, seed=12)
    tokens = lambda groups: [c.token_ids for g in groups for c in g]  # noqa: E731
    assert tokens(first) == tokens(second)
    assert tokens(first) != tokens(other)
    assert len({tuple(t) for t in tokens(first)}) > 1  # the n samples of a prompt differ


@pytest.mark.vllm
def test_the_rollout_refuses_every_caller_without_the_runs_key_but_probes_and_scrapes(vllm_server):
    url = vllm_server.base_url
    # what could poison the run or sample the model: LoRA loading, generation (vLLM's own --api-key leaves
    # SageMaker's /invocations open), the model list, the tokenizer routes
    refused = [("post", "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": "/tmp/evil"}),
               ("post", "/v1/unload_lora_adapter", {"lora_name": "base"}),
               ("post", "/v1/completions", {"model": "base", "prompt": "1+1=", "max_tokens": 2}),
               ("post", "/invocations", {"model": "base", "prompt": "1+1=", "max_tokens": 2}),
               ("post", "/tokenize", {"model": "base", "prompt": "hi"}), ("get", "/v1/models", None)]  # fmt: skip
    for method, path, body in refused:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY}):
            response = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers, response.status_code, response.text[:200])
    for path in ("/health", "/metrics"):  # the kubelet's probes and Prometheus carry no secret
        assert httpx.get(f"{url}{path}", timeout=30).status_code == 200, path
    models = httpx.get(f"{url}/v1/models", headers=auth_headers(API_KEY), timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "base"
