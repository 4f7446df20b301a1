"""LoRA computed with vLLM's rounding, so the learner's forward is the rollout's.

PEFT keeps the adapter in fp32 and adds one fp32 delta to the base output before casting
back: y = act(y_base + B(A(x)) * s). vLLM holds the adapter in the model dtype (`lora_dtype`
auto; it offers no fp32) and computes it in its punica kernels (on CPU
`vllm/lora/ops/torch_ops`): A and B are cast to the model dtype at load, the scaling s is
folded into B in the model dtype (`LoRALayerWeights.optimize`), the shrink x @ A^T runs in
fp32 (punica's fp32 buffer), its result is cast to the model dtype, the expand @ B^T is
rounded once to the model dtype (`rounded_linear`, as Orbit's LoRA fast path in vLLM computes
it) and is added to the base output in the model dtype.

`VllmRoundedLoraLinear` makes the same roundings in the forward, through casts autograd
passes gradients through (straight-through): the trainable weights stay fp32 masters and
their gradients land there. In an fp32 learner nothing is rounded and PEFT's forward runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as LoraLinear

from orbit_runtime.rounded_matmul import rounded_linear


class VllmRoundedLoraLinear(LoraLinear):
    """PEFT's LoRA Linear whose adapter delta is rounded where vLLM rounds it (module docstring)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        plain = self.disable_adapters or self.merged or "adapter_names" in kwargs or any(
            a in self.lora_variant for a in self.active_adapters
        )
        if plain or x.dtype == torch.float32:
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        act = result.dtype
        for adapter in self.active_adapters:
            if adapter not in self.lora_A:
                continue
            a_served = self.lora_A[adapter].weight.to(act)  # vLLM loads the adapter in the model dtype
            b_served = self.lora_B[adapter].weight.to(act) * self.scaling[adapter]  # scaling folded into B, in act
            shrunk = F.linear(self.lora_dropout[adapter](x).float(), a_served.float())  # shrink into fp32
            result = result + rounded_linear(shrunk.to(act), b_served)  # expand rounded to the model dtype, added in it
        return result
