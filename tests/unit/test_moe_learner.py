"""MoE learner: packed INT4 experts computed grouped give what transformers' own dense MoE
model gives on the dequantized INT4 weights (fp32), with LoRA, log-probs and gradients.

The yardstick is independent of Orbit's MoE code: transformers' modelling files, with their
fused 3-D expert tensors and their own routing (Qwen3-MoE softmax top-k; DeepSeek-V3 sigmoid,
group-limited, bias-corrected, scaled), loaded from the 16-bit checkpoint with each
quantized weight replaced by its INT4 values.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orbit_runtime.config import AdapterSpec
from orbit_runtime.learner.dense_reference import load_dequantized_dense_model
from orbit_runtime.learner.grouped_experts import looped_expert_forward
from orbit_runtime.learner.int4_linear import Int4Linear
from orbit_runtime.learner.model import load_policy
from orbit_runtime.learner.moe import SparseMoeBlock, per_expert_peft_layout
from orbit_runtime.moe_routing import RoutingSpec, select_experts

QWEN3_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # Qwen3-MoE has no dense or shared MLP
DEEPSEEK_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _build(root: Path, arch: str) -> tuple[Path, Path]:
    from orbit_runtime.demo_model import write_demo_model
    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int

    src = write_demo_model(root / arch, seed=3, arch=arch)
    dst = root / f"{arch}-int4"
    quantize_checkpoint(src, dst, W4A16Int(group_size=128))
    return src, dst


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> tuple[Path, Path]:
    return _build(tmp_path_factory.mktemp("moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> tuple[Path, Path]:
    return _build(tmp_path_factory.mktemp("moe"), "deepseek_v3")


def _reference_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize(("arch", "targets"), [("qwen3_moe", QWEN3_TARGETS), ("deepseek_v3", DEEPSEEK_TARGETS)])
def test_moe_learner_equals_transformers_dense_model(arch, targets, request):
    """Per-token log-probs and every LoRA gradient within 1e-5 of transformers' dense fp32 model."""
    from peft import get_peft_model

    from orbit_runtime.learner.model import lora_config

    src, int4 = request.getfixturevalue("qwen3_moe" if arch == "qwen3_moe" else "deepseek")
    adapter = AdapterSpec(rank=4, alpha=8, target_modules=targets)
    policy = load_policy(int4, adapter, dtype="fp32")
    policy.init_adapter_randomly(std=0.05, seed=1)
    reference = load_dequantized_dense_model(src, int4)
    with per_expert_peft_layout(reference):  # PEFT's v4->v5 remap would drop the dense/shared MLP targets
        dense = get_peft_model(reference, lora_config(adapter))
    dense.eval()
    ours_params = {n: p for n, p in policy.model.named_parameters() if p.requires_grad}
    theirs_params = {n: p for n, p in dense.named_parameters() if p.requires_grad}
    assert set(ours_params) == set(theirs_params)  # same LoRA modules (attention, shared experts, dense MLP)
    if arch == "deepseek_v3":  # shared experts and the dense first layer are adapted, routed experts are not
        assert any(".shared_experts.gate_proj.lora_A" in n for n in ours_params)
        assert any("layers.0.mlp.gate_proj.lora_A" in n for n in ours_params)
    assert not any(".experts." in n and "shared" not in n for n in ours_params)
    with torch.no_grad():
        for name, param in theirs_params.items():
            param.copy_(ours_params[name])

    ids = torch.randint(0, 96, (3, 40), generator=torch.Generator().manual_seed(0))
    ours = policy.token_logprobs(ids)
    theirs = _reference_logprobs(dense, ids)
    assert (ours - theirs).abs().max() < 1e-5
    with torch.no_grad(), policy.adapter_disabled(), dense.disable_adapter():
        base_delta = (policy.token_logprobs(ids) - _reference_logprobs(dense, ids)).abs().max()
    assert base_delta < 1e-5
    assert (ours.detach() - policy.token_logprobs(ids).detach()).abs().max() < 1e-6  # deterministic
    # the adapter matters: parity is not the no-adapter case
    with torch.no_grad(), policy.adapter_disabled():
        assert (ours.detach() - policy.token_logprobs(ids)).abs().mean() > 1e-3

    (ours * torch.linspace(-1, 1, ours.shape[-1])).sum().backward()
    (theirs * torch.linspace(-1, 1, theirs.shape[-1])).sum().backward()
    worst = max((ours_params[n].grad - theirs_params[n].grad).abs().max().item() for n in ours_params)
    scale = max(theirs_params[n].grad.abs().max().item() for n in theirs_params)
    print(f"{arch}: max |dlogp| {(ours - theirs).abs().max():.1e}, max |dgrad| {worst:.1e} (largest grad {scale:.1e})")
    assert scale > 1e-3 and worst < 1e-5, f"max |dgrad| {worst:.2e} (largest grad {scale:.2e})"


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_experts_stay_packed(arch, request):
    """Every routed and shared expert linear is an Int4Linear: packed bytes ~1/4 of bf16, no dense copy."""
    _, int4 = request.getfixturevalue("qwen3_moe" if arch == "qwen3_moe" else "deepseek")
    policy = load_policy(int4, AdapterSpec(rank=4, target_modules=["o_proj"]), dtype="bf16")
    blocks = [m for m in policy.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == (4 if arch == "qwen3_moe" else 3)  # DeepSeek-style: the first layer is dense
    expert_linears = [lin for b in blocks for e in b.experts for lin in (e.gate_proj, e.up_proj, e.down_proj)]
    assert len(expert_linears) == len(blocks) * 8 * 3
    packed = bf16 = 0
    for layer in expert_linears:
        assert isinstance(layer, Int4Linear) and layer.weight_packed.dtype == torch.int32
        packed += layer.weight_packed.nbytes + layer.weight_scale.nbytes
        bf16 += layer.in_features * layer.out_features * 2
    print(f"{arch}: packed expert bytes / bf16 = {packed / bf16:.4f}")
    assert 0.25 < packed / bf16 < 0.27  # int4 values + one bf16 scale per 128 weights
    for block in blocks:
        assert block.gate.weight.dtype == torch.bfloat16  # router unquantized, as in the checkpoint
        if arch == "deepseek_v3":
            assert isinstance(block.shared_experts.gate_proj, Int4Linear)
            assert block.gate.e_score_correction_bias.dtype == torch.float32
            assert block.gate.e_score_correction_bias.abs().sum() > 0  # the demo model's bias is set
    shapes = {(lin.out_features, lin.in_features) for lin in expert_linears}
    for name, tensor in policy.model.state_dict().items():
        if "embed_tokens" in name or "lm_head" in name:
            continue  # 16 bit by design (and [vocab 128, hidden 256] happens to be an expert's shape)
        assert not (tensor.is_floating_point() and tuple(tensor.shape) in shapes), f"dense expert tensor {name}"


def test_looped_experts_touch_only_chosen_experts():
    """The per-expert loop (the grouped compute's reference) calls only experts some token chose."""
    calls: list[int] = []

    class Probe(torch.nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

        def forward(self, x):
            calls.append(self.index)
            return x * (self.index + 1)

    experts = torch.nn.ModuleList(Probe(i) for i in range(6))
    x = torch.randn(4, 8)
    ids = torch.tensor([[0, 3], [3, 0], [5, 3], [0, 5]])
    weights = torch.rand(4, 2)
    out = looped_expert_forward(x, weights, ids, experts)
    assert calls == [0, 3, 5]
    expected = torch.stack([sum(weights[n, k] * x[n] * (ids[n, k] + 1) for k in range(2)) for n in range(4)])
    assert torch.allclose(out, expected, atol=1e-6)


def test_deepseek_routing_respects_groups_and_bias():
    """Group-limited choice: experts come from the best group only; the bias steers the choice
    but not the weights; weights renormalise then scale."""
    spec = RoutingSpec(8, 2, "sigmoid", True, num_groups=2, topk_groups=1, scaling_factor=2.5, correction_bias=True)
    logits = torch.tensor([[3.0, -1.0, -1.0, -1.0, 2.0, 2.5, -3.0, -3.0]])
    weights, ids = select_experts(logits, spec, torch.zeros(8))
    assert sorted(ids[0].tolist()) == [4, 5]  # group 1's top two beat group 0's (3.0 + -1.0)
    assert torch.allclose(weights.sum(), torch.tensor(2.5))
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -5.0, 0.0, 0.0])
    weights, ids = select_experts(logits, spec, bias)
    assert 5 not in ids[0].tolist() and 0 in ids[0].tolist()  # bias sinks group 1 and expert 5
    chosen = torch.sigmoid(logits[0, ids[0]])
    assert torch.allclose(weights[0], chosen / chosen.sum() * 2.5)  # weights from the unbiased scores


def test_unsupported_moe_architecture_is_named(qwen3_moe, tmp_path):
    """qwen2_moe and mixtral quantize but do not train: the error says so and names the file."""
    import json
    import shutil

    from orbit_runtime.errors import OrbitError

    _, int4 = qwen3_moe
    other = tmp_path / "qwen2-moe-int4"
    shutil.copytree(int4, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "qwen2_moe"}))
    with pytest.raises(OrbitError, match=r"config\.json: the learner does not load qwen2_moe models.*deepseek_v3"):
        load_policy(other, AdapterSpec(rank=4), dtype="fp32")


def _give_fused_experts_lora(reference: torch.nn.Module, learner: dict[str, torch.Tensor], scale: float) -> dict:
    """Put the learner's per-expert LoRA into transformers' fused experts, differentiably.

    Each fused tensor becomes W_e + scale * B_e @ A_e, recomputed at every forward from leaf
    copies of the learner's lora_A / lora_B (returned by the learner's parameter names).
    """
    leaves = {name: value.detach().clone().requires_grad_(True) for name, value in learner.items() if ".experts." in name}

    def delta(prefix: str, expert: int, proj: str) -> torch.Tensor:
        key = f"{prefix}.{expert}.{proj}.lora_{{}}.default.weight"
        return scale * leaves[key.format("B")] @ leaves[key.format("A")]

    for name, module in reference.named_modules():
        if type(module).__name__ != "Qwen3MoeExperts":
            continue
        gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
        del module.gate_up_proj, module.down_proj  # plain tensors from now on, rebuilt before each forward

        def rebuild(mod, _args, prefix=name, gate_up=gate_up, down=down):
            experts = range(gate_up.shape[0])
            mod.gate_up_proj = gate_up + torch.stack(
                [torch.cat([delta(prefix, e, "gate_proj"), delta(prefix, e, "up_proj")]) for e in experts]
            )
            mod.down_proj = down + torch.stack([delta(prefix, e, "down_proj") for e in experts])

        module.register_forward_pre_hook(rebuild)
    return leaves


def test_routed_expert_lora_equals_transformers_with_the_same_weight_deltas(qwen3_moe):
    """Routed-expert LoRA (grouped, per expert) against transformers' fused experts holding
    W + scale * B @ A: log-probs and the gradients of every expert's lora_A and lora_B within 1e-5."""
    from peft import get_peft_model

    from orbit_runtime.learner.model import lora_config

    src, int4 = qwen3_moe
    adapter = AdapterSpec(rank=4, alpha=8, target_modules=QWEN3_TARGETS + ["gate_proj", "up_proj", "down_proj"],
                          routed_experts=True)  # fmt: skip
    policy = load_policy(int4, adapter, dtype="fp32")
    policy.init_adapter_randomly(std=0.05, seed=2)
    ours_params = {n: p for n, p in policy.model.named_parameters() if p.requires_grad}
    assert sum(".experts." in n for n in ours_params) == 4 * 8 * 3 * 2

    reference = load_dequantized_dense_model(src, int4)
    with per_expert_peft_layout(reference):  # attention LoRA through PEFT; experts' LoRA by hand below
        dense = get_peft_model(reference, lora_config(AdapterSpec(rank=4, alpha=8, target_modules=QWEN3_TARGETS)))
    dense.eval()
    theirs_params = {n: p for n, p in dense.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, param in theirs_params.items():
            param.copy_(ours_params[name])
    expert_leaves = _give_fused_experts_lora(dense, ours_params, scale=adapter.alpha / adapter.rank)
    theirs_params.update(expert_leaves)
    assert set(theirs_params) == set(ours_params)

    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    ours, theirs = policy.token_logprobs(ids), _reference_logprobs(dense, ids)
    assert (ours - theirs).abs().max() < 1e-5
    with torch.no_grad(), policy.adapter_disabled():  # the expert LoRA matters
        assert (ours.detach() - policy.token_logprobs(ids)).abs().mean() > 1e-3
    weights = torch.linspace(-1, 1, ours.shape[-1])
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()

    def grad(param: torch.Tensor) -> torch.Tensor:  # an expert no token chose is never called: no grad
        return param.grad if param.grad is not None else torch.zeros_like(param)

    expert_names = [n for n in ours_params if ".experts." in n]
    assert sum(bool(grad(ours_params[n]).abs().sum() > 0) for n in expert_names) > len(expert_names) // 2
    worst = max((grad(ours_params[n]) - grad(theirs_params[n])).abs().max().item() for n in ours_params)
    print(f"routed-expert LoRA: max |dlogp| {(ours - theirs).abs().max():.1e}, max |dgrad| {worst:.1e}")
    assert worst < 1e-5


def test_routing_matches_vllms_grouped_topk():
    """The same logits give the same experts and weights as vLLM's native routing function."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(512, 8, generator=generator) * 3
    hidden = torch.zeros(512, 4)
    bias = torch.randn(8, generator=generator) * 0.3
    qwen = RoutingSpec(8, 2, "softmax", True)
    deepseek = RoutingSpec(8, 2, "sigmoid", True, num_groups=2, topk_groups=1, scaling_factor=2.5, correction_bias=True)
    cases = [
        (qwen, None, dict(num_expert_group=1, topk_group=1, scoring_func="softmax")),
        (deepseek, bias, dict(num_expert_group=2, topk_group=1, scoring_func="sigmoid", routed_scaling_factor=2.5,
                              e_score_correction_bias=bias)),
    ]  # fmt: skip
    for spec, correction, vllm_kwargs in cases:
        weights, ids = select_experts(logits, spec, correction)
        theirs_weights, theirs_ids = grouped_topk(hidden, logits, topk=2, renormalize=True, **vllm_kwargs)
        ours_sorted, order = ids.sort(-1)
        theirs_sorted, theirs_order = theirs_ids.long().sort(-1)
        assert torch.equal(ours_sorted, theirs_sorted), spec.scoring
        assert torch.allclose(weights.gather(1, order), theirs_weights.gather(1, theirs_order), atol=1e-6)


def test_deepseek_checkpoint_extras(deepseek, tmp_path):
    """The demo config names DeepSeek-V3's routing for vLLM; the MTP layer (61) transformers
    drops on load is dropped here too; another routing is refused naming the fields."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from orbit_runtime.errors import OrbitError

    _, int4 = deepseek
    config = json.loads((int4 / "config.json").read_text())
    assert (config["scoring_func"], config["topk_method"]) == ("sigmoid", "noaux_tc")
    with_mtp = tmp_path / "with-mtp"
    shutil.copytree(int4, with_mtp)
    tensors = load_file(with_mtp / "model.safetensors")
    save_file({**tensors, "model.layers.61.enorm.weight": torch.ones(256)}, with_mtp / "model.safetensors")
    load_policy(with_mtp, AdapterSpec(rank=4, target_modules=["o_proj"]), dtype="fp32")
    (with_mtp / "config.json").write_text(json.dumps({**config, "scoring_func": "softmax"}))
    with pytest.raises(OrbitError, match="scoring_func='softmax'"):
        load_policy(with_mtp, AdapterSpec(rank=4, target_modules=["o_proj"]), dtype="fp32")


def test_adapter_targets_vllm_would_not_serve_are_refused():
    """kv_b_proj LoRA on DeepSeek-V3: vLLM's MLA folds the projection into its attention kernel and
    never calls a LoRA layer on it, so the trainer refuses it, naming the field; elsewhere it is fine."""
    from orbit_runtime.config.adapter import check_served_targets
    from orbit_runtime.errors import OrbitError

    adapter = AdapterSpec(target_modules=DEEPSEEK_TARGETS)
    with pytest.raises(OrbitError, match=r"adapter\.target_modules \['kv_b_proj'\].*deepseek_v3"):
        check_served_targets("deepseek_v3", adapter)
    check_served_targets("deepseek_v3", AdapterSpec(target_modules=[t for t in DEEPSEEK_TARGETS if t != "kv_b_proj"]))
    check_served_targets("qwen3_moe", AdapterSpec(target_modules=["kv_b_proj", "q_proj"]))


def test_the_trainer_refuses_kv_b_proj_lora_on_deepseek_before_loading_anything(deepseek, tmp_path):
    from orbit_runtime.config.spec import JobSpec
    from orbit_runtime.errors import OrbitError
    from orbit_runtime.trainer.loop import Trainer

    _, int4 = deepseek
    spec = JobSpec.model_validate({
        "model": {"path": str(int4)}, "adapter": {"target_modules": DEEPSEEK_TARGETS},
        "run": {"name": "refused", "output_dir": str(tmp_path / "runs")},
    })  # fmt: skip
    with pytest.raises(OrbitError, match=r"adapter\.target_modules \['kv_b_proj'\]"):
        Trainer(spec)
