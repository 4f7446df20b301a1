"""`orbit quantize`: format written, what is kept in 16 bit, streaming, and errors that name the problem."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from orbit_runtime.errors import OrbitError
from orbit_runtime.int4.quantize import quantize_checkpoint
from orbit_runtime.int4.schemes import W4A16Int, read_quantization_config


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_demo_model_quantizes_to_pack_quantized(demo_dir, int4_dir):
    config = json.loads((int4_dir / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["symmetric"], weights["group_size"]) == (4, True, 128)
    assert "lm_head" in qc["ignore"]
    info = read_quantization_config(config, "config.json")
    assert info.scheme.group_size == 128

    tensors = _tensors(int4_dir)
    source = _tensors(demo_dir)
    # embeddings and lm_head stay 16 bit and unchanged
    assert torch.equal(tensors["model.embed_tokens.weight"], source["model.embed_tokens.weight"])
    assert torch.equal(tensors["lm_head.weight"], source["lm_head.weight"])
    # every layer linear is packed, no dense copy left behind
    packed = [k for k in tensors if k.endswith("weight_packed")]
    assert len(packed) == 4 * 7
    assert not any(k.endswith("q_proj.weight") for k in tensors)
    assert tensors["model.layers.0.mlp.down_proj.weight_packed"].dtype == torch.int32
    # tokenizer and chat template travel along
    assert (int4_dir / "tokenizer.json").is_file()
    assert (int4_dir / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (int4_dir / "tokenizer_config.json").read_text()
    )


def test_sharded_moe_checkpoint_quantizes_experts_but_not_router(tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "moe", max_shard_size="200KB")
    assert (tmp_path / "moe" / "model.safetensors.index.json").is_file()  # really sharded

    report = quantize_checkpoint(tmp_path / "moe", tmp_path / "moe-int4", W4A16Int(group_size=128))
    out = tmp_path / "moe-int4"
    tensors = _tensors(out)
    assert "model.layers.1.mlp.experts.3.down_proj.weight_packed" in tensors
    assert "model.layers.0.mlp.shared_expert.up_proj.weight_packed" in tensors
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16  # router kept
    assert "model.layers.0.mlp.shared_expert_gate.weight" in tensors
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.mlp.gate" in ignore and "lm_head" in ignore
    assert report.quantized_modules == 2 * (4 + 4 * 3 + 3)


def test_errors_name_the_problem(tmp_path, demo_dir):
    scheme = W4A16Int(group_size=128)
    (tmp_path / "empty").mkdir()
    with pytest.raises(OrbitError, match="no config.json"):
        quantize_checkpoint(tmp_path / "empty", tmp_path / "out", scheme)

    bad_arch = tmp_path / "bert"
    bad_arch.mkdir()
    (bad_arch / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    with pytest.raises(OrbitError, match="unsupported architecture.*BertModel"):
        quantize_checkpoint(bad_arch, tmp_path / "out", scheme)

    with pytest.raises(OrbitError, match=r"gate_proj.weight: input dimension 256 is not divisible by the group size 96"):
        quantize_checkpoint(demo_dir, tmp_path / "out", W4A16Int(group_size=96))
    assert not (tmp_path / "out").exists()  # nothing written on a shape error

    (tmp_path / "taken").mkdir()
    with pytest.raises(OrbitError, match="already exists.*--overwrite"):
        quantize_checkpoint(demo_dir, tmp_path / "taken", scheme)
    quantize_checkpoint(demo_dir, tmp_path / "taken", scheme, overwrite=True)
    assert (tmp_path / "taken" / "config.json").is_file()

    with pytest.raises(OrbitError, match="already quantized"):
        quantize_checkpoint(tmp_path / "taken", tmp_path / "twice", scheme)


def test_cli_quantize_and_errors(tmp_path, demo_dir):
    orbit = [sys.executable, "-m", "orbit_runtime.cli"]
    ok = subprocess.run([*orbit, "quantize", str(demo_dir), str(tmp_path / "q"), "--ignore", "down_proj"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    tensors = _tensors(tmp_path / "q")
    assert "model.layers.0.mlp.down_proj.weight" in tensors  # --ignore kept it dense
    assert "model.layers.0.mlp.up_proj.weight_packed" in tensors
    bad = subprocess.run([*orbit, "quantize", str(tmp_path / "nope"), str(tmp_path / "q2")], capture_output=True, text=True)
    assert bad.returncode == 2 and "nope" in bad.stderr and "Traceback" not in bad.stderr
