"""The learner keeps the base packed, trains only LoRA, and computes what a dense model would."""

import pytest
import torch

from orbit_runtime.config import AdapterSpec
from orbit_runtime.errors import OrbitError
from orbit_runtime.learner.dense_reference import load_dequantized_dense_model
from orbit_runtime.learner.int4_linear import Int4Linear
from orbit_runtime.learner.model import load_policy

ADAPTER = AdapterSpec(rank=8, alpha=16)


def test_int4_linear_gradients_match_dense():
    torch.manual_seed(0)
    layer = Int4Linear(256, 64, group_size=128, bias=True, dtype=torch.float32)
    layer.weight_packed.copy_(torch.randint(-(2**31), 2**31 - 1, layer.weight_packed.shape, dtype=torch.int32))
    layer.weight_scale.copy_(torch.rand_like(layer.weight_scale) * 0.01)
    layer.bias.copy_(torch.randn(64))
    dense = torch.nn.Linear(256, 64)
    dense.weight.data = layer.dequantized_weight()
    dense.bias.data = layer.bias.clone()
    x1 = torch.randn(3, 5, 256, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    (layer(x1) ** 2).sum().backward()
    (dense(x2) ** 2).sum().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-5, rtol=1e-5)
    assert not any(t.requires_grad for t in layer.buffers())


def test_base_stays_packed_and_frozen(int4_dir):
    policy = load_policy(int4_dir, ADAPTER, dtype="bf16")
    int4_layers = [m for m in policy.model.modules() if isinstance(m, Int4Linear)]
    assert len(int4_layers) == 4 * 7
    for layer in int4_layers:
        assert layer.weight_packed.dtype == torch.int32
        assert layer.weight_packed.nbytes == layer.in_features * layer.out_features // 2
        assert not hasattr(layer, "_parameters") or "weight" not in layer._parameters
    memory = policy.base_memory()
    assert memory.packed_bytes < 0.3 * memory.quantized_params * 2  # vs bf16 dense: ~0.27
    # no tensor anywhere in the model is a dense copy of a quantized weight
    shapes = {(m.out_features, m.in_features) for m in int4_layers}
    for name, tensor in [*policy.model.named_parameters(), *policy.model.named_buffers()]:
        if "embed_tokens" in name or "lm_head" in name:
            continue  # 16 bit by design
        if tensor.is_floating_point() and tuple(tensor.shape) in shapes:
            pytest.fail(f"dense {tuple(tensor.shape)} tensor {name} in the learner")

    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    policy.init_adapter_randomly(std=0.02, seed=0)
    ids = torch.randint(0, 96, (2, 24))
    policy.token_logprobs(ids).sum().backward()
    with_grad = {n for n, p in policy.model.named_parameters() if p.grad is not None}
    assert with_grad == trainable
    assert all(t.grad is None for t in policy.model.buffers())


def test_learner_equals_dense_model_on_dequantized_weights(demo_dir, int4_dir, tmp_path):
    """fp32: the packed learner computes what a dense model holding the INT4 values computes,
    and its saved adapter loads as is into transformers + peft with the same result."""
    from peft import PeftModel

    policy = load_policy(int4_dir, ADAPTER, dtype="fp32")
    policy.init_adapter_randomly(std=0.02, seed=1)
    ids = torch.randint(0, 96, (2, 32))
    with torch.no_grad():
        ours = policy.token_logprobs(ids)
        with policy.adapter_disabled():
            ours_base = policy.token_logprobs(ids)
    adapter_dir = policy.save_adapter(tmp_path / "adapter")

    dense = load_dequantized_dense_model(demo_dir, int4_dir)
    peft_model = PeftModel.from_pretrained(dense, adapter_dir)
    with torch.no_grad():
        logits = peft_model(input_ids=ids).logits[:, :-1].float()
        theirs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        with peft_model.disable_adapter():
            logits = peft_model(input_ids=ids).logits[:, :-1].float()
            theirs_base = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours_base - theirs_base).abs().max() < 1e-4
    assert (ours - ours_base).abs().mean() > 1e-2  # the adapter really does something


def test_completion_logprobs_are_independent_of_batch_padding(int4_dir):
    policy = load_policy(int4_dir, ADAPTER, dtype="fp32")
    pairs = [([97, 66, 67], [20, 21, 22, 23]), ([97, 68], [24])]
    with torch.no_grad():
        batched = policy.completion_logprobs(pairs)
        alone = [policy.completion_logprobs([pair])[0] for pair in pairs]
    for b, a, (_, completion) in zip(batched, alone, pairs, strict=True):
        assert b.shape == (len(completion),)
        assert torch.allclose(b, a, atol=1e-5)


def _full_vocabulary_logprobs(policy, pairs, temperature):
    """The log-probs as the learner took them before: an fp32 log-softmax over every position."""
    rows = []
    for prompt, completion in pairs:
        ids = torch.tensor([prompt + completion])
        logits = policy.model(input_ids=ids, use_cache=False).logits[:, :-1].float() / temperature
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)[0]
        rows.append(logprobs[len(prompt) - 1 :])
    return rows


def test_completion_logprobs_reach_the_lm_head_for_completion_tokens_only_in_chunks(int4_dir):
    """Only completion positions are scored, CHUNK at a time in forward and in backward; the
    values and the adapter's gradients equal the full-vocabulary log-softmax's (fp32)."""
    policy = load_policy(int4_dir, ADAPTER, dtype="fp32")
    policy.init_adapter_randomly(std=0.05, seed=3)
    policy.logprob_chunk_tokens = 3
    pairs = [([97, 66, 67, 68, 69, 70], [20, 21, 22, 23, 24]), ([97, 68], [24, 25])]
    head_rows = []
    hook = policy.model.get_base_model().get_output_embeddings().register_forward_hook(
        lambda _m, _i, out: head_rows.append(out.shape[:-1].numel())
    )
    try:
        ours = policy.completion_logprobs(pairs, temperature=0.7)
        sum(row.sum() for row in ours).backward()
    finally:
        hook.remove()
    # 7 completion tokens in chunks of 3: forward 3+3+1, recomputed in backward 3+3+1
    assert sorted(head_rows) == [1, 1, 3, 3, 3, 3], head_rows
    ours_grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    policy.model.zero_grad(set_to_none=True)
    theirs = _full_vocabulary_logprobs(policy, pairs, 0.7)
    sum(row.sum() for row in theirs).backward()
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape and (a - b).abs().max() < 1e-5
    assert ours_grads and all(torch.allclose(g, policy.model.get_parameter(n).grad, atol=1e-5, rtol=1e-4)
                              for n, g in ours_grads.items())  # fmt: skip


def test_bad_inputs_name_the_problem(demo_dir, int4_dir):
    with pytest.raises(OrbitError, match="no quantization_config"):
        load_policy(demo_dir, ADAPTER)
    with pytest.raises(OrbitError, match=r"target_modules \['qkv'\]"):
        load_policy(int4_dir, AdapterSpec(target_modules=["qkv"]))
    with pytest.raises(OrbitError, match="dtype 'int8'"):
        load_policy(int4_dir, ADAPTER, dtype="int8")
