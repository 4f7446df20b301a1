"""A dense model holding the dequantized INT4 weights: the yardstick for the packed learner.

It computes what the learner should compute, with ordinary `nn.Linear` layers. It holds
the whole base densely, so it is for checks and benchmarks, never for training.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from orbit_runtime.int4.packing import dequantize_int4
from orbit_runtime.int4.quantize import list_shards


def load_dequantized_dense_model(source_dir: Path, int4_dir: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The 16-bit checkpoint SOURCE_DIR with each quantized linear replaced by its INT4 values."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source_dir, dtype=dtype)
    modules = dict(model.named_modules())
    for shard in list_shards(Path(int4_dir)):
        with safe_open(shard, framework="pt") as reader:
            for key in reader.keys():
                if key.endswith(".weight_packed"):
                    name = key.removesuffix(".weight_packed")
                    module = modules[name]
                    module.weight.data = dequantize_int4(
                        reader.get_tensor(key), reader.get_tensor(f"{name}.weight_scale"), module.in_features, dtype
                    )
    model.eval()
    return model
