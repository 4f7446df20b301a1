"""The learner's policy: the packed INT4 base (`int4_base.py`) plus a trainable PEFT LoRA adapter.

The reference policy is the same object with the adapter disabled: no second copy of the base.
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
from orbit_runtime.config.learner import LOGPROB_CHUNK_TOKENS
from orbit_runtime.config.precision import canonical_dtype
from orbit_runtime.errors import OrbitError
from orbit_runtime.learner.colocated_base import SharedInt4Projection
from orbit_runtime.learner.grouped_experts import stack_expert_weights
from orbit_runtime.learner.int4_base import load_int4_base
from orbit_runtime.learner.int4_linear import Int4Linear
from orbit_runtime.learner.moe import SparseMoeBlock, per_expert_peft_layout
from orbit_runtime.learner.routing_replay import RoutedExperts
from orbit_runtime.learner.token_logprobs import chunked_token_logprobs

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    """'bf16' | 'fp16' | 'fp32' (or their long names) -> torch dtype."""
    try:
        return TORCH_DTYPES[canonical_dtype(name)]
    except ValueError as exc:
        raise OrbitError(str(exc)) from None


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
        self.logprob_chunk_tokens = LOGPROB_CHUNK_TOKENS  # positions through the LM head at once

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
            if isinstance(module, (Int4Linear, SharedInt4Projection)):
                packed += module.weight_packed.nbytes + module.weight_scale.nbytes
                count += module.in_features * module.out_features
        for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if "lora_" in name or "weight_packed" in name or "weight_scale" in name:
                continue
            dense += tensor.nbytes
        return BaseMemory(packed_bytes=packed, dense_bytes=dense, quantized_params=count)

    def base_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the frozen base (parameters and buffers that are not the adapter's), each once."""
        seen, out = set(), []
        for name, tensor in [*self.model.named_parameters(), *self.model.named_buffers()]:
            if "lora_" in name or tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            out.append(tensor)
        return out

    def token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, temperature: float = 1.0
    ) -> torch.Tensor:
        """log p(token t | tokens < t) for t = 1..T-1 at sampling TEMPERATURE: [B, T] ids -> [B, T-1] float32.

        Every position (for checks and tests); training scores completions only
        (`completion_logprobs`).
        """
        batch, width = input_ids.shape
        rows = torch.arange(batch, device=input_ids.device).repeat_interleave(width - 1)
        positions = torch.arange(width - 1, device=input_ids.device).repeat(batch)
        return self.logprobs_at(input_ids, attention_mask, rows, positions, temperature).view(batch, width - 1)

    def logprobs_at(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rows: torch.Tensor,
        positions: torch.Tensor,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """log p(input_ids[r, i + 1] | input_ids[r, :i + 1]) for each (r, i) in zip(ROWS, POSITIONS): [N] float32.

        One forward of the decoder; the LM head and the log-softmax run only on the selected
        positions, in chunks (token_logprobs.py), as vLLM's sampler computes them: logits in
        the model dtype, divided by the temperature and normalised in float32. At T != 1
        this is the distribution the rollout sampled from, so the gradient is for the policy
        that acted.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        causal_lm = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # PEFT or plain
        hidden = causal_lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return chunked_token_logprobs(
            hidden[rows, positions], input_ids[rows, positions + 1], causal_lm.get_output_embeddings(), temperature,
            self.logprob_chunk_tokens,
        )

    def completion_logprobs(
        self, pairs: list[tuple[list[int], list[int]]], pad_id: int = 0, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """Per-token log-probs of each completion given its prompt: [(prompt, completion)] -> [[len(c)]].

        Sequences are right-padded into one batch; padding never affects earlier positions
        of a causal model, so each completion is scored exactly as on its own. Only the
        completion's positions reach the LM head.
        """
        lengths = [len(p) + len(c) for p, c in pairs]
        width = max(lengths)
        ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(pairs), width), dtype=torch.long)
        rows, positions = [], []
        for row, (prompt, completion) in enumerate(pairs):
            ids[row, : lengths[row]] = torch.tensor(prompt + completion)
            mask[row, : lengths[row]] = 1
            rows += [row] * len(completion)
            positions += range(len(prompt) - 1, lengths[row] - 1)
        device = self.device
        flat = self.logprobs_at(ids.to(device), mask.to(device), torch.tensor(rows, device=device, dtype=torch.long),
                                torch.tensor(positions, device=device, dtype=torch.long), temperature)  # fmt: skip
        return list(flat.split([len(c) for _, c in pairs]))

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [m for m in self.model.modules() if isinstance(m, SparseMoeBlock)]

    def routed_experts_for(self, pairs, routing, mode: str = "replay", keep_own: bool = False) -> RoutedExperts:
        """The rollout's ROUTING ([positions, layers, k] per sample, or None) laid out for a forward of
        PAIRS as completion_logprobs pads them; install it with `routed`."""
        config = self.model.config
        spec = self.moe_blocks()[0].gate.spec
        return RoutedExperts(pairs, routing, config.num_hidden_layers, spec.top_k, spec.num_experts, mode=mode,
                             device=self.device, keep_own=keep_own)  # fmt: skip

    @contextlib.contextmanager
    def routed(self, routed: RoutedExperts | None) -> Iterator[None]:
        """Every MoE block replays (or compares with) ROUTED inside the block, forward and the backward
        that recomputes it; None: the learner's own routing."""
        blocks = self.moe_blocks()
        if routed is not None and not blocks:
            raise OrbitError("routing replay needs an MoE model; this one has no MoE layer")
        for block in blocks:
            block.routing = routed
        try:
            yield
        finally:
            for block in blocks:
                block.routing = None

    def set_expert_compute(self, mode: str) -> None:
        """'grouped' (default) or 'loop' (one call per expert: the reference and benchmark baseline)."""
        if mode not in ("grouped", "loop"):
            raise ValueError(f"expert compute {mode!r}: expected 'grouped' or 'loop'")
        for block in self.moe_blocks():
            block.expert_compute = mode

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

    def save_adapter(self, out_dir: Path, dtype: torch.dtype | None = None) -> Path:
        """Write the adapter in PEFT format (adapter_config.json + adapter_model.safetensors); DTYPE: its
        tensors cast to it (the sync writes the dtype vLLM serves: it casts to it at load anyway, so the
        served weights are the same and the file is half an fp32 one), else as trained (checkpoints)."""
        out_dir = Path(out_dir)
        if dtype is None:
            self.model.save_pretrained(out_dir)
        else:
            from peft import get_peft_model_state_dict

            state = {k: v.to(dtype) for k, v in get_peft_model_state_dict(self.model).items()}
            self.model.save_pretrained(out_dir, state_dict=state)
        config_path = out_dir / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = str(self.model_dir)
        config_path.write_text(json.dumps(config, indent=2))
        return out_dir

    def adapter_export(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The adapter as `save_pretrained` writes it, in memory: {PEFT tensor name: a copy} and the
        adapter_config dict (what vLLM loads; placement colocated syncs it without files)."""
        from peft import get_peft_model_state_dict

        from orbit_runtime.shared_base.arena import memcpy_clone

        state = get_peft_model_state_dict(self.model)
        tensors = {k: memcpy_clone(v.detach().cpu()) for k, v in state.items()}
        config = self.model.peft_config["default"].to_dict()
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
        config["base_model_name_or_path"] = str(self.model_dir)
        return tensors, config

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


def lora_config(adapter: AdapterSpec, has_routed_experts: bool = False, lora_rounding: str = "fp32"):
    """PEFT LoraConfig for ADAPTER (no bias training: vLLM's LoRA has no bias).

    HAS_ROUTED_EXPERTS: the model holds per-expert linears, which get LoRA only if
    `adapter.routed_experts` is set. LORA_ROUNDING 'vllm': every LoRA linear computes with
    vLLM's rounding (lora_numerics.py).
    """
    from peft import LoraConfig

    config = LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=adapter.target_modules,
        exclude_modules=ROUTED_EXPERT_MODULES if has_routed_experts and not adapter.routed_experts else None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    if lora_rounding == "vllm":
        from orbit_runtime.learner.lora_numerics import VllmRoundedLoraLinear

        config._register_custom_module({nn.Linear: VllmRoundedLoraLinear})  # PEFT's custom-layer API
    elif lora_rounding != "fp32":
        raise OrbitError(f"learner.lora_rounding {lora_rounding!r}: expected 'vllm' or 'fp32'")
    return config


def load_policy(model_dir: Path, adapter: AdapterSpec, dtype: str = "bf16", device: str = "cpu",
                lora_rounding: str = "fp32") -> Policy:  # fmt: skip
    """Load the INT4 base from MODEL_DIR onto DEVICE and wrap it with a fresh (zero) LoRA adapter
    (LORA_ROUNDING: see lora_config; the trainer passes learner.lora_rounding)."""
    torch_dtype = parse_dtype(dtype)
    base, _ = load_int4_base(model_dir, torch_dtype)
    base.to(device)  # packed: moving the base costs ~1/4 of its bf16 size
    stack_expert_weights(base)  # after the move: the stacks and the experts' views stay one copy
    return _with_adapter(base, adapter, torch_dtype, Path(model_dir), lora_rounding)


def load_colocated_policy(model_dir: Path, adapter: AdapterSpec, shared: dict[str, torch.Tensor], isa_hint: str,
                          dtype: str = "bf16", lora_rounding: str = "fp32") -> Policy:  # fmt: skip
    """placement colocated: the base over SHARED, the rollout engine's own tensors (colocated_base.py),
    with a fresh LoRA adapter. The adapter's weights are the policy's only parameters."""
    from orbit_runtime.learner.colocated_base import build_colocated_base

    torch_dtype = parse_dtype(dtype)
    base = build_colocated_base(Path(model_dir), torch_dtype, shared, isa_hint)
    return _with_adapter(base, adapter, torch_dtype, Path(model_dir), lora_rounding)


def _with_adapter(base: nn.Module, adapter: AdapterSpec, torch_dtype: torch.dtype, model_dir: Path, lora_rounding: str) -> Policy:
    """BASE (frozen) wrapped with a fresh PEFT LoRA ADAPTER: the Policy."""
    from peft import get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, m in base.named_modules() if isinstance(m, nn.Linear)}
    unknown = [t for t in adapter.target_modules if t not in present]
    if unknown:
        raise OrbitError(f"adapter.target_modules {unknown} match no linear layer; the model has {sorted(present)}")
    has_routed_experts = any(isinstance(m, SparseMoeBlock) for m in base.modules())
    with per_expert_peft_layout(base):
        model = get_peft_model(base, lora_config(adapter, has_routed_experts, lora_rounding))
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_" not in name:
            raise RuntimeError(f"base parameter {name} is trainable; only the adapter may be")
    model.eval()  # scoring mode unless an update runs under Policy.training() (PEFT returns it in train mode)
    return Policy(model, torch_dtype, model_dir)


def load_dense_policy(model_dir: Path, adapter: AdapterSpec, dtype: str = "bf16", lora_rounding: str = "fp32") -> Policy:
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
    model = get_peft_model(base, lora_config(adapter, lora_rounding=lora_rounding))
    model.eval()
    return Policy(model, torch_dtype, Path(model_dir))
