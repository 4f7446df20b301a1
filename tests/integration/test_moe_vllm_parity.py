"""MoE parity against real vLLM (CPU build, Orbit's plugin models): on the same INT4 base
(Qwen3-MoE; DeepSeek-V3-style, with vLLM's MLA attention) and the same adapter (LoRA on
attention AND on every routed expert), vLLM and the learner agree on sampled tokens' log-probs
and choose the same experts for the same tokens.

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


# arch -> (LoRA targets, on attention, dense MLPs and every expert; the MoE layers of the demo model)
ARCHS = {
    "qwen3_moe": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], [0, 1, 2, 3]),
    # all but kv_b_proj, which vLLM's MLA folds into its attention (the trainer refuses it); the
    # first layer is dense, its MLP and the shared experts adapted too
    "deepseek_v3": (["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj"], [1, 2, 3]),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def moe_int4(request, tmp_path_factory) -> tuple[str, Path]:
    from orbit_runtime.demo_model import write_demo_model
    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int

    root = tmp_path_factory.mktemp(f"moe-parity-{request.param}")
    quantize_checkpoint(write_demo_model(root / "src", seed=5, arch=request.param), root / "int4", W4A16Int(group_size=128))
    return request.param, root / "int4"


@pytest.mark.parametrize(("architecture", "implementation"), [("Qwen3MoeForCausalLM", "CpuInt4Qwen3MoeForCausalLM"),
                                                              ("DeepseekV3ForCausalLM", "CpuInt4DeepseekV3ForCausalLM")])  # fmt: skip
def test_plugin_serves_moe_with_expert_linears_on_cpu(architecture, implementation):
    """The entry point vLLM loads registers Orbit's CPU models for the MoE architectures."""
    from importlib.metadata import entry_points

    from vllm import ModelRegistry

    (plugin,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "orbit_cpu_moe"]
    plugin.load()()
    from vllm.model_executor.models.interfaces import supports_lora

    model_cls = ModelRegistry._try_load_model_cls(architecture)
    assert model_cls.__name__ == implementation and supports_lora(model_cls)


def test_learner_matches_vllm_on_moe(moe_int4, tmp_path):
    arch, moe_int4 = moe_int4
    targets, moe_layers = ARCHS[arch]
    adapter_spec = AdapterSpec(rank=RANK, alpha=16, routed_experts=True, target_modules=targets)
    policy = load_policy(moe_int4, adapter_spec, dtype="fp16")
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
    assert served["hooked_layers"] == [len(moe_layers)]  # Orbit's CPU model served it, not vLLM's fused MoE
    completions = served["completions"]

    pairs = [(c["prompt"], c["tokens"]) for c in completions]
    with torch.no_grad():
        ours = policy.completion_logprobs(pairs)
        with policy.adapter_disabled():
            base = policy.completion_logprobs(pairs)
    delta = torch.cat([(a.float() - torch.tensor(c["logprobs"])).abs() for a, c in zip(ours, completions, strict=True)])
    adapter_effect = torch.cat([(a.float() - b.float()).abs() for a, b in zip(ours, base, strict=True)]).mean()
    assert delta.numel() >= 256
    # measured 2.6e-4 (Qwen3-MoE) and 2.7e-4 (DeepSeek); vLLM's CPU rope bug on MLA made it 4.2e-3
    assert delta.mean() < 1e-3, f"mean |dlogp| {delta.mean():.2e}"
    # every position, not only the mean: a bug at a few tokens (the first, a cache hit) would hide in it
    assert delta.quantile(0.99) < 2e-2 and delta.max() < 5e-2, f"p99 {delta.quantile(0.99):.2e} max {delta.max():.2e}"
    assert adapter_effect > 5 * delta.mean()  # the adapter is really applied on both sides
    # scored all in one request (prompt log-probs of many sequences in a batch, as the canary
    # asks; vLLM's LoRA head crashed there on CPU) vLLM agrees with the learner as closely
    scored = torch.cat([(a.float() - torch.tensor(c["scored"])).abs() for a, c in zip(ours, completions, strict=True)])
    assert scored.numel() == delta.numel() and scored.mean() < 1e-3, f"batch-scored mean |dlogp| {scored.mean():.2e}"
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
        assert len(chosen) == len(completion["routing"]) == len(moe_layers)
        for ours_layer, theirs_layer in zip(chosen, completion["routing"], strict=True):
            same += sum(a == b for a, b in zip(ours_layer, theirs_layer, strict=True))
            total += len(theirs_layer)
    for hook in hooks:
        hook.remove()
    rate = same / total
    print(f"MoE parity ({arch}): mean |dlogp| {delta.mean():.2e} over {delta.numel()} tokens (adapter effect {adapter_effect:.2e}, "
          f"its routed-expert part {expert_effect:.2e}), routing agreement {rate:.4f} of {total}")  # fmt: skip
    assert rate >= 0.99, f"routing agreement {rate:.4f}"


def test_flat_rotary_gives_vllms_cpu_rope_the_layout_it_gets_right():
    """vLLM's CPU `rotary_embedding` op rotates a [tokens, heads, dims] query wrongly when heads > 1
    (MLA passes that layout); on [tokens, heads * dims] it is right. FlatRotary, which Orbit's CPU
    DeepSeek model wraps MLA's rotary in, equals vLLM's own `forward_native` reference."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from orbit_runtime.rollout.vllm_cpu_deepseek import FlatRotary, flat_if_it_calls_the_op

    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))):  # as the engine runs
        rotary = get_rope(64, max_position=1024, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                          is_neox_style=False, dtype=torch.float32)  # fmt: skip
    assert rotary._forward_method == rotary.forward_cpu
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(7)
    query = torch.randn(7, 4, 128, generator=generator)[..., 64:]  # MLA's rope half of each head: a strided view
    key = torch.randn(7, 1, 64, generator=generator)
    want_query, want_key = rotary.forward_native(positions, query.clone(), key.clone())

    got_query, got_key = FlatRotary(rotary)(positions, query.clone(), key.clone())
    assert got_query.shape == query.shape and got_key.shape == key.shape
    torch.testing.assert_close(got_query, want_query, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_key, want_key, rtol=0, atol=1e-5)
    # the op on the 3-D layout: if this starts to pass, vLLM fixed it and FlatRotary can go
    raw_query, _ = rotary(positions, query.contiguous(), key.clone())
    assert (raw_query - want_query).abs().max() > 0.1, "vLLM's CPU rotary op now handles 3-D queries: drop FlatRotary"
    assert isinstance(flat_if_it_calls_the_op(rotary), FlatRotary)

    # DeepSeek-V3's own YaRN rope computes in PyTorch on CPU, on the 3-D layout: it is left as it is
    yarn_parameters = {"rope_type": "deepseek_yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                       "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))):
        yarn = get_rope(64, max_position=4096 * 40, rope_parameters=yarn_parameters, is_neox_style=False, dtype=torch.float32)
    assert flat_if_it_calls_the_op(yarn) is yarn
    got_query, got_key = yarn(positions, query.clone(), key.clone())
    want_query, want_key = yarn.forward_native(positions, query.clone(), key.clone())
    torch.testing.assert_close(got_query, want_query, rtol=0, atol=1e-5)
