"""The learner loads real checkpoints: sharded, with tied or untied embeddings, of each dense
architecture users bring (Qwen2, Qwen2.5, Qwen3 with q/k norms, Llama 3 with llama3 RoPE scaling).

Each model is a tiny random one built here and saved in several shards, as every real model is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orbit_runtime.config import AdapterSpec
from orbit_runtime.errors import OrbitError
from orbit_runtime.int4.quantize import INDEX_FILE, quantize_checkpoint
from orbit_runtime.int4.schemes import W4A16Int
from orbit_runtime.learner.dense_reference import load_dequantized_dense_model
from orbit_runtime.learner.int4_linear import Int4Linear
from orbit_runtime.learner.model import load_policy

ADAPTER = AdapterSpec(rank=4, alpha=8)
VOCAB = 128
# hidden 256 and intermediate 512: multiples of the INT4 group size; head_dim 64
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so that many frequencies are rescaled
}


def _config(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if arch == "qwen2":  # Qwen2-7B style: untied, q/k/v biases
        return Qwen2Config(**SHAPE, tie_word_embeddings=False)
    if arch == "qwen2.5":  # Qwen2.5 <= 3B: tied embeddings
        return Qwen2Config(**SHAPE, tie_word_embeddings=True)
    if arch == "qwen3":  # Qwen3 <= 4B: tied, q_norm / k_norm, explicit head_dim
        return Qwen3Config(**SHAPE, head_dim=64, tie_word_embeddings=True)
    if arch == "llama3":  # Llama 3.x 8B style: untied, llama3 RoPE scaling
        return LlamaConfig(**SHAPE, tie_word_embeddings=False, rope_scaling=dict(LLAMA3_ROPE))
    raise ValueError(arch)


def _write_sharded(arch: str, out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
    with torch.no_grad():  # norms start at 1: randomise them so that loading them matters
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
    model.save_pretrained(out, max_shard_size="1MB")
    return out


def _shards(model_dir: Path) -> list[str]:
    index = json.loads((model_dir / INDEX_FILE).read_text())
    return sorted(set(index["weight_map"].values()))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (16-bit source dir, INT4 dir), each written in several shards."""
    made = {}

    def get(arch: str) -> tuple[Path, Path]:
        if arch not in made:
            root = tmp_path_factory.mktemp(arch)
            src = _write_sharded(arch, root / "dense")
            dst = root / "int4"
            quantize_checkpoint(src, dst, W4A16Int(group_size=128))
            made[arch] = (src, dst)
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ["qwen2", "qwen2.5", "qwen3", "llama3"])
def test_sharded_checkpoint_loads_and_matches_dense(arch, checkpoints):
    src, dst = checkpoints(arch)
    tied = _config(arch).tie_word_embeddings
    assert len(_shards(src)) >= 3 and _shards(dst) == _shards(src)
    source_keys = json.loads((src / INDEX_FILE).read_text())["weight_map"]
    assert ("lm_head.weight" in source_keys) is not tied
    if arch == "qwen3":
        assert "model.layers.1.self_attn.q_norm.weight" in source_keys

    policy = load_policy(dst, ADAPTER, dtype="fp32")
    base = policy.model.get_base_model()

    # (c) every projection stays packed: no dense copy of a quantized weight anywhere
    int4_layers = {n: m for n, m in base.named_modules() if isinstance(m, Int4Linear)}
    assert len(int4_layers) == 2 * 7
    for layer in int4_layers.values():
        assert layer.weight_packed.dtype == torch.int32
        assert "weight" not in layer._parameters
    assert not isinstance(base.lm_head, Int4Linear)

    # (b) tied: one embedding matrix, shared by the LM head; untied: two
    embed, head = base.get_input_embeddings().weight, base.lm_head.weight
    if tied:
        assert head is embed and head.data_ptr() == embed.data_ptr()
        storages = {p.untyped_storage().data_ptr() for p in base.parameters()}
        assert len(storages) == len(list(base.parameters()))  # parameters() deduplicates: nothing else shared
        assert sum(1 for n, _ in base.named_parameters() if n.endswith(("embed_tokens.weight", "lm_head.weight"))) == 1
    else:
        assert head.data_ptr() != embed.data_ptr()
        assert not torch.equal(head, embed)

    # (a) the packed learner computes what a dense fp32 model holding the INT4 values computes
    dense = load_dequantized_dense_model(src, dst, torch.float32)
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), policy.adapter_disabled():
        ours = policy.model(input_ids=ids, use_cache=False).logits
    with torch.no_grad():
        theirs = dense(input_ids=ids, use_cache=False).logits
    assert ours.shape == theirs.shape == (2, 48, VOCAB)
    assert (ours - theirs).abs().max() < 1e-4

    # rotary buffers (not in the checkpoint) are rebuilt from the config, RoPE scaling included
    ours_rotary = base.model.rotary_emb
    assert torch.equal(ours_rotary.inv_freq, dense.model.rotary_emb.inv_freq)
    assert ours_rotary.attention_scaling == dense.model.rotary_emb.attention_scaling
    if arch == "llama3":
        from transformers import LlamaConfig

        plain = LlamaConfig(**SHAPE, rope_theta=LLAMA3_ROPE["rope_theta"])
        unscaled = type(ours_rotary)(config=plain).inv_freq
        assert not torch.allclose(ours_rotary.inv_freq, unscaled)  # the llama3 rescaling was applied


def _drop_tensor(int4_dir: Path, key: str) -> str:
    """Remove KEY from its shard (and from the index), as a truncated download would."""
    from safetensors.torch import load_file, save_file

    index_path = int4_dir / INDEX_FILE
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop(key)
    tensors = load_file(int4_dir / shard)
    del tensors[key]
    save_file(tensors, int4_dir / shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return shard


@pytest.mark.parametrize(
    "key",
    [
        "model.layers.1.post_attention_layernorm.weight",
        "model.layers.0.mlp.down_proj.weight_packed",
        "model.embed_tokens.weight",  # tied: the LM head has nothing to tie to either
    ],
)
def test_missing_tensor_is_named(key, checkpoints, tmp_path):
    import shutil

    _, dst = checkpoints("qwen2.5")
    broken = tmp_path / "broken"
    shutil.copytree(dst, broken)
    _drop_tensor(broken, key)
    with pytest.raises(OrbitError, match=r"checkpoint lacks \[.*" + key.replace(".", r"\.")) as info:
        load_policy(broken, ADAPTER, dtype="fp32")
    assert str(broken) in str(info.value)


def test_unexpected_tensor_is_named(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    _, dst = checkpoints("qwen2")
    broken = tmp_path / "broken"
    shutil.copytree(dst, broken)
    shard = _shards(broken)[1]
    tensors = load_file(broken / shard)
    tensors["model.layers.0.extra.weight"] = torch.zeros(4)
    save_file(tensors, broken / shard, metadata={"format": "pt"})
    with pytest.raises(OrbitError, match=r"tensors the model does not have: \['model\.layers\.0\.extra\.weight'\]") as info:
        load_policy(broken, ADAPTER, dtype="fp32")
    assert shard in str(info.value)
