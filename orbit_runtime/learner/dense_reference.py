"""A dense model holding the dequantized INT4 weights: the yardstick for the packed learner.

It computes what the learner should compute, with transformers' own modules (for MoE
models, its fused 3-D expert tensors and its own routing code). It holds the whole base
densely, so it is for checks and benchmarks, never for training.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from orbit_runtime.int4.packing import dequantize_int4
from orbit_runtime.int4.quantize import list_shards

# `<prefix>.experts.<e>.<proj>` of a per-expert checkpoint, held fused by transformers 5
ROUTED_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")


def _fused_expert_slice(modules: dict[str, nn.Module], name: str) -> tuple[torch.Tensor, int] | None:
    """The rows of a fused expert tensor (transformers 5) that hold per-expert linear NAME, and its in_features."""
    match = ROUTED_EXPERT.match(name)
    if match is None or match["experts"] not in modules:
        return None
    experts, expert = modules[match["experts"]], int(match["expert"])
    if match["proj"] == "down_proj":
        return experts.down_proj.data[expert], experts.down_proj.shape[-1]
    size = experts.gate_up_proj.shape[1] // 2  # [gate; up] along the output dimension
    rows = slice(0, size) if match["proj"] == "gate_proj" else slice(size, 2 * size)
    return experts.gate_up_proj.data[expert, rows], experts.gate_up_proj.shape[-1]


def load_dequantized_dense_model(source_dir: Path, int4_dir: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The 16-bit checkpoint SOURCE_DIR with each quantized linear replaced by its INT4 values."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=dtype)
    modules = dict(model.named_modules())
    for shard in list_shards(Path(int4_dir)):
        with safe_open(shard, framework="pt") as reader:
            for key in reader.keys():
                if not key.endswith(".weight_packed"):
                    continue
                name = key.removesuffix(".weight_packed")
                packed, scale = reader.get_tensor(key), reader.get_tensor(f"{name}.weight_scale")
                if name in modules:
                    module = modules[name]
                    module.weight.data = dequantize_int4(packed, scale, module.in_features, dtype)
                    continue
                fused = _fused_expert_slice(modules, name)
                if fused is None:
                    raise KeyError(f"{shard}: {name} is not a module of the transformers model")
                rows, in_features = fused
                rows.copy_(dequantize_int4(packed, scale, in_features, dtype))
    model.eval()
    return model
