"""The reference server (a real HTTP process) returns the base policy's log-probs, exactly
what the learner computes with its adapter disabled."""

import httpx
import torch

from orbit_runtime.config import AdapterSpec
from orbit_runtime.learner.micro_batches import MicroBatchLimits
from orbit_runtime.learner.model import load_policy
from orbit_runtime.reference.client import ReferenceClient, ReferenceServer
from orbit_runtime.trainer.roles import ReferenceRole


def test_reference_server_matches_learner_with_adapter_disabled(int4_dir, tmp_path):
    policy = load_policy(int4_dir, AdapterSpec(rank=8), dtype="fp32")
    policy.init_adapter_randomly(std=0.05, seed=0)  # must not leak into the reference
    pairs = [([97, 86, 84, 70], [18, 19, 12]), ([97, 66], [20, 21, 22, 23, 24])]
    # both score in micro-batches of one sequence here (8 padded tokens): the results must not change
    shared_role = ReferenceRole("shared", policy, int4_dir, "fp32", tmp_path / "unused.log", max_restarts=0,
                                limits=MicroBatchLimits(max_tokens=8))  # fmt: skip
    shared, shared_cold = shared_role.logprobs(pairs, 1.0), shared_role.logprobs(pairs, 0.7)
    with policy.scoring(), policy.adapter_disabled():
        one_batch = policy.completion_logprobs(pairs)
    for a, b in zip(shared, one_batch, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    key = "reference-test-key"
    with ReferenceServer(int4_dir, "fp32", log_path=tmp_path / "ref.log", micro_batch_tokens=8, api_key=key) as server:
        client = ReferenceClient(server.base_url, api_key=key)
        remote, remote_cold = client.logprobs(pairs), client.logprobs(pairs, temperature=0.7)
        bad = client._http.post("/v1/logprobs", json={"sequences": [{"prompt_ids": [1], "completion_ids": [10**6]}]})
        client.close()
        payload = {"sequences": [{"prompt_ids": [97], "completion_ids": [18]}]}  # the run's key, or 401; probes stay open
        assert httpx.post(f"{server.base_url}/v1/logprobs", json=payload).status_code == 401
        assert httpx.post(f"{server.base_url}/v1/logprobs", json=payload, headers={"Authorization": "Bearer x"}).status_code == 401
        assert httpx.get(f"{server.base_url}/healthz").status_code == 200 and httpx.get(f"{server.base_url}/metrics").status_code == 200
    for a, b, (_, completion) in zip(shared, remote, pairs, strict=True):
        assert b.shape == (len(completion),)
        assert torch.allclose(a, b, atol=1e-5)
    for a, b, warm in zip(shared_cold, remote_cold, shared, strict=True):  # the sampling temperature reaches the server
        assert torch.allclose(a, b, atol=1e-5) and not torch.allclose(a, warm, atol=1e-3)
    assert bad.status_code == 422 and "outside the vocabulary" in bad.text
    with torch.no_grad():
        with_adapter = policy.completion_logprobs(pairs)
    assert (with_adapter[1] - shared[1]).abs().max() > 1e-3
