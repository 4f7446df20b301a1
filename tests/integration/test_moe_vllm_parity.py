"""MoE parity against real vLLM (CPU build, Orbit's plugin model): on the same INT4 Qwen3-MoE
base and the same adapter (LoRA on attention AND on every routed expert), vLLM and the learner
agree on sampled tokens' log-probs and choose the same experts for the same tokens.

fp16, as the dense parity test: bf16's own noise would hide a real mismatch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orbit_runtime.config import AdapterSpec
from orbit_runtime.learner.model import load_policy
from orbit_runtime.learner.moe import Router

pytestmark = pytest.mark.vllm
RANK = 8
PROBE = Path(__file__).with_name("vllm_moe_probe.py")


@pytest.fixture(scope="module")
def moe_int4(tmp_path_factory) -> Path:
    from orbit_runtime.demo_model import write_demo_model
    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int

    root = tmp_path_factory.mktemp("moe-parity")
    quantize_checkpoint(write_demo_model(root / "src", seed=5, arch="qwen3_moe"), root / "int4", W4A16Int(group_size=128))
    return root / "int4"


def test_plugin_serves_qwen3_moe_with_expert_linears_on_cpu():
    """The entry point vLLM loads registers Orbit's CPU model for the Qwen3-MoE architecture."""
    from importlib.metadata import entry_points

    from vllm import ModelRegistry

    (plugin,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "orbit_cpu_moe"]
    plugin.load()()
    from vllm.model_executor.models.interfaces import supports_lora

    model_cls = ModelRegistry._try_load_model_cls("Qwen3MoeForCausalLM")
    assert model_cls.__name__ == "CpuInt4Qwen3MoeForCausalLM" and supports_lora(model_cls)


def test_learner_matches_vllm_on_moe(moe_int4, tmp_path):
    policy = load_policy(moe_int4, AdapterSpec(rank=RANK, alpha=16, routed_experts=True), dtype="fp16")
    policy.init_adapter_randomly(std=0.02, seed=0)
    adapter = policy.save_adapter(tmp_path / "adapter")
    from safetensors import safe_open

    with safe_open(adapter / "adapter_model.safetensors", "pt") as reader:
        keys = list(reader.keys())
    assert "base_model.model.model.layers.2.mlp.experts.5.gate_proj.lora_A.weight" in keys  # per-expert layout

    out = tmp_path / "vllm.json"
    run = subprocess.run(
        [sys.executable, str(PROBE), str(moe_int4), str(adapter), str(out), str(RANK)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    served = json.loads(out.read_text())
    assert served["hooked_layers"] == [4]  # Orbit's CPU model served it, not vLLM's fused MoE
    completions = served["completions"]

    pairs = [(c["prompt"], c["tokens"]) for c in completions]
    with torch.no_grad():
        ours = policy.completion_logprobs(pairs)
        with policy.adapter_disabled():
            base = policy.completion_logprobs(pairs)
    delta = torch.cat([(a.float() - torch.tensor(c["logprobs"])).abs() for a, c in zip(ours, completions, strict=True)])
    adapter_effect = torch.cat([(a.float() - b.float()).abs() for a, b in zip(ours, base, strict=True)]).mean()
    assert delta.numel() >= 256
    assert delta.mean() < 1e-2, f"mean |dlogp| {delta.mean():.2e}"
    # every position, not only the mean: a bug at a few tokens (the first, a cache hit) would hide in it
    assert delta.quantile(0.99) < 2e-2 and delta.max() < 5e-2, f"p99 {delta.quantile(0.99):.2e} max {delta.max():.2e}"
    assert adapter_effect > 5 * delta.mean()  # the adapter is really applied on both sides
    # ... its routed-expert part too: without it the learner would be far from vLLM
    state = policy.adapter_state()
    policy.load_adapter_state({n: (t * 0 if ".experts." in n and "lora_B" in n else t) for n, t in state.items()})
    with torch.no_grad():
        no_experts = policy.completion_logprobs(pairs)
    policy.load_adapter_state(state)
    expert_effect = torch.cat([(a.float() - b.float()).abs() for a, b in zip(ours, no_experts, strict=True)]).mean()
    assert expert_effect > 5 * delta.mean(), f"expert LoRA moves log-probs by {expert_effect:.2e} only"

    # routing: the learner's chosen experts per (layer, token) against vLLM's
    chosen: list = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: chosen.append(out[1].sort(-1).values.tolist()))
        for m in policy.model.modules()
        if isinstance(m, Router)
    ]
    same = total = 0
    for completion in completions:
        chosen.clear()
        with torch.no_grad():
            policy.token_logprobs(torch.tensor([completion["prompt"] + completion["tokens"]]))
        assert len(chosen) == len(completion["routing"]) == 4
        for ours_layer, theirs_layer in zip(chosen, completion["routing"], strict=True):
            same += sum(a == b for a, b in zip(ours_layer, theirs_layer, strict=True))
            total += len(theirs_layer)
    for hook in hooks:
        hook.remove()
    rate = same / total
    print(f"MoE parity: mean |dlogp| {delta.mean():.2e} over {delta.numel()} tokens (adapter effect {adapter_effect:.2e}, "
          f"its routed-expert part {expert_effect:.2e}), routing agreement {rate:.4f} of {total}")  # fmt: skip
    assert rate >= 0.99, f"routing agreement {rate:.4f}"
