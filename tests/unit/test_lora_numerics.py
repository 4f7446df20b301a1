"""The learner's LoRA forward rounds where vLLM's LoRA kernels round (learner/lora_numerics.py),
checked against vLLM's own CPU kernels (`vllm.lora.ops.torch_ops`), and still trains fp32 masters."""

import pytest
import torch
from peft import get_peft_model

from orbit_runtime.config import AdapterSpec
from orbit_runtime.learner.lora_numerics import VllmRoundedLoraLinear
from orbit_runtime.learner.model import lora_config


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(256, 128, bias=False)

    def forward(self, x):
        return self.q_proj(x)


def _wrapped(rounding: str, dtype: torch.dtype):
    torch.manual_seed(0)
    base = _Tiny().to(dtype).requires_grad_(False)
    config = lora_config(AdapterSpec(rank=8, alpha=32, target_modules=["q_proj"]), lora_rounding=rounding)
    config.task_type = None  # a bare module, not a causal LM
    model = get_peft_model(base, config)
    layer = model.base_model.model.q_proj
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.randn(8, 256) * 0.05)
        layer.lora_B["default"].weight.copy_(torch.randn(128, 8) * 0.05)
    return model, layer


def _vllm(layer, x: torch.Tensor) -> torch.Tensor:
    """What vLLM's CPU punica path computes for this layer (lora_model.from_local_checkpoint, optimize, add_lora_linear)."""
    from vllm.lora.ops.torch_ops import bgmv_expand, bgmv_shrink

    act = x.dtype
    a = layer.lora_A["default"].weight.detach().to(act)
    b = layer.lora_B["default"].weight.detach().to(act)
    b *= layer.scaling["default"]  # LoRALayerWeights.optimize(), in place in the model dtype
    y = layer.base_layer(x)
    buffer = torch.zeros((x.shape[0], a.shape[0]), dtype=torch.float32)  # punica_cpu's fp32 shrink buffer
    indices = torch.zeros(x.shape[0], dtype=torch.long)
    bgmv_shrink(x, a.unsqueeze(0), buffer, indices, 1.0)
    bgmv_expand(buffer, b.unsqueeze(0), y, indices, add_inputs=True)
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounded_lora_computes_what_vllm_serves(dtype):
    x = torch.randn(64, 256).to(dtype)
    _, rounded = _wrapped("vllm", dtype)
    _, plain = _wrapped("fp32", dtype)
    assert isinstance(rounded, VllmRoundedLoraLinear) and not isinstance(plain, VllmRoundedLoraLinear)
    with torch.no_grad():
        served, ours, peft = _vllm(rounded, x).float(), rounded(x).float(), plain(x).float()
    ours_error, peft_error = (ours - served).abs(), (peft - served).abs()
    assert ours_error.max() == 0, f"max {ours_error.max():.3e}"  # bit for bit
    assert peft_error.max() > 0  # PEFT's single fp32 delta rounds elsewhere


def test_gradients_reach_the_fp32_masters():
    model, layer = _wrapped("vllm", torch.bfloat16)
    x = torch.randn(16, 256).to(torch.bfloat16)
    model(x).float().pow(2).sum().backward()
    for name in ("lora_A", "lora_B"):
        weight = getattr(layer, name)["default"].weight
        assert weight.dtype == torch.float32 and weight.grad is not None and weight.grad.dtype == torch.float32
        assert float(weight.grad.abs().max()) > 0
    _, fp32_layer = _wrapped("vllm", torch.float32)  # nothing to round in an fp32 learner: PEFT's forward
    x32 = torch.randn(4, 256)
    _, plain = _wrapped("fp32", torch.float32)
    assert torch.equal(fp32_layer(x32), plain(x32))


def test_the_trainer_s_default_is_vllm_rounding_on_every_lora_linear(int4_dir):
    from orbit_runtime.config import parse_job_spec
    from orbit_runtime.learner.model import load_policy

    rounding = parse_job_spec({"model": {"path": str(int4_dir)}}).learner.lora_rounding
    assert rounding == "vllm"
    policy = load_policy(int4_dir, AdapterSpec(rank=4, alpha=8), dtype="bf16", lora_rounding=rounding)
    wrapped = [m for m in policy.model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert wrapped and all(isinstance(m, VllmRoundedLoraLinear) for m in wrapped)
