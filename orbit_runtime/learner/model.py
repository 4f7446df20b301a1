"""The learner's policy: the packed INT4 base plus a trainable PEFT LoRA adapter.

`load_policy` builds the transformer on the meta device (no memory), swaps every quantized
linear for an `Int4Linear`, then fills packed weights and 16-bit tensors shard by shard. The
reference policy is the same object with the adapter disabled: no second copy of the base.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from orbit_runtime.config import AdapterSpec
from orbit_runtime.errors import OrbitError
from orbit_runtime.int4.quantize import list_shards
from orbit_runtime.int4.schemes import QuantizedCheckpointInfo, read_quantization_config
from orbit_runtime.learner.int4_linear import Int4Linear

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
MOE_MODEL_TYPES = {"qwen2_moe", "qwen3_moe", "mixtral"}


def parse_dtype(name: str) -> torch.dtype:
    """'bf16' | 'fp16' | 'fp32' -> torch dtype."""
    if name not in DTYPES:
        raise OrbitError(f"dtype {name!r} is not supported; choose bf16, fp16 or fp32")
    return DTYPES[name]


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def _materialise_rotary(model: nn.Module, config) -> None:
    """Rotary embeddings keep a non-persistent `inv_freq` buffer that is not in the checkpoint."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            _set_submodule(model, name, type(module)(config=config))


def load_int4_base(model_dir: Path, dtype: torch.dtype) -> tuple[nn.Module, QuantizedCheckpointInfo]:
    """The frozen base: quantized linears stay packed, other weights in `dtype`."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise OrbitError(f"{model_dir}: not a model directory (no config.json)")
    raw_config = json.loads(config_path.read_text())
    info = read_quantization_config(raw_config, str(config_path))
    if raw_config.get("model_type") in MOE_MODEL_TYPES:
        raise OrbitError(
            f"{config_path}: the learner does not load MoE models yet ({raw_config['model_type']}); `orbit quantize` and vLLM do"
        )
    config = AutoConfig.from_pretrained(model_dir)
    config.quantization_config = None  # we do the INT4 part ourselves
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")

    # Which linears are packed is read off the checkpoint itself (`<module>.weight_packed`),
    # so a tied LM head or a module ignored at quantization time stays dense.
    shards = list_shards(model_dir)
    packed_modules: set[str] = set()
    for shard in shards:
        with safe_open(shard, framework="pt") as reader:
            packed_modules |= {k.removesuffix(".weight_packed") for k in reader.keys() if k.endswith(".weight_packed")}
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and name in packed_modules:
            _set_submodule(
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

    expected = set(model.state_dict().keys())
    loaded: set[str] = set()
    for shard in shards:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(shard, framework="pt") as reader:
            for key in reader.keys():
                if key.endswith(".weight_shape"):
                    continue  # implied by the module's shape
                tensor = reader.get_tensor(key)
                tensors[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        unexpected = set(tensors) - expected
        if unexpected:
            raise OrbitError(f"{shard}: tensors the model does not have: {sorted(unexpected)[:5]}")
        model.load_state_dict(tensors, strict=True, assign=True)
        loaded |= set(tensors)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        loaded |= {k for k in expected if k.startswith("lm_head.")}
    missing = expected - loaded
    if missing:
        raise OrbitError(f"{model_dir}: checkpoint lacks {sorted(missing)[:5]} ({len(missing)} tensors)")
    _materialise_rotary(model, config)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise RuntimeError(f"tensors left unloaded on the meta device: {still_meta[:5]}")
    model.requires_grad_(False)
    model.eval()
    return model, info


@dataclass
class BaseMemory:
    """Bytes the frozen base occupies, split by storage kind."""

    packed_bytes: int  # int4 weights (int32 storage) + their scales
    dense_bytes: int  # embeddings, LM head, norms, biases (16 bit)
    quantized_params: int  # number of int4 weights


class Policy:
    """INT4 base + LoRA adapter: token log-probs with or without the adapter, adapter I/O."""

    def __init__(self, peft_model: nn.Module, dtype: torch.dtype, model_dir: Path) -> None:
        self.model = peft_model
        self.dtype = dtype
        self.model_dir = model_dir

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute each decoder layer in backward instead of storing its activations.

        RL learners (verl, TRL) enable it by default: activations, not the packed base,
        dominate the learner's memory at long sequence lengths.
        """
        if enabled:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.train()  # transformers checkpoints only in training mode (dropout is 0)
        else:
            self.model.gradient_checkpointing_disable()

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def base_memory(self) -> BaseMemory:
        packed = dense = count = 0
        for module in self.model.modules():
            if isinstance(module, Int4Linear):
                packed += module.weight_packed.nbytes + module.weight_scale.nbytes
                count += module.in_features * module.out_features
        for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if "lora_" in name or "weight_packed" in name or "weight_scale" in name:
                continue
            dense += tensor.nbytes
        return BaseMemory(packed_bytes=packed, dense_bytes=dense, quantized_params=count)

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """log p(token t | tokens < t) for t = 1..T-1: [B, T] ids -> [B, T-1] float32.

        Logits are taken in the model dtype and the log-softmax in float32, as vLLM does.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        return logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    def completion_logprobs(self, pairs: list[tuple[list[int], list[int]]], pad_id: int = 0) -> list[torch.Tensor]:
        """Per-token log-probs of each completion given its prompt: [(prompt, completion)] -> [[len(c)]].

        Sequences are right-padded into one batch; padding never affects earlier positions
        of a causal model, so each completion is scored exactly as on its own.
        """
        lengths = [len(p) + len(c) for p, c in pairs]
        width = max(lengths)
        ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(pairs), width), dtype=torch.long)
        for row, (prompt, completion) in enumerate(pairs):
            ids[row, : lengths[row]] = torch.tensor(prompt + completion)
            mask[row, : lengths[row]] = 1
        logprobs = self.token_logprobs(ids.to(self.device), mask.to(self.device))
        return [logprobs[row, len(p) - 1 : len(p) + len(c) - 1] for row, (p, c) in enumerate(pairs)]

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """A copy of the adapter's weights (to restore or compare later)."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def load_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy adapter weights in; the names must be exactly this adapter's parameters."""
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if set(state) != set(params):
            missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
            raise ValueError(f"adapter state does not match: missing {missing[:3]}, unexpected {extra[:3]}")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state[name])

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """The reference policy: the same INT4 base with the LoRA adapter switched off."""
        with self.model.disable_adapter():
            yield

    def save_adapter(self, out_dir: Path) -> Path:
        """Write the adapter in PEFT format (adapter_config.json + adapter_model.safetensors)."""
        out_dir = Path(out_dir)
        self.model.save_pretrained(out_dir)
        config_path = out_dir / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = str(self.model_dir)
        config_path.write_text(json.dumps(config, indent=2))
        return out_dir

    def load_adapter(self, adapter_dir: Path) -> None:
        """Load adapter weights written by save_adapter (a checkpoint's PEFT adapter), every tensor exactly."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = Path(adapter_dir) / "adapter_model.safetensors"
        weights = load_file(path)
        expected = {n for n, p in self.model.named_parameters() if p.requires_grad}
        try:
            result = set_peft_model_state_dict(self.model, weights)
        except RuntimeError as exc:  # shape mismatch: a different rank or model
            raise ValueError(f"{path}: does not fit this adapter ({exc})") from None
        missing = sorted(k for k in result.missing_keys if k in expected)
        if missing or result.unexpected_keys:
            raise ValueError(
                f"{path}: adapter tensors do not match: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}"
            )

    def init_adapter_randomly(self, std: float, seed: int) -> None:
        """Give lora_B random values (PEFT starts it at zero, making the adapter a no-op).

        Used by parity checks and benchmarks: a no-op adapter would make adapter parity trivial.
        """
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator).to(param.device) * std)


def lora_config(adapter: AdapterSpec):
    """PEFT LoraConfig for ADAPTER (no bias training: vLLM's LoRA has no bias)."""
    from peft import LoraConfig

    return LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=adapter.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def load_policy(model_dir: Path, adapter: AdapterSpec, dtype: str = "bf16", device: str = "cpu") -> Policy:
    """Load the INT4 base from MODEL_DIR onto DEVICE and wrap it with a fresh (zero) LoRA adapter."""
    from peft import get_peft_model

    torch_dtype = parse_dtype(dtype)
    base, _ = load_int4_base(model_dir, torch_dtype)
    base.to(device)  # packed: moving the base costs ~1/4 of its bf16 size
    present = {name.rsplit(".", 1)[-1] for name, m in base.named_modules() if isinstance(m, nn.Linear)}
    unknown = [t for t in adapter.target_modules if t not in present]
    if unknown:
        raise OrbitError(f"adapter.target_modules {unknown} match no linear layer; the model has {sorted(present)}")
    model = get_peft_model(base, lora_config(adapter))
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_" not in name:
            raise RuntimeError(f"base parameter {name} is trainable; only the adapter may be")
    return Policy(model, torch_dtype, Path(model_dir))


def load_dense_policy(model_dir: Path, adapter: AdapterSpec, dtype: str = "bf16") -> Policy:
    """The traditional learner: the ORIGINAL 16-bit checkpoint (not INT4) plus a LoRA adapter.

    Orbit does not train this way; benchmarks use it to measure the train-rollout mismatch
    of learning on 16-bit weights while vLLM samples from an INT4 copy.
    """
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch_dtype = parse_dtype(dtype)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, attn_implementation="sdpa")
    base.requires_grad_(False)
    base.eval()
    return Policy(get_peft_model(base, lora_config(adapter)), torch_dtype, Path(model_dir))
