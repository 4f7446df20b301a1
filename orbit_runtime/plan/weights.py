"""Bytes of the frozen base and of the LoRA adapter, whole or on one of N GPUs.

The base is what `orbit quantize` writes (or what a compressed-tensors checkpoint says):
every linear but the routers not matched by the ignore patterns becomes INT4 (`weight_packed`, 4 bits a
weight, plus one scale per group of input columns); embeddings, the LM head, routers,
norms, biases and ignored linears stay 16-bit (the learner holds them in its own dtype,
fp32 included); DeepSeek's routing correction bias is fp32.

On N GPUs the base is split as vLLM splits it (tensor parallel for attention and dense
MLPs, the experts over the ranks, the vocabulary over the ranks); MLA's down-projections,
routers and norms are whole on every GPU, and KV heads are replicated once there are more
ranks than heads.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from orbit_runtime.config.quantization import DEFAULT_IGNORE, matches_any
from orbit_runtime.plan.architecture import Architecture, PlanError
from orbit_runtime.plan.parameters import Linear, layer_norm_params, model_linears
from orbit_runtime.plan.request import PlanRequest

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
LEARNER_LORA_BYTES = 4 + 4 + 8 + 12  # fp32 weight, its gradient, AdamW's two moments, the step snapshot (weight + moments)


@dataclass(frozen=True)
class Quantization:
    group_size: int
    scale_dtype: str
    ignore: tuple[str, ...]
    source: str  # where these settings come from, for the report


def quantization_of(arch: Architecture, request: PlanRequest) -> Quantization:
    """The checkpoint's own compressed-tensors INT4 config if it has one, else what `orbit quantize` would write."""
    qc = arch.quantization_config
    if qc and qc.get("quant_method") == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        weights = (groups[0].get("weights") or {}) if len(groups) == 1 else {}
        if not (weights.get("num_bits") == 4 and weights.get("strategy") == "group" and weights.get("group_size")):
            raise PlanError(f"{arch.source}: quantization_config is not one group of 4-bit per-group weights ({weights})")
        return Quantization(int(weights["group_size"]), request.scale_dtype, tuple(qc.get("ignore") or ()),
                            "the checkpoint's quantization_config")  # fmt: skip
    ignore = request.ignore if request.ignore is not None else DEFAULT_IGNORE
    source = "orbit quantize" + ("" if request.ignore is None else " with the given --ignore")
    if qc:
        source += f" (replacing the checkpoint's {qc.get('quant_method')} quantization)"
    return Quantization(request.group_size, request.scale_dtype, tuple(ignore), source)


def _divisor(shard: str, gpus: int, kv_heads: int) -> int:
    return {"split": gpus, "kv": min(gpus, kv_heads), "replicated": 1}[shard]


@dataclass(frozen=True)
class BaseWeights:
    """The base's tensors by how they shard: packed INT4 bytes, scale / 16-bit / fp32 element counts."""

    packed_bytes: dict[str, int]
    scale_elements: dict[str, int]
    dense_elements: dict[str, int]
    fp32_elements: int
    int4_params: int
    dense_params: int
    kv_heads: int
    group_size: int
    split_shapes: tuple[tuple[str, int, int, bool], ...]  # (suffix, in, out, INT4) of each distinct tensor-parallel linear

    def on_gpu(self, gpus: int, dtype: str, scale_dtype: str | None = None) -> tuple[int, int]:
        """(INT4 bytes, 16-bit bytes) on one of GPUS GPUs, 16-bit parts in DTYPE. Scales are in the
        computing process's dtype (vLLM and the learner both convert them) unless SCALE_DTYPE says
        otherwise (the checkpoint on disk)."""
        n = max(gpus, 1)
        packed = sum(b // _divisor(s, n, self.kv_heads) for s, b in self.packed_bytes.items())
        scales = sum(e // _divisor(s, n, self.kv_heads) for s, e in self.scale_elements.items()) * DTYPE_BYTES[scale_dtype or dtype]
        dense = sum(e // _divisor(s, n, self.kv_heads) for s, e in self.dense_elements.items()) * DTYPE_BYTES[dtype]
        return packed + scales, dense + self.fp32_elements * 4


def is_int4(linear: Linear, quantization: Quantization) -> bool:
    """Not ignored, and not a router: routers stay 16-bit whatever the patterns say (vLLM builds them
    unquantized, and DeepSeek's gate is no Linear module for compressed-tensors to target)."""
    return linear.kind != "router" and not matches_any(linear.name, quantization.ignore)


def base_weights(arch: Architecture, quantization: Quantization) -> BaseWeights:
    packed: dict[str, int] = defaultdict(int)
    scales: dict[str, int] = defaultdict(int)
    dense: dict[str, int] = defaultdict(int)
    int4_params = dense_params = 0
    shapes = set()
    for linear in model_linears(arch):
        weights = linear.count * linear.in_features * linear.out_features
        if linear.shard == "split" and linear.kind != "lm_head":
            shapes.add((linear.suffix, linear.in_features, linear.out_features, is_int4(linear, quantization)))
        if linear.bias:
            dense[linear.shard] += linear.count * linear.out_features
        if is_int4(linear, quantization):
            if linear.in_features % quantization.group_size:
                raise PlanError(f"{arch.source}: {linear.name}: input dimension {linear.in_features} is not divisible by the "
                                f"group size {quantization.group_size} (orbit quantize would refuse it)")  # fmt: skip
            packed[linear.shard] += weights // 2
            scales[linear.shard] += linear.count * linear.out_features * (linear.in_features // quantization.group_size)
            int4_params += weights
        else:
            dense["split" if linear.kind == "lm_head" else linear.shard] += weights
            dense_params += weights
    dense["split"] += arch.vocab * arch.hidden  # the embedding, vocabulary-parallel (the LM head too when tied)
    dense["replicated"] += arch.layers * layer_norm_params(arch) + arch.hidden
    moe = arch.moe
    fp32 = moe.experts * len(moe.layers) if moe is not None and moe.correction_bias else 0
    kv_heads = arch.attention.kv_heads if arch.attention.kind == "gqa" else arch.attention.heads
    return BaseWeights(dict(packed), dict(scales), dict(dense), fp32, int4_params, dense_params + arch.vocab * arch.hidden, kv_heads,
                       quantization.group_size, tuple(sorted(shapes)))  # fmt: skip


def peft_targets(linear: Linear, request: PlanRequest) -> bool:
    """Does the adapter wrap LINEAR? PEFT's rule (the module name, or its last components, is a target);
    routed experts only with adapter.routed_experts, as the learner configures PEFT."""
    if linear.kind == "routed_expert" and not request.routed_experts:
        return False
    return any(linear.name == t or linear.name.endswith("." + t) for t in request.targets)


def lora_params(linears: list[Linear], request: PlanRequest, gpus: int = 1, kv_heads: int = 1) -> int:
    """Adapter parameters (A: r x in, B: out x r per wrapped linear), on one of GPUS shards (split as the linear is)."""
    total = 0
    for linear in linears:
        if peft_targets(linear, request):
            total += linear.count * request.rank * (linear.in_features + linear.out_features) // _divisor(linear.shard, gpus, kv_heads)
    return total


def adapter_size(linears: list[Linear], request: PlanRequest) -> dict:
    """What the adapter costs (`orbit plan`'s "adapter"): parameters (of them on routed experts), the
    learner's fp32 weights, AdamW's moments, and the bytes one sync writes (the served dtype)."""
    params = lora_params(linears, request)
    routed = sum(linear.count * request.rank * (linear.in_features + linear.out_features)
                 for linear in linears if linear.kind == "routed_expert" and peft_targets(linear, request))  # fmt: skip
    return {
        "params": params,
        "routed_expert_params": routed,
        "learner_fp32_bytes": 4 * params,
        "optimizer_bytes": 8 * params,  # AdamW's two fp32 moments
        "sync_bytes_per_step": DTYPE_BYTES[request.dtype] * params,  # written in the dtype vLLM serves
    }


def vllm_lora_bytes(linears: list[Linear], request: PlanRequest, gpus: int, kv_heads: int = 1) -> int:
    """vLLM's adapter slots: it allocates max_loras adapters at max_lora_rank for every layer it can
    adapt (attention, MLPs, experts), whatever the adapter targets."""
    n = max(gpus, 1)
    params = sum(linear.count * request.rank * (linear.in_features + linear.out_features) // _divisor(linear.shard, n, kv_heads)
                 for linear in linears if linear.kind not in ("router", "lm_head"))  # fmt: skip
    return request.max_loras * params * DTYPE_BYTES[request.dtype]
