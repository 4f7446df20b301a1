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
from orbit_runtime.config.precision import canonical_dtype
from orbit_runtime.errors import OrbitError
from orbit_runtime.int4.quantize import list_shards
from orbit_runtime.int4.schemes import QuantizedCheckpointInfo, read_quantization_config
from orbit_runtime.learner.int4_linear import Int4Linear
from orbit_runtime.learner.moe import MOE_BLOCK_CLASSES, SparseMoeBlock, per_expert_peft_layout, replace_moe_blocks

# MoE architectures `orbit quantize` writes but the learner cannot train yet
UNSUPPORTED_MOE_TYPES = {"qwen2_moe", "mixtral"}
FP32_TENSOR_SUFFIXES = ("e_score_correction_bias",)  # routing biases stay fp32 whatever the dtype
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    """'bf16' | 'fp16' | 'fp32' (or their long names) -> torch dtype."""
    try:
        return TORCH_DTYPES[canonical_dtype(name)]
    except ValueError as exc:
        raise OrbitError(str(exc)) from None


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


def _materialise_rotary(model: nn.Module, config) -> None:
    """Rotary embeddings keep a non-persistent `inv_freq` buffer that is not in the checkpoint."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            _set_submodule(model, name, type(module)(config=config))


def _tied_weight_keys(model: nn.Module, config) -> dict[str, str]:
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


def _tie(model: nn.Module, target: str, source: str) -> None:
    """Make parameter TARGET the very same tensor as SOURCE (one copy in memory)."""
    parent_name, _, attr = target.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, model.get_parameter(source))


def load_int4_base(model_dir: Path, dtype: torch.dtype) -> tuple[nn.Module, QuantizedCheckpointInfo]:
    """The frozen base: quantized linears stay packed, other weights in `dtype`.

    The checkpoint may be split in any number of shards; each holds part of the tensors, so
    missing and unexpected tensors are judged against all shards together (from the shard
    headers, before any tensor is read). Tied embeddings (Qwen2.5 <= 3B, Qwen3 <= 4B, ...)
    are stored once: the LM head becomes the embedding tensor itself, not a copy.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
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
    config.quantization_config = None  # we do the INT4 part ourselves
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
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
    packed_modules = {k.rsplit(".", 1)[0] for k in shard_of if k.endswith((".weight_packed", ".weight_scale"))}
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
    for target, source in _tied_weight_keys(model, config).items():
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
        _tie(model, target, source)
    for target, source in both_stored:  # tie only identical copies, as transformers does
        if torch.equal(model.get_parameter(target), model.get_parameter(source)):
            _tie(model, target, source)
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
            # transformers checkpoints only in training mode: the update passes run under training()
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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

    def token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, temperature: float = 1.0
    ) -> torch.Tensor:
        """log p(token t | tokens < t) for t = 1..T-1 at sampling TEMPERATURE: [B, T] ids -> [B, T-1] float32.

        Logits are taken in the model dtype, divided by the temperature and log-softmaxed in
        float32, as vLLM's sampler does (its `processed_logprobs`): at T != 1 this is the
        distribution the rollout sampled from, so the gradient is for the policy that acted.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
        if temperature != 1.0:
            logits = logits / temperature
        logprobs = torch.log_softmax(logits, dim=-1)
        return logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    def completion_logprobs(
        self, pairs: list[tuple[list[int], list[int]]], pad_id: int = 0, temperature: float = 1.0
    ) -> list[torch.Tensor]:
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
        logprobs = self.token_logprobs(ids.to(self.device), mask.to(self.device), temperature)
        return [logprobs[row, len(p) - 1 : len(p) + len(c) - 1] for row, (p, c) in enumerate(pairs)]

    @property
    def has_dropout(self) -> bool:
        """Does training mode change the forward (LoRA dropout > 0)?"""
        return any(isinstance(m, nn.Dropout) and m.p > 0 for m in self.model.modules())

    @contextlib.contextmanager
    def scoring(self) -> Iterator[None]:
        """Eval mode and no autograd: the policy as it samples (dropout off). For old log-probs,
        mismatch, canary and reference scores; restores the previous mode afterwards."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Train mode (LoRA dropout on, gradient checkpointing active) for the update passes."""
        was_training = self.model.training
        self.model.train()
        try:
            yield
        finally:
            self.model.train(was_training)

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
            with per_expert_peft_layout(self.model.get_base_model()):
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


ROUTED_EXPERT_MODULES = r".*\.experts\.\d+\..*"  # mlp.experts.<e>.<proj> of an MoE block


def lora_config(adapter: AdapterSpec, has_routed_experts: bool = False):
    """PEFT LoraConfig for ADAPTER (no bias training: vLLM's LoRA has no bias).

    HAS_ROUTED_EXPERTS: the model holds per-expert linears, which get LoRA only if
    `adapter.routed_experts` is set.
    """
    from peft import LoraConfig

    return LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=adapter.target_modules,
        exclude_modules=ROUTED_EXPERT_MODULES if has_routed_experts and not adapter.routed_experts else None,
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
    has_routed_experts = any(isinstance(m, SparseMoeBlock) for m in base.modules())
    with per_expert_peft_layout(base):
        model = get_peft_model(base, lora_config(adapter, has_routed_experts))
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_" not in name:
            raise RuntimeError(f"base parameter {name} is trainable; only the adapter may be")
    model.eval()  # scoring mode unless an update runs under Policy.training() (PEFT returns it in train mode)
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
    model = get_peft_model(base, lora_config(adapter))
    model.eval()
    return Policy(model, torch_dtype, Path(model_dir))
