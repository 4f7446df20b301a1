"""Adapter hot-sync against a real vLLM server: verified versions are served, a stale adapter
is detected by the canary and never served."""

import os
import signal

import httpx
import pytest
import torch

from orbit_runtime.config import AdapterSpec
from orbit_runtime.learner.model import load_policy
from orbit_runtime.rollout.server import VLLMServerConfig
from orbit_runtime.sync.adapter_sync import AdapterSync, SyncError, canary_expectations, publish_adapter
from orbit_runtime.trainer.roles import RolloutRole

from .conftest import RANK

pytestmark = pytest.mark.vllm
CANARY = [([97, 86, 84, 70, 83, 0], [18, 19, 12, 24, 98]), ([97, 66, 67, 68], [20, 21, 22])]


def _nudge(policy, seed):
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)


def test_publish_sync_and_stale_detection(rollout_client, int4_dir, tmp_path):
    policy = load_policy(int4_dir, AdapterSpec(rank=RANK, alpha=16), dtype="fp16")
    sync = AdapterSync(rollout_client, CANARY, tolerance=2e-2, retries=1)
    root = tmp_path / "adapters"

    _nudge(policy, 1)
    path, size = publish_adapter(policy, root, 10)
    assert path == root / "v10" and (path / "adapter_model.safetensors").is_file() and size > 0
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no partial directories left
    first = sync.sync(10, path, canary_expectations(policy, CANARY))
    assert first.served_name == "orbit-adapter-v10" and first.canary_mean_abs_dlogp < 2e-2

    _nudge(policy, 2)
    second = sync.sync(11, publish_adapter(policy, root, 11)[0], canary_expectations(policy, CANARY))
    served = rollout_client.served_models()
    assert second.served_name in served and first.served_name not in served  # old one unloaded

    # The learner moves on to v12 but the rollout is handed v11's files: a stale adapter.
    _nudge(policy, 3)
    with pytest.raises(SyncError, match=r"v12 .* differ .* after 2 attempts; still serving orbit-adapter-v11"):
        sync.sync(12, root / "v11", canary_expectations(policy, CANARY))
    served = rollout_client.served_models()
    assert "orbit-adapter-v11" in served
    assert not [m for m in served if m.startswith("orbit-adapter-v12")]  # never served
    assert sync.failures == 2 and sync.served_name == "orbit-adapter-v11"


def test_vllm_killed_while_a_sync_is_in_flight_recovers_both_versions(int4_dir, tmp_path):
    """The rollout server dies while v2 is being loaded. The restarted server must serve v1
    again, verified against v1's canary (the learner's weights are already v2's), then v2."""
    policy = load_policy(int4_dir, AdapterSpec(rank=RANK, alpha=16), dtype="fp16")
    config = VLLMServerConfig(int4_dir, dtype="float16", max_lora_rank=RANK, log_path=tmp_path / "vllm.log")
    role = RolloutRole(config, CANARY, tolerance=2e-2, retries=1, max_restarts=1)
    root = tmp_path / "adapters"
    role.start()
    try:
        _nudge(policy, 1)
        role.publish(policy, 1, publish_adapter(policy, root, 1)[0])
        _nudge(policy, 2)  # the next update: the learner now holds v2's weights
        path2 = publish_adapter(policy, root, 2)[0]
        first_pid, load = role.server.pid, role.client.load_adapter

        def die_then_load(name, path):  # a real SIGKILL of the server, mid-sync
            os.killpg(first_pid, signal.SIGKILL)
            return load(name, path)

        role.client.load_adapter = die_then_load
        result = role.publish(policy, 2, path2)
        assert role.restarts == 1 and role.server.pid != first_pid
        assert result.version == 2 and role.served_name == "orbit-adapter-v2" and role.canary_failures == 0
        assert role.client.served_models() == ["base", "orbit-adapter-v2"]
        assert role.client.loaded == ["orbit-adapter-v2"] and "orbit-adapter-v1" in role.client._ever_loaded  # v1 came back first
    finally:
        role.stop()


def test_an_external_rollout_restarted_between_requests_is_noticed_and_resynced(vllm_server, int4_dir, tmp_path):
    """The pod's rollout container restarted by the kubelet between two requests: it answers, but
    without our adapter. The learner's role sees the served adapter gone, re-syncs it, retries."""
    from orbit_runtime.rollout.client import RolloutClient

    policy = load_policy(int4_dir, AdapterSpec(rank=RANK, alpha=16), dtype="fp16")
    _nudge(policy, 7)
    config = VLLMServerConfig(int4_dir)  # unused with a URL: the server is external
    role = RolloutRole(config, CANARY, tolerance=2e-2, retries=1, max_restarts=1, url=vllm_server.base_url, wait_s=30)
    role.start()
    try:
        root = tmp_path / "adapters"
        served = role.publish(policy, 31, publish_adapter(policy, root, 31)[0]).served_name
        # what a freshly restarted vLLM looks like: up, with no adapter loaded
        httpx.post(f"{vllm_server.base_url}/v1/unload_lora_adapter", json={"lora_name": served}).raise_for_status()
        assert role.lost_state()
        scores = role.call(lambda client: client.score(CANARY[0][0] + CANARY[0][1], model=role.served_name), kind="request")
        assert scores  # answered, with the adapter loaded again
        assert role.restarts == 1 and role.served_name in RolloutClient(vllm_server.base_url).served_models()
    finally:
        role.stop()
