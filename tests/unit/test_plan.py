"""The planner's arithmetic (orbit_runtime/plan): parameter counts against the published totals,
the base's bytes, and the verdicts of a DeepSeek-V3 job on 8 x H200 worked out by hand.

The model configs are the catalog's (orbit_runtime/plan/models/*.json), written by hand from
the public config.json files; nothing is downloaded.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from orbit_runtime.plan.activations import layer_saved, micro_batch, update_memory
from orbit_runtime.plan.architecture import PlanError, parse_architecture
from orbit_runtime.plan.catalog import catalog_architecture, catalog_config, names
from orbit_runtime.plan.hardware import gpu_from_label, gpu_from_node_selector, gpu_model
from orbit_runtime.plan.parameters import count_parameters
from orbit_runtime.plan.planner import make_plan
from orbit_runtime.plan.report import plan_json
from orbit_runtime.plan.request import NodeSpec, PlanRequest
from orbit_runtime.plan.roles import kv_bytes_per_token
from orbit_runtime.plan.weights import base_weights, quantization_of

B = 1e9

# (catalog name, published total, published active, where the numbers are published)
PUBLISHED = [
    ("deepseek-v3", 671e9, None, "DeepSeek-V3 model card: 671B main model (+14B MTP module = 685B on the Hub)"),
    ("qwen3-235b-a22b", 235e9, 22e9, "Qwen3-235B-A22B model card: 235B in total, 22B activated"),
    ("mixtral-8x7b", 46.7e9, 12.9e9, "Mistral's Mixtral announcement: 46.7B total, 12.9B used per token"),
    ("qwen2.5-7b", 7.61e9, None, "Qwen2.5-7B model card: 7.61B"),
    ("qwen3-30b-a3b", 30.5e9, None, "Qwen3-30B-A3B model card: 30.5B in total"),
    ("llama-3.1-8b", 8.03e9, None, "Llama 3.1 8B: 8.03B"),
    ("llama-3.1-70b", 70.6e9, None, "Llama 3.1 70B: 70.6B"),
]


@pytest.mark.parametrize(("name", "total", "active", "source"), PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_parameter_counts_match_the_published_totals(name, total, active, source):
    params = count_parameters(catalog_architecture(name))
    assert params.total == pytest.approx(total, rel=0.01), source
    if active is not None:
        assert params.active == pytest.approx(active, rel=0.01), source


def test_deepseek_v3_counts_every_part_and_reports_its_mtp_layer_apart():
    params = count_parameters(catalog_architecture("deepseek-v3"))
    # MLA, one layer: q_a 7168x1536 + q_b 1536x(128 heads x 192) + kv_a 7168x(512+64) + kv_b 512x(128 x (128+128))
    # + o 16384x7168 = 11,010,048 + 37,748,736 + 4,128,768 + 16,777,216 + 117,440,512 = 187,105,280, x 61 layers
    assert params.attention == 187_105_280 * 61
    expert = 3 * 7168 * 2048  # 44,040,192: gate, up, down of width 2048
    assert params.routed_experts == 256 * expert * 58  # layers 3..60 are MoE (first_k_dense_replace 3)
    assert params.shared_experts == expert * 58
    assert params.dense_mlp == 3 * 7168 * 18432 * 3
    assert params.routers == (256 * 7168 + 256) * 58  # the gate and its fp32 correction bias
    assert params.embedding == params.lm_head == 129280 * 7168
    # DeepSeek's own activated count (README_WEIGHTS.md: "36.6B (including 0.9B for the output Head)") leaves
    # the input embedding out: 8 of 256 experts x 58 layers (20.43B) + attention 11.41B + dense 1.19B + shared
    # 2.55B + routers 0.11B + head 0.93B = 36.63B. With the input embedding (Qwen's and Mistral's convention,
    # `active_params`) it is 37.55B: the headline "37B" is 1.5% below one and 1% above the other.
    assert params.active_without_input_embedding == pytest.approx(36.6e9, rel=0.01)
    assert params.active == params.active_without_input_embedding + 129280 * 7168
    # the MTP module: an MoE layer (11.51B) + eh_proj 2 x 7168 x 7168 + norms: DeepSeek says 11.5B unique
    assert params.mtp == pytest.approx(11.5e9, rel=0.01)
    assert params.total == pytest.approx(671e9, rel=0.001)  # without the MTP layer


def test_non_embedding_counts_match_the_qwen_model_cards():
    for name, published in (("qwen2.5-7b", 6.53e9), ("qwen3-235b-a22b", 234e9)):
        params = count_parameters(catalog_architecture(name))
        assert params.total - params.embedding - params.lm_head == pytest.approx(published, rel=0.01), name


def test_a_1t_int4_checkpoint_is_planned_at_its_published_size():
    """Kimi-K2-Thinking's own quantization_config (INT4, group 32, routed experts only; attention, shared
    experts, the dense layer and the head 16-bit): the INT4 release of a 1T-parameter MoE is ~594 GB."""
    arch = catalog_architecture("kimi-k2-thinking")
    quantization = quantization_of(arch, PlanRequest())
    assert quantization.group_size == 32 and "re:.*self_attn.*" in quantization.ignore
    base = base_weights(arch, quantization)
    params = count_parameters(arch)
    assert base.int4_params == params.routed_experts  # exactly the routed experts are INT4
    int4, dense = base.on_gpu(1, "bf16")
    # 1,014.9B routed expert weights x (0.5 + 2/32) bytes = 570.9 GB, + 11.6B 16-bit parameters x 2 bytes = 23.1 GB
    assert int4 + dense == pytest.approx(594e9, rel=0.01)
    doc = plan_json(make_plan(arch, PlanRequest()))
    assert doc["checkpoint_bytes"] == int4 + dense


def test_orbit_quantize_defaults_keep_embeddings_head_and_routers_16_bit():
    arch = catalog_architecture("qwen3-235b-a22b")
    base = base_weights(arch, quantization_of(arch, PlanRequest(group_size=128)))
    params = count_parameters(arch)
    assert base.dense_params == params.embedding + params.lm_head + params.routers  # everything else is a quantized linear
    assert base.int4_params == params.total - base.dense_params - params.norms


def test_a_linear_the_group_size_cannot_split_is_an_error_naming_it():
    config = {**catalog_config("qwen2.5-7b"), "intermediate_size": 18940}  # down_proj's input is no multiple of 128
    arch = parse_architecture(config, "config.json")
    with pytest.raises(PlanError, match=r"config.json: model.layers.0.mlp.down_proj: input dimension 18940 .* group size 128"):
        base_weights(arch, quantization_of(arch, PlanRequest()))


def test_bad_configs_are_refused_naming_the_file_and_key():
    with pytest.raises(PlanError, match="cfg.json: hidden_size: required"):
        parse_architecture({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2}, "cfg.json")
    with pytest.raises(PlanError, match="cfg.json: num_hidden_layers: expected an integer, got '61'"):
        parse_architecture({**catalog_config("deepseek-v3"), "num_hidden_layers": "61"}, "cfg.json")
    with pytest.raises(PlanError, match="model_type 'gpt2'.*supported"):
        parse_architecture({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "cfg.json")
    with pytest.raises(PlanError, match="not a multiple of num_key_value_heads"):
        parse_architecture({**catalog_config("llama-3.1-8b"), "num_key_value_heads": 5}, "cfg.json")
    with pytest.raises(PlanError, match="num_experts_per_tok \\(9\\) must be between 1 and the number of experts \\(8\\)"):
        parse_architecture({**catalog_config("mixtral-8x7b"), "num_experts_per_tok": 9}, "cfg.json")


def deepseek_job(**changes) -> PlanRequest:
    """A DeepSeek-V3 RL job: 16 prompts x 8 completions of 1,024 + 1,024 tokens, micro-batches of 16,384 tokens,
    gradient checkpointing, bf16, LoRA rank 16 on the default targets, orbit quantize's INT4 (group 128)."""
    return PlanRequest(node=NodeSpec(gpus=8, gpu="H200"), prompts=16, group=8, prompt_tokens=1024, completion_tokens=1024,
                       max_model_len=2048, **changes)  # fmt: skip


def test_deepseek_v3_int4_on_8_h200_which_layouts_fit_and_what_binds():
    doc = plan_json(make_plan(catalog_architecture("deepseek-v3"), deepseek_job()))
    usable = 143771 * 2**20 * 0.95  # an H200 as nvidia-smi reports it (143,771 MiB), 95% usable: 143.2 GB (133.4 GiB)
    assert doc["node"]["usable_bytes_per_gpu"] == int(usable)
    # INT4: everything but the embedding, head, routers and norms: 669.07B weights x (0.5 + 2/128) bytes
    # = 334.53 GB packed + 10.45 GB scales = 344.99 GB. Today's learner holds all of it on ONE GPU (321.3 GiB
    # of 133.4 GiB): separate copies do not fit, and the base is what binds.
    separate = doc["separate"]
    assert not separate["fits"] and separate["binding"] == "base_int4" and separate["binding_roles"] == ["learner"]
    assert separate["per_gpu_bytes"]["base_int4"] == 334_532_804_608 + 2 * 669_065_609_216 // 128
    # one shared copy on 8 GPUs: (344.99 GB - the MLA down-projections and routers vLLM keeps whole) / 8, + those
    # whole: 43.5 GB a GPU; with the KV cache of 128 x 2,048 tokens (MLA's 576-wide latent x 61 layers x 2 bytes,
    # a group sharing its prompt) or the learner's checkpointed activations and logits, it peaks at 72.4 GB
    shared = doc["shared"]
    assert shared["fits"] and shared["binding"] == "base_int4"
    rows = shared["groups"][0]["per_gpu_bytes"]
    # split 8 ways but for q_a, kv_a (0.92B weights) and their 7.2M scales, whole on every GPU:
    # (344,986,954,752 - 461,733,888 - 2 x 7,214,592) / 8 + 476,163,072
    assert rows["base_int4"] == (344_986_954_752 - 476_163_072) // 8 + 476_163_072 == 43_540_012_032
    # KV: 16 prompts x 1,024 shared prompt tokens + 128 x 1,024 completion tokens = 147,456 tokens x 61 layers x
    # (512 + 64) x 2 bytes, whole on every rank (MLA)
    assert rows["kv_cache"] == 147_456 * 61 * 576 * 2
    # logits: 12 bytes x one 1,024-position chunk of the log-softmax x 129,280 / 8 (vocabulary-parallel)
    assert rows["logits"] == 12 * 1024 * 129_280 // 8
    # activations: at least each layer's checkpointed input, 16,384 tokens x 61 x 7,168 x 2 bytes = 14.33 GB, whole on each GPU
    assert 16_384 * 61 * 7168 * 2 < rows["activations"] < 16_384 * 61 * 7168 * 2 + 6e9
    # the update (activations + logits, 22.5 GB) is the larger phase; the rollout's KV cache (10.4 GB) takes turns with it
    assert set(shared["per_gpu_bytes"]) == {"base_int4", "base_16bit", "lora", "runtime", "activations", "logits"}
    assert shared["total_bytes"] == sum(shared["per_gpu_bytes"].values()) < usable / 1.9  # half the GPU is headroom
    # full-parameter bf16 + AdamW: 16 bytes a parameter (bf16 weights and gradients, fp32 master + two moments)
    # x 671.03B = 10.74 TB, on 8 x 143.2 GB = 1.146 TB a node: the fp32 state alone (12 bytes x 671.03B / 8 =
    # 1,006.5 GB a GPU) binds. Nodes: 16 P / 8N + KV / N + 1.5 GiB <= 143.2 GB -> N >= 9.55: 10 nodes;
    # with bf16 moments and no master copy (8 bytes a parameter) N >= 4.8: 5 nodes.
    full = doc["full_finetune"]
    assert not full["fits"] and full["binding"] == "optimizer_state"
    assert full["per_gpu_bytes"]["optimizer_state"] == 12 * 671_026_419_200 // 8
    assert full["nodes"] == 10 and full["nodes_bf16_state"] == 5
    assert doc["recommended"] == "shared"


def test_separate_copies_fit_deepseek_once_the_learner_is_sharded_but_not_a_1t_model():
    """Two INT4 copies of DeepSeek-V3 (2 x 345 GB) fit 8 x H200 split 4 + 4; two of a 1T model (2 x 594 GB =
    1,188 GB) exceed the node's 1,146 GB usable before any KV cache: only one shared copy fits."""
    deepseek = plan_json(make_plan(catalog_architecture("deepseek-v3"), deepseek_job(learner_sharded=True)))
    assert deepseek["separate"]["fits"] and deepseek["separate"]["split"] == {"rollout": 4, "learner": 4, "reference": 0}
    rollout, learner = deepseek["separate"]["groups"][:2]
    # each half holds a copy split 4 ways: (344,986,954,752 - 476,163,072) / 4 + 476,163,072 = 86.6 GB
    assert rollout["per_gpu_bytes"]["base_int4"] == learner["per_gpu_bytes"]["base_int4"] == (344_986_954_752 - 476_163_072) // 4 + 476_163_072
    assert rollout["usable_bytes"] == int(0.9 * 143771 * 2**20)  # vLLM takes its gpu_memory_utilization (0.9) of the GPU
    assert rollout["peak_bytes"] < rollout["usable_bytes"] and learner["peak_bytes"] < learner["usable_bytes"]
    kimi = plan_json(make_plan(catalog_architecture("kimi-k2-thinking"), deepseek_job(learner_sharded=True)))
    assert not kimi["separate"]["fits"] and kimi["separate"]["binding"] == "base_int4"
    assert kimi["shared"]["fits"] and kimi["recommended"] == "shared"


def test_vllm_splits_an_int4_model_only_where_each_rank_holds_whole_scale_groups():
    """Qwen3-235B-A22B's experts are 1,536 wide: 8 ways at group 128 leaves 192 columns a rank (1.5 groups),
    which vLLM's INT4 kernels refuse, so one shared copy uses 4 GPUs; at group 32 all 8."""
    arch = catalog_architecture("qwen3-235b-a22b")
    at_128 = plan_json(make_plan(arch, PlanRequest(group_size=128)))
    assert at_128["shared"]["split"] == {"shared": 4} and any("4 stay idle" in n for n in at_128["shared"]["notes"])
    assert plan_json(make_plan(arch, PlanRequest(group_size=32)))["shared"]["split"] == {"shared": 8}


def test_a_rollout_must_fit_vllm_s_share_of_its_gpus():
    """vLLM takes rollout.gpu_memory_utilization (0.9 by default) of each GPU, not the planner's 95%."""
    arch = catalog_architecture("llama-3.1-70b")
    request = PlanRequest(node=NodeSpec(gpus=2, gpu="H100"), prompts=64, group=8, prompt_tokens=1024, completion_tokens=1024,
                          max_model_len=2048)  # fmt: skip
    default = plan_json(make_plan(arch, request))["separate"]["groups"][0]
    assert default["roles"] == ["rollout"] and default["usable_bytes"] == int(0.9 * 81559 * 2**20)
    tight = plan_json(make_plan(arch, request.model_copy(update={"gpu_memory_utilization": 0.5})))["separate"]["groups"][0]
    assert tight["usable_bytes"] == int(0.5 * 81559 * 2**20) and tight["fits"] is False


def test_several_optimizer_steps_a_batch_meet_adamw_s_moments_in_the_first_step():
    from orbit_runtime.plan.planner import learner_step

    arch = catalog_architecture("qwen3-8b")
    one = learner_step(arch, PlanRequest(rank=128), first=True)
    four = learner_step(arch, PlanRequest(rank=128, optimizer_steps=4), first=True)
    moments = one.rows["optimizer_state"]
    held = one.rows["lora_gradients"] + one.rows["step_snapshot"]
    assert one.peak == held + max(moments, one.rows["activations"] + one.rows["logits"])
    assert four.peak == held + moments + one.rows["activations"] + one.rows["logits"]
    later = learner_step(arch, PlanRequest(rank=128), first=False)
    assert "optimizer_state" not in later.rows and later.rows["step_snapshot"] == 3 * one.rows["step_snapshot"]


def test_json_has_the_documented_keys():
    doc = plan_json(make_plan(catalog_architecture("deepseek-v3"), PlanRequest()))
    assert isinstance(doc["total_params"], int) and isinstance(doc["active_params"], int) and isinstance(doc["mtp_params"], int)
    assert doc["mtp_params"] > 0 and doc["total_params"] == pytest.approx(671e9, rel=0.001)
    for layout in ("separate", "shared", "full_finetune"):
        assert isinstance(doc[layout]["fits"], bool) and isinstance(doc[layout]["binding"], str)
        assert sum(doc[layout]["per_gpu_bytes"].values()) == doc[layout]["total_bytes"]  # rows at the peak add up
        for group in doc[layout]["groups"]:
            assert group["peak_bytes"] <= sum(group["per_gpu_bytes"].values())


def test_kv_cache_is_mla_aware_and_shards_gqa_heads_only():
    deepseek, qwen = catalog_architecture("deepseek-v3"), catalog_architecture("qwen3-235b-a22b")
    request = PlanRequest()
    # MLA caches the 512-wide latent + the 64-wide rope key per layer, whole on every tensor-parallel rank
    assert kv_bytes_per_token(deepseek, request, 1) == kv_bytes_per_token(deepseek, request, 8) == 61 * 576 * 2
    # GQA: K and V of 4 KV heads x 128 per layer, split over the ranks, replicated past 4
    assert kv_bytes_per_token(qwen, request, 1) == 94 * 2 * 4 * 128 * 2
    assert kv_bytes_per_token(qwen, request, 4) == kv_bytes_per_token(qwen, request, 8) == 94 * 2 * 1 * 128 * 2


def test_activations_follow_checkpointing_micro_batches_and_the_adapter():
    arch = catalog_architecture("qwen2.5-7b")
    base = PlanRequest(prompt_tokens=1000, completion_tokens=1048, micro_batch_tokens=16384)
    assert micro_batch(base).rows == 8 and micro_batch(base).tokens == 8 * 2048
    with_gc, without = update_memory(arch, base), update_memory(arch, base.model_copy(update={"gradient_checkpointing": False}))
    assert without.activations > 10 * with_gc.activations
    # logits: 12 bytes x 8 x 2,047 tokens x 152,064 vocabulary entries, whatever the checkpointing
    assert with_gc.logits_unchunked == without.logits_unchunked == int(12 * 8 * 2047 * 152064)
    assert with_gc.logits == int(12 * 1024 * 152064)  # the learner's log-softmax runs 1,024 tokens at a time
    # PEFT keeps an fp32 copy of each wrapped linear's input in a bf16 learner: 5 copies of the hidden state
    # (q, k, v, gate, up), o's and down's inputs; fewer targets, fewer copies
    all_targets = layer_saved(arch, 0, base)
    attention_only = layer_saved(arch, 0, base.model_copy(update={"targets": ("q_proj", "k_proj", "v_proj", "o_proj")}))
    assert all_targets.fp32_whole - attention_only.fp32_whole == 2 * 3584 + 3 * 16  # gate's and up's inputs, 3 A outputs
    assert all_targets.fp32_split - attention_only.fp32_split == 18944  # down's input (split by tensor parallelism)
    fp32 = layer_saved(arch, 0, base.model_copy(update={"learner_dtype": "fp32"}))
    assert fp32.fp32_whole < all_targets.fp32_whole  # an fp32 learner keeps shared inputs once


def test_gpus_from_the_table_and_from_node_labels():
    assert gpu_model("h200").name == "H200" and gpu_model("NVIDIA-H100-80GB-HBM3").name == "H100"
    assert gpu_from_node_selector({"nvidia.com/gpu.product": "NVIDIA-B200"}).name == "B200"
    assert gpu_from_node_selector({"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}).name == "MI300X"
    assert gpu_from_label("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb") is None  # a slice of a GPU: never taken for a whole one
    assert gpu_from_label("NVIDIA-H100-80GB-HBM3-SHARED") is None
    assert gpu_from_node_selector({"kubernetes.io/hostname": "n1"}) is None
    with pytest.raises(PlanError, match="'A100' is not in the planner's table"):
        gpu_model("A100")
    assert math.isclose(gpu_model("H200").usable_bytes / 2**30, 133.4, abs_tol=0.05)


def test_every_catalog_model_plans_on_every_gpu_of_the_table():
    for name in names():
        for gpu in ("H100", "H200", "B200", "MI300X"):
            doc = plan_json(make_plan(catalog_architecture(name), PlanRequest(node=NodeSpec(gpus=8, gpu=gpu))))
            assert doc["total_params"] > 0 and doc["shared"]["per_gpu_bytes"], (name, gpu)


def test_the_planner_imports_no_torch_or_transformers():
    code = ("import sys, orbit_runtime.plan.planner, orbit_runtime.plan.job_fit, orbit_runtime.plan.report, orbit_runtime.plan.compare;"
            " bad = [m for m in ('torch', 'transformers', 'vllm', 'peft') if m in sys.modules]; assert not bad, bad")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


SMALL = {  # every config type the planner reads, beyond the catalog's: small shapes, counted by transformers too
    "qwen2_moe (shared expert with its gate, q/k/v biases, a dense layer)": {
        "model_type": "qwen2_moe", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [0]},
    "qwen3_moe (every other layer sparse)": {
        "model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8,
        "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": []},
    "deepseek_v2 (MLA without a q latent, greedy routing)": {
        "model_type": "deepseek_v2", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 64,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 8, "n_shared_experts": 2,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1},
    "mistral": {"model_type": "mistral", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 1},
    "qwen2 with tied embeddings": {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
                                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "llama with attention and MLP biases": {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
                                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                            "attention_bias": True, "mlp_bias": True},
}  # fmt: skip


def transformers_count(config: dict) -> int:
    """Parameters (and non-rotary buffers: DeepSeek's fp32 routing bias) of transformers' own model of CONFIG, on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("quantization_config", "model_type")}
    model_type = "deepseek_v3" if config["model_type"] == "kimi_k2" else config["model_type"]  # Kimi K2 is DeepSeek-V3's code
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for n, b in model.named_buffers() if "inv_freq" not in n)


@pytest.mark.parametrize("name", names())
def test_catalog_counts_equal_transformers_own_models(name):
    """Every parameter, exactly: the planner's count of each catalog config against transformers' model of it
    (transformers builds no MTP layer; the planner counts it apart)."""
    config = catalog_config(name)
    assert count_parameters(parse_architecture(config, name)).total == transformers_count(config)


@pytest.mark.parametrize("name", list(SMALL))
def test_every_config_type_counts_as_transformers_does(name):
    config = SMALL[name]
    assert count_parameters(parse_architecture(config, name)).total == transformers_count(config)
