"""4-bit weight schemes Orbit can write and the learner can read.

A scheme knows three things: how to compress one 2-D weight into named tensors, the
`quantization_config` block vLLM reads from config.json, and how to dequantize back. Today
there is one, `w4a16` (compressed-tensors `pack-quantized`, symmetric INT4, per-group scales,
round to nearest). Another 4-bit format vLLM runs (e.g. NVFP4 on Blackwell) is one more
subclass registered in `SCHEMES`; the quantizer and the learner only talk to this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from orbit_runtime.errors import OrbitError
from orbit_runtime.int4.packing import dequantize_int4


class WeightScheme(ABC):
    """One 4-bit weight format: compress a weight, describe it to vLLM, dequantize it."""

    name: ClassVar[str]
    tensor_suffixes: ClassVar[tuple[str, ...]]  # what replaces `<module>.weight` on disk

    @abstractmethod
    def check_shape(self, tensor_name: str, shape: tuple[int, ...]) -> None:
        """Raise OrbitError if a weight of this shape cannot be stored in this scheme."""

    @abstractmethod
    def compress(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """Weight [out, in] -> {suffix: tensor} to store under `<module>.<suffix>`."""

    @abstractmethod
    def dequantize(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """{suffix: tensor} -> dense weight [out, in] in `dtype`."""

    @abstractmethod
    def quantization_config(self, ignore: list[str]) -> dict[str, Any]:
        """The `quantization_config` block of config.json, for vLLM and the learner."""


@dataclass(frozen=True)
class W4A16Int(WeightScheme):
    """compressed-tensors W4A16 `pack-quantized`: symmetric INT4, per-group scales, RTN."""

    group_size: int = 128
    name: ClassVar[str] = "w4a16"
    tensor_suffixes: ClassVar[tuple[str, ...]] = ("weight_packed", "weight_scale", "weight_shape")

    def _args(self):  # compressed-tensors QuantizationArgs; imported late (pulls in torch ops)
        from compressed_tensors.quantization import QuantizationArgs

        return QuantizationArgs(
            num_bits=4, type="int", symmetric=True, strategy="group", group_size=self.group_size, dynamic=False
        )

    def check_shape(self, tensor_name: str, shape: tuple[int, ...]) -> None:
        in_features = shape[-1]
        if in_features % self.group_size != 0:
            raise OrbitError(
                f"{tensor_name}: input dimension {in_features} is not divisible by the group size "
                f"{self.group_size}; pick a --group-size that divides it or --ignore this module"
            )

    def compress(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        # The arithmetic is compressed-tensors' own (calculate_qparams, quantize,
        # pack_to_int32), so the result is bit-identical to llmcompressor's W4A16 RTN.
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationScheme
        from compressed_tensors.quantization.utils import calculate_qparams

        out_features, in_features = weight.shape
        groups = weight.reshape(out_features, in_features // self.group_size, self.group_size)
        args = self._args()
        scale, zero_point = calculate_qparams(groups.amin(dim=-1), groups.amax(dim=-1), args)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        compressed = PackedQuantizationCompressor.compress(
            {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}, scheme
        )
        return {suffix: compressed[suffix].contiguous() for suffix in self.tensor_suffixes}

    def dequantize(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        in_features = int(tensors["weight_shape"][1])
        return dequantize_int4(tensors["weight_packed"], tensors["weight_scale"], in_features, dtype)

    def quantization_config(self, ignore: list[str]) -> dict[str, Any]:
        import compressed_tensors
        from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

        config = QuantizationConfig(
            config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=self._args())},
            format="pack-quantized",
            quantization_status="compressed",
            ignore=ignore,
        )
        return {
            "version": compressed_tensors.__version__,
            "quant_method": "compressed-tensors",
            "sparsity_config": {},
            "transform_config": {},
            **config.model_dump(exclude={"quant_method"}),
        }


SCHEMES: dict[str, type[WeightScheme]] = {W4A16Int.name: W4A16Int}


def make_scheme(name: str, group_size: int) -> WeightScheme:
    """Scheme by CLI name (`--scheme`)."""
    if name not in SCHEMES:
        raise OrbitError(f"--scheme {name!r} is not supported; choose one of {sorted(SCHEMES)}")
    if group_size <= 0 or group_size % 8 != 0:
        raise OrbitError(f"--group-size {group_size} must be a positive multiple of 8")
    return SCHEMES[name](group_size=group_size)


@dataclass(frozen=True)
class QuantizedCheckpointInfo:
    """What the learner needs from an INT4 checkpoint's config.json."""

    scheme: WeightScheme
    ignore: tuple[str, ...]


def read_quantization_config(config: dict[str, Any], source: str) -> QuantizedCheckpointInfo:
    """Parse config.json's quantization_config; reject anything but Orbit's INT4 formats."""
    qc = config.get("quantization_config")
    if not qc:
        raise OrbitError(f"{source}: no quantization_config; quantize it first with `orbit quantize`")
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        raise OrbitError(
            f"{source}: quantization_config is {qc.get('quant_method')}/{qc.get('format')}; "
            "the learner reads compressed-tensors pack-quantized (convert with `orbit quantize`)"
        )
    groups = list(qc.get("config_groups", {}).values())
    if len(groups) != 1:
        raise OrbitError(f"{source}: expected one quantization config group, found {len(groups)}")
    weights = groups[0].get("weights") or {}
    if not (
        weights.get("num_bits") == 4
        and weights.get("type") == "int"
        and weights.get("symmetric")
        and weights.get("strategy") == "group"
        and not groups[0].get("input_activations")
    ):
        raise OrbitError(f"{source}: unsupported weight quantization {weights}; expected symmetric INT4 per group")
    return QuantizedCheckpointInfo(scheme=W4A16Int(group_size=int(weights["group_size"])), ignore=tuple(qc.get("ignore", [])))
