"""Adapter hot-sync against a real vLLM server: verified versions are served, a stale adapter
is detected by the canary and never served."""

import pytest
import torch

from orbit_runtime.config import AdapterSpec
from orbit_runtime.learner.model import load_policy
from orbit_runtime.sync.adapter_sync import AdapterSync, SyncError, publish_adapter

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
    first = sync.sync(policy, 10, path)
    assert first.served_name == "orbit-adapter-v10" and first.canary_mean_abs_dlogp < 2e-2

    _nudge(policy, 2)
    second = sync.sync(policy, 11, publish_adapter(policy, root, 11)[0])
    served = rollout_client.served_models()
    assert second.served_name in served and first.served_name not in served  # old one unloaded

    # The learner moves on to v12 but the rollout is handed v11's files: a stale adapter.
    _nudge(policy, 3)
    with pytest.raises(SyncError, match=r"v12 .* differ .* after 2 attempts; still serving orbit-adapter-v11"):
        sync.sync(policy, 12, root / "v11")
    served = rollout_client.served_models()
    assert "orbit-adapter-v11" in served
    assert not [m for m in served if m.startswith("orbit-adapter-v12")]  # never served
    assert sync.failures == 2 and sync.served_name == "orbit-adapter-v11"
