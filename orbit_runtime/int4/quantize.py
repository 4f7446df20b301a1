"""Hugging Face checkpoint -> INT4 checkpoint, streamed one safetensors shard at a time.

Memory stays at about one shard (input tensors are read one by one, output is one shard),
so a model far larger than RAM can be converted. The output is written to a temporary
sibling directory and renamed into place at the end: DST is either complete or absent.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from orbit_runtime.atomic_dir import atomic_directory
from orbit_runtime.config.quantization import DEFAULT_IGNORE, matches_any
from orbit_runtime.errors import OrbitError
from orbit_runtime.int4.base_digest import write_base_manifest
from orbit_runtime.int4.schemes import WeightScheme

# Architectures whose checkpoint tensor names we know: every 2-D `*.weight` is a linear
# layer unless it is an embedding, the LM head or an MoE router (kept in 16 bit).
SUPPORTED_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "MixtralForCausalLM",
        "DeepseekV3ForCausalLM",
    }
)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class QuantizeReport:
    """What `quantize_checkpoint` did, for the CLI to print."""

    quantized_modules: int = 0
    kept_tensors: int = 0
    source_bytes: int = 0
    output_bytes: int = 0
    seconds: float = 0.0
    ignored_modules: list[str] = field(default_factory=list)
    base_digest: str = ""  # content digest of DST, recorded in its base manifest (see base_digest.py)


def list_shards(src: Path) -> list[Path]:
    """The safetensors shards of a checkpoint directory, in index order."""
    if (src / INDEX_FILE).is_file():
        weight_map = json.loads((src / INDEX_FILE).read_text())["weight_map"]
        return [src / name for name in sorted(set(weight_map.values()))]
    if (src / SINGLE_FILE).is_file():
        return [src / SINGLE_FILE]
    raise OrbitError(f"{src}: not a Hugging Face checkpoint (no {SINGLE_FILE} or {INDEX_FILE})")


def read_source_config(src: Path) -> dict:
    """config.json of SRC, checked for a supported, not yet quantized architecture."""
    if not src.is_dir():
        raise OrbitError(f"{src}: not a directory")
    config_path = src / "config.json"
    if not config_path.is_file():
        raise OrbitError(f"{src}: not a Hugging Face checkpoint (no config.json)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise OrbitError(f"{config_path}: invalid JSON ({exc})") from exc
    architectures = config.get("architectures") or []
    if not any(arch in SUPPORTED_ARCHITECTURES for arch in architectures):
        raise OrbitError(
            f"{config_path}: unsupported architecture {architectures or config.get('model_type')}; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method")
        raise OrbitError(f"{config_path}: checkpoint is already quantized ({method})")
    return config


def is_quantization_target(tensor_name: str, ndim: int, ignore: tuple[str, ...]) -> bool:
    """A 2-D `<module>.weight` whose module is not ignored."""
    if ndim != 2 or not tensor_name.endswith(".weight"):
        return False
    return not matches_any(tensor_name.removesuffix(".weight"), ignore)


def quantize_checkpoint(
    src: Path,
    dst: Path,
    scheme: WeightScheme,
    *,
    extra_ignore: tuple[str, ...] = (),
    overwrite: bool = False,
) -> QuantizeReport:
    """Convert checkpoint SRC into a compressed-tensors INT4 checkpoint at DST."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    config = read_source_config(src)
    shards = list_shards(src)
    if dst.exists() and not overwrite:
        raise OrbitError(f"{dst}: already exists (pass --overwrite to replace it)")
    if dst.resolve() == src.resolve():
        raise OrbitError(f"{dst}: destination must differ from the source")
    ignore = DEFAULT_IGNORE + tuple(extra_ignore)
    started = time.monotonic()
    report = QuantizeReport()

    # Pass 1 (headers only): reject bad shapes before writing anything.
    ignored: set[str] = set()
    for shard in shards:
        with safe_open(shard, framework="pt") as reader:
            for name in reader.keys():
                shape = tuple(reader.get_slice(name).get_shape())
                if len(shape) >= 3 and "expert" in name:
                    raise OrbitError(
                        f"{shard.name}: {name} is a fused 3-D expert tensor; convert the checkpoint "
                        "to per-expert linear weights first"
                    )
                if is_quantization_target(name, len(shape), ignore):
                    scheme.check_shape(name, shape)
                elif len(shape) == 2 and name.endswith(".weight"):
                    ignored.add(name.removesuffix(".weight"))

    with atomic_directory(dst) as staging:
        weight_map: dict[str, str] = {}
        for shard in shards:
            out: dict = {}
            with safe_open(shard, framework="pt") as reader:
                for name in reader.keys():
                    tensor = reader.get_tensor(name)
                    report.source_bytes += tensor.numel() * tensor.element_size()
                    if is_quantization_target(name, tensor.ndim, ignore):
                        module = name.removesuffix(".weight")
                        for suffix, value in scheme.compress(tensor).items():
                            out[f"{module}.{suffix}"] = value
                        report.quantized_modules += 1
                    else:
                        out[name] = tensor
                        report.kept_tensors += 1
            save_file(out, staging / shard.name, metadata={"format": "pt"})
            report.output_bytes += sum(t.numel() * t.element_size() for t in out.values())
            weight_map.update({name: shard.name for name in out})
            del out

        if (src / INDEX_FILE).is_file():
            index = {"metadata": {"total_size": report.output_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2))
        for item in src.iterdir():  # tokenizer, generation config, chat template, ...
            if item.is_file() and item.suffix != ".safetensors" and item.name not in ("config.json", INDEX_FILE):
                shutil.copy2(item, staging / item.name)
        # lm_head is listed even when tied to the embeddings (absent from the checkpoint),
        # so no reader mistakes it for a quantized linear.
        report.ignored_modules = sorted(ignored | {"lm_head"})
        config["quantization_config"] = scheme.quantization_config(ignore=report.ignored_modules)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        # Last: the manifest's digest covers exactly the files written above.
        report.base_digest = write_base_manifest(staging)
    report.seconds = time.monotonic() - started
    return report
