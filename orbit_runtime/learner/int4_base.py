"""The frozen INT4 base as the learner holds it: packed linears, everything else in 16 bit.

`load_int4_base` builds the transformer on the meta device (no memory), replaces MoE blocks
by per-expert ones (`moe.py`), swaps every quantized linear for an `Int4Linear`, then
fills packed weights and 16-bit tensors shard by shard.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from orbit_runtime.errors import OrbitError
from orbit_runtime.int4.quantize import list_shards
from orbit_runtime.int4.schemes import QuantizedCheckpointInfo, read_quantization_config
from orbit_runtime.learner.int4_linear import Int4Linear
from orbit_runtime.learner.moe import MOE_BLOCK_CLASSES, replace_moe_blocks

# MoE architectures `orbit quantize` writes but the learner cannot train yet
UNSUPPORTED_MOE_TYPES = {"qwen2_moe", "mixtral"}
FP32_TENSOR_SUFFIXES = ("e_score_correction_bias",)  # routing biases stay fp32 whatever the dtype


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def materialise_rotary(model: nn.Module, config) -> None:
    """Rotary embeddings keep a non-persistent `inv_freq` buffer that is not in the checkpoint."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            set_submodule(model, name, type(module)(config=config))


def tied_weight_keys(model: nn.Module, config) -> dict[str, str]:
    """{target: source} of the weights the config ties, e.g. {"lm_head.weight": "model.embed_tokens.weight"}."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    if expand is not None:  # transformers 5: reads each (sub)model's config.tie_word_embeddings
        return dict(expand(all_submodels=True))
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if not getattr(text_config, "tie_word_embeddings", False):
        return {}
    output, input_ = model.get_output_embeddings(), model.get_input_embeddings()
    names = {id(module): name for name, module in model.named_modules()}
    if output is None or input_ is None or id(output) not in names or id(input_) not in names:
        return {}
    return {f"{names[id(output)]}.weight": f"{names[id(input_)]}.weight"}


def tie(model: nn.Module, target: str, source: str) -> None:
    """Make parameter TARGET the very same tensor as SOURCE (one copy in memory)."""
    parent_name, _, attr = target.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, model.get_parameter(source))


def meta_model(model_dir: Path, dtype: torch.dtype) -> tuple[nn.Module, object, QuantizedCheckpointInfo]:
    """The transformer of MODEL_DIR's config.json on the meta device (no memory), its config
    without the quantization block (the INT4 part is Orbit's), and the checkpoint's scheme."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise OrbitError(f"{model_dir}: not a model directory (no config.json)")
    raw_config = json.loads(config_path.read_text())
    info = read_quantization_config(raw_config, str(config_path))
    if raw_config.get("model_type") in UNSUPPORTED_MOE_TYPES:
        raise OrbitError(
            f"{config_path}: the learner does not load {raw_config['model_type']} models; "
            f"its MoE architectures are {sorted(MOE_BLOCK_CLASSES)}"
        )
    config = AutoConfig.from_pretrained(model_dir)
    config.quantization_config = None
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model, config, info


def load_int4_base(model_dir: Path, dtype: torch.dtype) -> tuple[nn.Module, QuantizedCheckpointInfo]:
    """The frozen base: quantized linears stay packed, other weights in `dtype`.

    The checkpoint may be split in any number of shards; each holds part of the tensors, so
    missing and unexpected tensors are judged against all shards together (from the shard
    headers, before any tensor is read). Tied embeddings (Qwen2.5 <= 3B, Qwen3 <= 4B, ...)
    are stored once: the LM head becomes the embedding tensor itself, not a copy.
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    model, config, info = meta_model(model_dir, dtype)
    if config.model_type in MOE_BLOCK_CLASSES:  # per-expert linears, so they can be packed and get LoRA
        replace_moe_blocks(model, config)

    # Headers only: which shard holds which tensor.
    shards = list_shards(model_dir)
    shard_of: dict[str, Path] = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as reader:
            for key in reader.keys():
                if not key.endswith(".weight_shape"):  # implied by the module's shape
                    shard_of.setdefault(key, shard)
    # Which linears are packed is read off the checkpoint itself (`<module>.weight_packed` or
    # `.weight_scale`), so a tied LM head or a module ignored at quantization time stays dense.
    # Tensors transformers itself drops on load (DeepSeek-V3's multi-token-prediction layer 61).
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    shard_of = {k: v for k, v in shard_of.items() if not any(p.search(k) for p in ignored)}
    packed_modules = {k.rsplit(".", 1)[0] for k in shard_of if k.endswith((".weight_packed", ".weight_scale"))}
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and name in packed_modules:
            set_submodule(
                model,
                name,
                Int4Linear(
                    module.in_features,
                    module.out_features,
                    group_size=info.scheme.group_size,
                    bias=module.bias is not None,
                    dtype=dtype,
                    device="meta",
                ),
            )

    expected = set(model.state_dict().keys())  # tied weights appear under both names
    present = set(shard_of)
    unexpected = sorted(present - expected)
    if unexpected:
        shard = shard_of[unexpected[0]]
        in_shard = [k for k in unexpected if shard_of[k] == shard]
        raise OrbitError(f"{shard}: tensors the model does not have: {in_shard[:5]}")
    # A tied pair is stored once (safetensors never holds shared tensors twice): the absent
    # name is tied to the present one after loading.
    ties: list[tuple[str, str]] = []
    both_stored: list[tuple[str, str]] = []  # e.g. converted from a .bin checkpoint
    for target, source in tied_weight_keys(model, config).items():
        if target not in expected or source not in expected:
            continue
        if target not in present and source in present:
            ties.append((target, source))
        elif source not in present and target in present:
            ties.append((source, target))
        elif source in present and target in present:
            both_stored.append((target, source))
    missing = sorted(expected - present - {target for target, _ in ties})
    if missing:
        raise OrbitError(f"{model_dir}: checkpoint lacks {missing[:5]} ({len(missing)} tensors)")

    for shard in shards:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(shard, framework="pt") as reader:
            for key in reader.keys():
                if shard_of.get(key) != shard:
                    continue
                tensor = reader.get_tensor(key)
                if tensor.is_floating_point():
                    tensor = tensor.float() if key.endswith(FP32_TENSOR_SUFFIXES) else tensor.to(dtype)
                tensors[key] = tensor
        # strict=False: a shard holds only part of the model (completeness was checked above)
        try:
            model.load_state_dict(tensors, strict=False, assign=True)
        except RuntimeError as exc:  # a tensor of the wrong shape
            raise OrbitError(f"{shard}: does not fit the model in config.json ({exc})") from None
        del tensors
    for target, source in ties:
        tie(model, target, source)
    for target, source in both_stored:  # tie only identical copies, as transformers does
        if torch.equal(model.get_parameter(target), model.get_parameter(source)):
            tie(model, target, source)
    finish_frozen(model, config, lambda names: RuntimeError(f"tensors left unloaded on the meta device: {names}"))
    return model, info


def finish_frozen(model: nn.Module, config, lacking) -> None:
    """The last steps of building a frozen base: rotary tables, no tensor left on the meta device
    (else raise LACKING(first names)), no gradients, eval mode."""
    materialise_rotary(model, config)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise lacking(still_meta[:5])
    model.requires_grad_(False)
    model.eval()
