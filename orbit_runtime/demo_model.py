"""Tiny models (Qwen2, Qwen3-MoE, DeepSeek-V3-style) with a character-level tokenizer, made locally.

Used by the quickstarts and the tests; no network. The shapes respect vLLM's CPU backend limits
(head_dim >= 32, layer dims multiples of 32, divisible by the INT4 group size of 128) and
the model's vocabulary equals the tokenizer's.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

from orbit_runtime.errors import OrbitError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Hermes/Qwen tool-call tags, one token each as in Qwen's tokenizer (added, not special: a decoded
# completion keeps them, so its calls can be read back)
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
# Qwen-style chat template: the model answers after "<|im_start|>assistant\n". With tools, a short
# system turn lists them ("tools: calculator(expression)": the demo model reads characters, so its
# template spells the schema out briefly); tool results come back as a `tool` turn.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\ntools:' }}"
    "{% for tool in tools %}{{ ' ' + tool['function']['name'] + '(' + (tool['function']['parameters']['properties'] | list | join(',')) + ')' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class DemoModelShape:
    """Shape of the demo model. Defaults keep it small enough to train on 2 CPU cores."""

    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    # MoE architectures: routed experts per layer, experts per token, one expert's width
    num_experts: int = 8
    experts_per_token: int = 2
    expert_intermediate_size: int = 128


ARCHITECTURES = ("qwen2", "qwen3_moe", "deepseek_v3")


def _byte_level_char(byte: int) -> str:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, others to U+0100 onwards."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def build_tokenizer_vocab() -> list[str]:
    """Printable ASCII plus newline (one token per character), the special tokens and the tool-call tags, padded to 128.

    Tokens are written in the byte-level alphabet (space is "Ġ", newline "Ċ") because
    transformers loads any `qwen2` tokenizer with Qwen2's byte-level pre-tokenizer; a plain
    character vocabulary would silently lose spaces. One token per character keeps digits
    single tokens, which suits arithmetic tasks.
    """
    chars = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    vocab = [_byte_level_char(ord(c)) for c in chars] + SPECIAL_TOKENS + TOOL_TOKENS
    vocab += [f"<|reserved_{i}|>" for i in range(128 - len(vocab))]
    return vocab


def write_demo_model(
    out_dir: Path,
    *,
    shape: DemoModelShape = DemoModelShape(),
    seed: int = 0,
    arch: str = "qwen2",
    overwrite: bool = False,
) -> Path:
    """Write a randomly initialised model of ARCH (bf16 safetensors) plus its tokenizer to OUT_DIR."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    if arch not in ARCHITECTURES:
        raise OrbitError(f"--arch {arch!r}: unknown; choose one of {', '.join(ARCHITECTURES)}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise OrbitError(f"{out_dir}: directory exists and is not empty (pass --overwrite to replace it)")
    out_dir.mkdir(parents=True, exist_ok=True)

    vocab = build_tokenizer_vocab()
    token_to_id = {tok: i for i, tok in enumerate(vocab)}
    # A byte-level BPE with no merges is a character-level tokenizer.
    core = Tokenizer(models.BPE(vocab=token_to_id, merges=[], unk_token=None, fuse_unk=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([tok for tok in vocab if tok.startswith("<|")])
    core.add_tokens(TOOL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)

    common = dict(
        vocab_size=len(vocab),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=token_to_id["<|im_end|>"],
        pad_token_id=token_to_id["<|endoftext|>"],
        torch_dtype="bfloat16",
    )
    config = _architecture_config(arch, shape, common)
    head_dim = config.hidden_size // config.num_attention_heads
    if head_dim < 32:
        raise OrbitError(f"demo model head_dim={head_dim}: vLLM's CPU attention needs head_dim >= 32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    if arch == "deepseek_v3":
        # transformers starts the routing correction bias at zero; random values make the
        # demo exercise the biased (group-limited) expert choice. It stays fp32, as in DeepSeek-V3.
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias = torch.randn(shape.num_experts) * 0.1
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(out_dir)
    _check_vocab_matches(out_dir, len(tokenizer))
    return out_dir


def _architecture_config(arch: str, shape: DemoModelShape, common: dict):
    """The transformers config of ARCH at SHAPE (COMMON: the fields every architecture shares)."""
    from transformers import DeepseekV3Config, Qwen2Config, Qwen3MoeConfig

    if arch == "qwen2":
        return Qwen2Config(**common)
    moe = dict(
        moe_intermediate_size=shape.expert_intermediate_size,
        num_experts_per_tok=shape.experts_per_token,
        norm_topk_prob=True,
    )
    if arch == "qwen3_moe":
        head_dim = shape.hidden_size // shape.num_attention_heads
        return Qwen3MoeConfig(**common, **moe, num_experts=shape.num_experts, head_dim=head_dim)
    # DeepSeek-V3 in small: MLA attention (low-rank q and kv), the first layer dense, one
    # shared expert, sigmoid routing over 2 expert groups of which each token may use 1.
    head_dim = shape.hidden_size // shape.num_attention_heads
    return DeepseekV3Config(
        **{**common, "num_key_value_heads": shape.num_attention_heads},
        **moe,
        n_routed_experts=shape.num_experts,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        q_lora_rank=shape.hidden_size // 2,
        # DeepSeek-V3's latent width (512 + 64 rope dims): the only one vLLM's CPU MLA decode kernel compiles for
        kv_lora_rank=512,
        qk_nope_head_dim=head_dim,
        qk_rope_head_dim=64,
        v_head_dim=head_dim,
        scoring_func="sigmoid",  # not fields of transformers' config, but vLLM reads them (DeepSeek-V3 sets them)
        topk_method="noaux_tc",
    )


def _check_vocab_matches(model_dir: Path, tokenizer_size: int) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    if config["vocab_size"] != tokenizer_size:
        raise AssertionError(f"vocab mismatch: model {config['vocab_size']} vs tokenizer {tokenizer_size}")
