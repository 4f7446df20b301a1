"""A model's shape, read from its Hugging Face `config.json` with `json` alone (no transformers).

The planner needs only what decides parameter counts and memory: widths, layer counts,
attention kind (GQA or DeepSeek's multi-head latent attention, MLA), which layers are
mixture-of-experts and how wide their experts are, tied embeddings and multi-token
prediction (MTP) layers. Each architecture family reads its own config keys, with the
defaults transformers uses when a key is absent; anything else is an error naming the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from orbit_runtime.errors import OrbitError

DENSE_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
MOE_GQA_TYPES = {"qwen3_moe", "qwen2_moe", "mixtral"}
MLA_TYPES = {"deepseek_v3", "deepseek_v2", "kimi_k2"}
# architectures class -> model_type, for configs whose model_type is a fork's own name
ARCHITECTURE_TYPES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral", "DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2",
}  # fmt: skip
SUPPORTED_TYPES = DENSE_TYPES | MOE_GQA_TYPES | MLA_TYPES


class PlanError(OrbitError):
    """A model config or plan input the planner cannot use; the message names the file and key."""


@dataclass(frozen=True)
class Attention:
    """GQA (`kind="gqa"`: heads, kv_heads, head_dim) or MLA (`kind="mla"`: the low-rank widths)."""

    kind: Literal["gqa", "mla"]
    heads: int
    kv_heads: int
    head_dim: int = 0  # gqa
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and k
    q_lora_rank: int | None = None  # mla: None -> a plain q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def q_width(self) -> int:
        """Width of all query heads together."""
        return self.heads * (self.head_dim if self.kind == "gqa" else self.qk_nope_head_dim + self.qk_rope_head_dim)

    @property
    def kv_width(self) -> int:
        """Width of all key (= value) heads together, as computed (MLA expands its latent per head)."""
        return self.kv_heads * self.head_dim if self.kind == "gqa" else self.heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)

    @property
    def out_width(self) -> int:
        """Input width of o_proj."""
        return self.heads * (self.head_dim if self.kind == "gqa" else self.v_head_dim)


@dataclass(frozen=True)
class MoE:
    """The routed experts (and any shared expert) of the MoE layers."""

    naming: Literal["qwen3", "qwen2", "mixtral", "deepseek"]  # how the checkpoint names the block's modules
    experts: int
    top_k: int
    expert_width: int  # intermediate size of one routed expert
    layers: tuple[int, ...]  # indices of the MoE layers (the others are dense)
    shared_width: int = 0  # intermediate size of the shared expert(s) together; 0: none
    shared_gate: bool = False  # Qwen2-MoE: a sigmoid gate on the shared expert
    correction_bias: bool = False  # DeepSeek-V3 noaux_tc: an fp32 bias per expert


@dataclass(frozen=True)
class Architecture:
    source: str  # the file (or catalog name) it was read from, for messages
    model_type: str
    architecture: str  # the transformers class name
    vocab: int
    hidden: int
    layers: int
    dense_width: int  # intermediate size of the dense MLP layers
    tie_embeddings: bool
    mlp_bias: bool  # Llama's mlp_bias: biases on the dense MLP's gate, up and down
    attention: Attention
    moe: MoE | None
    mtp_layers: int  # DeepSeek multi-token-prediction layers (stored in the checkpoint, not loaded by vLLM or the learner)
    max_position_embeddings: int
    dtype: str  # the checkpoint's torch_dtype
    quantization_config: dict | None  # as config.json has it, if any

    @property
    def is_moe(self) -> bool:
        return self.moe is not None


def _get(config: dict, key: str, source: str, default: Any = ..., kind: type = int, minimum: int | None = 1) -> Any:
    value = config.get(key, default)
    if value is ...:
        raise PlanError(f"{source}: {key}: required for a {config.get('model_type')} model")
    if value is None and default is None:
        return None
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise PlanError(f"{source}: {key}: expected an integer, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise PlanError(f"{source}: {key}: expected true or false, got {value!r}")
    if kind is int and minimum is not None and value < minimum:
        raise PlanError(f"{source}: {key}: must be >= {minimum}, got {value}")
    return value


def _model_type(config: dict, source: str) -> str:
    model_type = config.get("model_type")
    if model_type in SUPPORTED_TYPES:
        return model_type
    for name in config.get("architectures") or []:
        if name in ARCHITECTURE_TYPES:
            return ARCHITECTURE_TYPES[name]
    raise PlanError(
        f"{source}: model_type {model_type!r} (architectures {config.get('architectures')}) is not one the planner knows; "
        f"supported: {', '.join(sorted(SUPPORTED_TYPES))}"
    )


def _gqa(config: dict, source: str, model_type: str) -> Attention:
    heads = _get(config, "num_attention_heads", source)
    hidden = _get(config, "hidden_size", source)
    kv_heads = _get(config, "num_key_value_heads", source, default=heads)
    head_dim = config.get("head_dim") or hidden // heads  # transformers' default when absent or null
    if heads % kv_heads:
        raise PlanError(f"{source}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
    bias = _get(config, "attention_bias", source, default=False, kind=bool)
    qwen2 = model_type in ("qwen2", "qwen2_moe")  # always q/k/v biases, never an o_proj bias
    return Attention("gqa", heads, kv_heads, head_dim=int(head_dim), qkv_bias=qwen2 or bias, o_bias=bias and not qwen2,
                     qk_norm=model_type in ("qwen3", "qwen3_moe"))  # fmt: skip


def _mla(config: dict, source: str) -> Attention:
    heads = _get(config, "num_attention_heads", source)
    return Attention(
        "mla", heads, heads, q_lora_rank=_get(config, "q_lora_rank", source, default=None),
        kv_lora_rank=_get(config, "kv_lora_rank", source), qk_nope_head_dim=_get(config, "qk_nope_head_dim", source),
        qk_rope_head_dim=_get(config, "qk_rope_head_dim", source), v_head_dim=_get(config, "v_head_dim", source),
        qkv_bias=_get(config, "attention_bias", source, default=False, kind=bool),
    )  # fmt: skip


def _moe(config: dict, source: str, model_type: str, layers: int) -> MoE:
    top_k = _get(config, "num_experts_per_tok", source)
    if model_type == "mixtral":
        experts = _get(config, "num_local_experts", source)
        moe = MoE("mixtral", experts, top_k, _get(config, "intermediate_size", source), tuple(range(layers)))
    elif model_type in MLA_TYPES:
        experts = _get(config, "n_routed_experts", source)
        first_dense = _get(config, "first_k_dense_replace", source, default=0, minimum=0)
        every = _get(config, "moe_layer_freq", source, default=1)
        width = _get(config, "moe_intermediate_size", source)
        shared = _get({**config, "n_shared_experts": config.get("n_shared_experts") or 0}, "n_shared_experts", source, minimum=0)
        moe = MoE("deepseek", experts, top_k, width, tuple(i for i in range(layers) if i >= first_dense and i % every == 0),
                  shared_width=shared * width, correction_bias=config.get("topk_method") == "noaux_tc")  # fmt: skip
    else:  # qwen3_moe, qwen2_moe
        experts = _get(config, "num_experts", source)
        step = _get(config, "decoder_sparse_step", source, default=1)
        dense_only = set(config.get("mlp_only_layers") or [])
        chosen = tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
        shared = _get(config, "shared_expert_intermediate_size", source, default=0, minimum=0) if model_type == "qwen2_moe" else 0
        moe = MoE("qwen2" if model_type == "qwen2_moe" else "qwen3", experts, top_k, _get(config, "moe_intermediate_size", source),
                  chosen, shared_width=shared, shared_gate=bool(shared))  # fmt: skip
    if not 1 <= moe.top_k <= moe.experts:
        raise PlanError(f"{source}: num_experts_per_tok ({moe.top_k}) must be between 1 and the number of experts ({moe.experts})")
    return moe


def parse_architecture(config: Any, source: str) -> Architecture:
    """The Architecture of a config.json's contents; PlanError names SOURCE and the key."""
    if not isinstance(config, dict):
        raise PlanError(f"{source}: expected a JSON object (a model's config.json), got {type(config).__name__}")
    model_type = _model_type(config, source)
    layers = _get(config, "num_hidden_layers", source)
    attention = _mla(config, source) if model_type in MLA_TYPES else _gqa(config, source, model_type)
    moe = _moe(config, source, model_type, layers) if model_type in MOE_GQA_TYPES | MLA_TYPES else None
    quant = config.get("quantization_config")
    architectures = config.get("architectures") or []
    return Architecture(
        source=source,
        model_type=model_type,
        architecture=architectures[0] if architectures else model_type,
        vocab=_get(config, "vocab_size", source),
        hidden=_get(config, "hidden_size", source),
        layers=layers,
        # Mixtral has no dense MLP layer: its intermediate_size is the experts' width
        dense_width=0 if model_type == "mixtral" else _get(config, "intermediate_size", source),
        tie_embeddings=_get(config, "tie_word_embeddings", source, default=False, kind=bool),
        mlp_bias=model_type == "llama" and _get(config, "mlp_bias", source, default=False, kind=bool),
        attention=attention,
        moe=moe,
        mtp_layers=_get(config, "num_nextn_predict_layers", source, default=0, minimum=0) if model_type in MLA_TYPES else 0,
        max_position_embeddings=_get(config, "max_position_embeddings", source, default=4096),
        dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
        quantization_config=quant if isinstance(quant, dict) else None,
    )


def read_architecture(path: Path) -> Architecture:
    """Read PATH (a config.json, or a model directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"{path}: no such file (a model's config.json, or its directory)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"{path}: cannot be read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise PlanError(f"{path}: not valid JSON ({exc})") from None
    return parse_architecture(config, str(path))
