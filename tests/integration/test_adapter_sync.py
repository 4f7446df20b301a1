"""Adapter hot-sync against a real vLLM server: verified versions are served, a stale adapter
is detected by the canary and never served."""

import os
import signal

import httpx
import pytest
import torch

from orbit_runtime.api_key import auth_headers
from orbit_runtime.config import AdapterSpec
from orbit_runtime.learner.model import load_policy
from orbit_runtime.rollout.client import RolloutClient
from orbit_runtime.rollout.server import VLLMServer, VLLMServerConfig
from orbit_runtime.sync.adapter_sync import AdapterSync, SyncError, calibrated_tolerance, canary_expectations, publish_adapter
from orbit_runtime.trainer.roles import DecodeCanary, RolloutRole

from .conftest import API_KEY, RANK

pytestmark = pytest.mark.vllm
CANARY = [([97, 86, 84, 70, 83, 0], [18, 19, 12, 24, 98]), ([97, 66, 67, 68], [20, 21, 22])]


def _nudge(policy, seed, scale=0.05):
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * scale)


@pytest.fixture(params=["fp16", "bf16"])
def canary_engines(request, rollout_client, int4_dir, tmp_path):
    """(dtype, client, floor bound): the session's fp16 vLLM, or a bf16 one of its own (the dtype the
    old fixed 0.1 tolerance could not discriminate in); the learner computes in the same dtype."""
    if request.param == "fp16":
        yield "fp16", rollout_client, 5e-3
        return
    config = VLLMServerConfig(int4_dir, dtype="bfloat16", max_lora_rank=RANK, log_path=tmp_path / "vllm-bf16.log")
    with VLLMServer(config) as server:
        client = RolloutClient(server.base_url)
        yield "bf16", client, 2e-2  # bf16's 8-bit mantissa: a larger floor, still far under its 0.1 ceiling
        client.close()


def test_a_stale_adapter_inside_the_tolerance_is_told_from_a_fresh_one(canary_engines, int4_dir, tmp_path):
    """One small step (the canary moves by a few hundredths, within the old fixed bf16 tolerance
    of 0.1): version N-1's weights served under N's name fail loudly, the fresh N passes, and
    versions closer than the noise are reported inconclusive."""
    from orbit_runtime.observability import metrics

    dtype, rollout_client, floor_bound = canary_engines
    policy = load_policy(int4_dir, AdapterSpec(rank=RANK, alpha=16), dtype=dtype)
    sync = AdapterSync(rollout_client, CANARY, tolerance=0.1, retries=1)
    floor = sync.measure_noise_floor(canary_expectations(policy, CANARY, base=True))
    assert 0 <= floor < floor_bound  # learner and vLLM compute the same base
    root = tmp_path / "adapters"
    _nudge(policy, 21)
    v20 = canary_expectations(policy, CANARY)
    assert sync.sync(20, publish_adapter(policy, root, 20)[0], v20).canary_verdict == "unchecked"  # no v19 known

    _nudge(policy, 22, scale=0.01)  # a small step
    v21 = canary_expectations(policy, CANARY)
    publish_adapter(policy, root, 21)
    with pytest.raises(SyncError, match=r"v21 .* closer to v20's log-probs \(0\.0\d+\) than to v21's .* stale adapter"):
        sync.sync(21, root / "v20", v21, previous=v20)  # v20's files served as v21
    assert sync.served_name == "orbit-adapter-v20"

    fresh = sync.sync(21, root / "v21", v21, previous=v20)
    assert fresh.canary_verdict == "verified" and fresh.served_name.startswith("orbit-adapter-v21")
    assert 3 * floor < fresh.canary_separation < 0.1  # inside the old tolerance, outside the noise
    assert fresh.canary_mean_abs_dlogp < fresh.canary_previous_mean_abs_dlogp

    inconclusive_before = metrics.SYNC_CANARY_INCONCLUSIVE._value.get()
    _nudge(policy, 23, scale=1e-6)  # late in a decayed schedule: the step is below the noise
    v22 = canary_expectations(policy, CANARY)
    late = sync.sync(22, publish_adapter(policy, root, 22)[0], v22, previous=v21)
    assert late.canary_verdict == "inconclusive" and late.canary_separation < 3 * floor + 1e-6
    assert metrics.SYNC_CANARY_INCONCLUSIVE._value.get() == inconclusive_before + 1


def test_a_rollout_serving_another_base_fails_at_start_naming_the_fields(vllm_server, int4_dir):
    """The noise floor above the dtype's ceiling (NOISE_FLOOR_CEILING): vLLM's base is not the
    learner's, so no tolerance would mean anything; the run stops before any adapter is served."""
    policy = load_policy(int4_dir, AdapterSpec(rank=RANK, alpha=16), dtype="fp16")
    with torch.no_grad():  # the learner's base is now another model than the one vLLM serves
        policy.model.get_output_embeddings().weight.mul_(8.0)
    role = RolloutRole(VLLMServerConfig(int4_dir, api_key=API_KEY), CANARY, tolerance=None, retries=1, max_restarts=1, url=vllm_server.base_url)
    role.start()
    try:
        with pytest.raises(SyncError, match=r"differs from the learner's by \d+\.\d+ mean .*\(at most 0\.02 .* in fp16\).*model\.path"):
            role.calibrate(policy, "fp16")
        assert role.served_name is None
    finally:
        role.stop()


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
    role = RolloutRole(config, CANARY, tolerance=None, retries=1, max_restarts=1, decode=DecodeCanary(tokens=6, temperature=1.0))
    root = tmp_path / "adapters"
    role.start()
    try:
        floor = role.calibrate(policy, "fp16")
        _nudge(policy, 1)
        first = role.publish(policy, 1, publish_adapter(policy, root, 1)[0])
        # v1 against the base: told apart; the decode path (6 sampled tokens a prompt) agrees as the prefill does
        assert first.canary_verdict == "verified" and first.canary_tolerance == calibrated_tolerance(floor)
        assert first.decode.tokens == 6 * len(CANARY) and first.decode.mean_abs_dlogp < 5e-3
        assert first.decode.max_abs_dlogp < 5e-2
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

    policy = load_policy(int4_dir, AdapterSpec(rank=RANK, alpha=16), dtype="fp16")
    _nudge(policy, 7)
    config = VLLMServerConfig(int4_dir, api_key=API_KEY)  # with a URL only its key is used: the server is external
    role = RolloutRole(config, CANARY, tolerance=2e-2, retries=1, max_restarts=1, url=vllm_server.base_url, wait_s=30)
    role.start()
    try:
        root = tmp_path / "adapters"
        served = role.publish(policy, 31, publish_adapter(policy, root, 31)[0]).served_name
        # what a freshly restarted vLLM looks like: up, with no adapter loaded
        httpx.post(f"{vllm_server.base_url}/v1/unload_lora_adapter", json={"lora_name": served},
                   headers=auth_headers(API_KEY)).raise_for_status()  # fmt: skip
        assert role.lost_state()
        scores = role.call(lambda client: client.score(CANARY[0][0] + CANARY[0][1], model=role.served_name), kind="request")
        assert scores  # answered, with the adapter loaded again
        assert role.restarts == 1 and role.served_name in RolloutClient(vllm_server.base_url, api_key=API_KEY).served_models()
    finally:
        role.stop()


def test_an_adapter_written_in_the_served_dtype_serves_exactly_as_the_fp32_one(rollout_client, int4_dir, tmp_path):
    """The sync writes the adapter in vLLM's dtype: half the bytes of fp32, and vLLM, which casts to its
    dtype at load, serves bitwise the same log-probs as from the fp32 file of the same weights."""
    from safetensors import safe_open

    policy = load_policy(int4_dir, AdapterSpec(rank=RANK, alpha=16), dtype="fp16")
    _nudge(policy, 40)
    root = tmp_path / "adapters"
    full, full_size = publish_adapter(policy, root, 40)
    served, served_size = publish_adapter(policy, root, 41, torch.float16)
    with safe_open(served / "adapter_model.safetensors", "pt") as reader:
        assert {reader.get_tensor(k).dtype for k in reader.keys()} == {torch.float16}
    assert served_size < 0.6 * full_size
    scores = {}
    for name, path in (("dtype-fp32", full), ("dtype-fp16", served)):
        rollout_client.load_adapter(name, path)
        scores[name] = [rollout_client.score(p + c, model=name) for p, c in CANARY]
        rollout_client.unload_adapter(name)
    assert scores["dtype-fp32"] == scores["dtype-fp16"]
    base = [rollout_client.score(p + c) for p, c in CANARY]
    assert base != scores["dtype-fp16"]  # the adapter is served at all
    # the canary's one-request scoring gives each sequence the log-probs of its own request
    together = rollout_client.score_many([p + c for p, c in CANARY])
    assert [len(row) for row in together] == [len(p + c) - 1 for p, c in CANARY]
    for row, alone in zip(together, base, strict=True):  # one forward over both: same tokens, batched arithmetic
        assert row == pytest.approx(alone, abs=1e-4)
