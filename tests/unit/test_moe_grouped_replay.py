"""Grouped INT4 expert compute and routing replay (R3) in the MoE learner.

- grouped == the per-expert loop: log-probs and every LoRA gradient (routed experts included), fp32;
- replay: the experts used are the rollout's for every position and layer, whatever the
  learner's router says; their gate weights are the learner's own scores at those experts
  (checked against a hand computation), and gradients flow through them.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from orbit_runtime.config import AdapterSpec
from orbit_runtime.learner.model import load_policy
from orbit_runtime.learner.routing_replay import RoutedExperts


def _build(root: Path, arch: str) -> Path:
    from orbit_runtime.demo_model import write_demo_model
    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int

    dst = root / f"{arch}-int4"
    quantize_checkpoint(write_demo_model(root / arch, seed=3, arch=arch), dst, W4A16Int(group_size=128))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-grouped")
    return {arch: _build(root, arch) for arch in ("qwen3_moe", "deepseek_v3")}


def _pairs(seed: int, count: int = 3) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, 96, (5 + i,), generator=g).tolist(), torch.randint(3, 96, (7 + 2 * i,), generator=g).tolist())
            for i in range(count)]  # fmt: skip


TARGETS = {"qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj"]}  # fmt: skip


def _policy(path: Path, routed_experts: bool = True):
    targets = TARGETS["deepseek_v3" if "deepseek" in path.name else "qwen3_moe"]
    policy = load_policy(path, AdapterSpec(rank=4, alpha=8, routed_experts=routed_experts, target_modules=targets),
                         dtype="fp32")  # fmt: skip
    policy.init_adapter_randomly(std=0.05, seed=1)
    return policy


def _grads(policy, pairs, routed=None):
    policy.model.zero_grad(set_to_none=True)
    with policy.routed(routed):
        rows = policy.completion_logprobs(pairs)
        sum((r * torch.linspace(-1, 1, r.numel())).sum() for r in rows).backward()
    # an expert no token chose gets no gradient from the loop and a zero one from the grouped GEMM
    return [r.detach() for r in rows], {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                        for n, p in policy.model.named_parameters() if p.requires_grad}  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_grouped_expert_compute_equals_the_loop(arch, models):
    policy = _policy(models[arch])
    blocks = policy.moe_blocks()
    assert blocks and all(set(b.stacked) == {"gate_proj", "up_proj", "down_proj"} for b in blocks)
    expert = blocks[0].experts[5].gate_proj.base_layer
    assert expert.weight_packed.data_ptr() == blocks[0].stacked["gate_proj"][0][5].data_ptr()  # a view, not a copy
    pairs = _pairs(0)
    grouped_rows, grouped_grads = _grads(policy, pairs)
    policy.set_expert_compute("loop")
    loop_rows, loop_grads = _grads(policy, pairs)
    worst_logp = max((a - b).abs().max().item() for a, b in zip(grouped_rows, loop_rows, strict=True))
    routed_names = [n for n in loop_grads if ".experts." in n and "shared" not in n]
    assert routed_names, "LoRA on routed experts must be part of the comparison"
    worst_grad = max((grouped_grads[n] - loop_grads[n]).abs().max().item() for n in loop_grads)
    largest = max(g.abs().max().item() for g in loop_grads.values())
    print(f"{arch}: grouped vs loop max |dlogp| {worst_logp:.1e}, max |dgrad| {worst_grad:.1e} (largest {largest:.1e})")
    assert worst_logp < 1e-5 and largest > 1e-3 and worst_grad < 1e-5 * max(1.0, largest)


def _rollout_routing(policy, pairs, seed: int) -> list[np.ndarray]:
    """Random rollout experts (distinct per position), [positions, layers, k] per sample."""
    g = torch.Generator().manual_seed(seed)
    spec = policy.moe_blocks()[0].gate.spec
    layers = policy.model.config.num_hidden_layers
    out = []
    for prompt, completion in pairs:
        n = len(prompt) + len(completion) - 1
        out.append(torch.rand(n, layers, spec.num_experts, generator=g).argsort(-1)[..., : spec.top_k].numpy().astype(np.uint8))
    return out


class GateSpy:
    """Records, per MoE layer, the router logits (keeping their gradient) and the experts each forward used."""

    def __init__(self, policy) -> None:
        from orbit_runtime.learner import moe as moe_module

        self.logits: dict[int, torch.Tensor] = {}
        self.ids: list[torch.Tensor] = []
        self._module, self._real = moe_module, moe_module.gate_weights
        self._layers = [b.layer_index for b in policy.moe_blocks()]

    def __enter__(self) -> GateSpy:
        layers = itertools.cycle(self._layers)  # blocks run in layer order, every forward

        def spy(logits, ids, spec):
            layer = next(layers)
            if logits.requires_grad:
                logits.retain_grad()
            self.logits[layer] = logits
            self.ids.append(ids.clone())
            return self._real(logits, ids, spec)

        self._module.gate_weights = spy
        return self

    def __exit__(self, *exc) -> None:
        self._module.gate_weights = self._real


def _forwarded(pairs) -> torch.Tensor:
    """Which rows of the padded [B * width] layout the rollout forwarded (all but the last token)."""
    width = max(len(p) + len(c) for p, c in pairs)
    mask = torch.zeros(len(pairs) * width, dtype=torch.bool)
    for b, (p, c) in enumerate(pairs):
        mask[b * width : b * width + len(p) + len(c) - 1] = True
    return mask


def test_replay_uses_the_rollouts_experts_and_gradients_reach_the_router(models):
    """Every forwarded position of every layer uses the rollout's experts; the loss's gradient
    reaches the learner's router logits through the recomputed gate weights."""
    policy = _policy(models["qwen3_moe"], routed_experts=False)
    pairs = _pairs(1)
    routing = _rollout_routing(policy, pairs, seed=2)
    with GateSpy(policy) as spy, policy.routed(policy.routed_experts_for(pairs, routing)):
        rows = policy.completion_logprobs(pairs)
        sum(r.sum() for r in rows).backward()
    forwarded = _forwarded(pairs)
    expected = torch.cat([torch.from_numpy(r.astype(np.int64)) for r in routing])  # [positions, layers, k]
    for layer, ids in enumerate(spy.ids):
        assert torch.equal(ids[forwarded], expected[:, layer])
        assert spy.logits[layer].grad is not None and spy.logits[layer].grad[forwarded].abs().sum() > 0


def test_gate_weights_of_replayed_experts_equal_a_hand_computation():
    """softmax(logits) in fp32 at the given experts, renormalised over them; gradient included."""
    from orbit_runtime.moe_routing import RoutingSpec, gate_weights

    spec = RoutingSpec(8, 2, "softmax", True)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    ids = torch.tensor([[0, 3], [7, 1], [2, 3], [5, 6]])
    weights = gate_weights(logits, ids, spec)
    by_hand = torch.empty(4, 2)
    for n in range(4):
        exp = [float(torch.exp(logits[n, e])) for e in ids[n].tolist()]
        by_hand[n] = torch.tensor([v / sum(exp) for v in exp])  # the denominator of the softmax cancels
    assert torch.allclose(weights, by_hand, atol=1e-6)
    weights[:, 0].sum().backward()
    # d w0 / d logit_{e0} = w0 (1 - w0), d w0 / d logit_{e1} = -w0 w1, other experts 0
    expected = torch.zeros(4, 8)
    for n in range(4):
        w0, w1 = by_hand[n]
        expected[n, ids[n, 0]] = w0 * (1 - w0)
        expected[n, ids[n, 1]] = -w0 * w1
    assert torch.allclose(logits.grad, expected, atol=1e-6)


def test_a_perturbed_router_moves_the_weights_never_the_replayed_experts(models):
    """With replay, changing the router's weights changes the log-probs (the gate weights) but not
    the experts used; without replay the same change moves the experts too."""
    policy = _policy(models["qwen3_moe"], routed_experts=False)
    pairs = _pairs(3)
    routing = _rollout_routing(policy, pairs, seed=4)
    noise = {b.layer_index: 0.5 * torch.randn(b.gate.weight.shape, generator=torch.Generator().manual_seed(b.layer_index))
             for b in policy.moe_blocks()}  # fmt: skip

    def run(perturbed: bool, replay: bool):
        saved = {b: b.gate.weight.detach().clone() for b in policy.moe_blocks()}
        if perturbed:
            with torch.no_grad():
                for b in policy.moe_blocks():
                    b.gate.weight.add_(noise[b.layer_index])
        try:
            with GateSpy(policy) as spy, torch.no_grad():
                with policy.routed(policy.routed_experts_for(pairs, routing) if replay else None):
                    rows = policy.completion_logprobs(pairs)
        finally:
            with torch.no_grad():
                for b, weight in saved.items():
                    b.gate.weight.copy_(weight)
        return spy.ids, rows

    forwarded = _forwarded(pairs)
    base_ids, base_rows = run(perturbed=False, replay=True)
    moved_ids, moved_rows = run(perturbed=True, replay=True)
    for a, b in zip(base_ids, moved_ids, strict=True):
        assert torch.equal(a[forwarded], b[forwarded])
    assert max((x - y).abs().max().item() for x, y in zip(base_rows, moved_rows, strict=True)) > 1e-4
    own_ids, _ = run(perturbed=False, replay=False)
    own_moved, _ = run(perturbed=True, replay=False)
    assert any(not torch.equal(a[forwarded], b[forwarded]) for a, b in zip(own_ids, own_moved, strict=True))


def test_compare_mode_counts_agreement_per_layer(models):
    """Compare mode keeps the learner's routing and counts positions whose experts equal the rollout's."""
    policy = _policy(models["qwen3_moe"], routed_experts=False)
    pairs = _pairs(5)
    with GateSpy(policy) as spy, torch.no_grad():
        policy.completion_logprobs(pairs)
    forwarded = _forwarded(pairs)
    layers = policy.model.config.num_hidden_layers
    own = torch.stack([ids[forwarded] for ids in spy.ids], dim=1).numpy().astype(np.uint8)  # [positions, layers, k]
    lengths = [len(p) + len(c) - 1 for p, c in pairs]
    routing = list(np.split(own, np.cumsum(lengths)[:-1]))
    first = routing[0][2, 1]
    routing[0][2, 1] = [e for e in range(8) if e not in first][:2]  # one position of layer 1 differs
    compared = policy.routed_experts_for(pairs, routing, mode="compare")
    with torch.no_grad(), policy.routed(compared):
        policy.completion_logprobs(pairs)
    agreement = compared.agreement
    positions = sum(lengths)
    assert agreement.compared == {layer: positions for layer in range(layers)}
    assert agreement.agreeing == {0: positions, 1: positions - 1, 2: positions, 3: positions}
    assert agreement.tokens_compared == positions and agreement.tokens_agreeing == positions - 1


def test_routing_that_does_not_fit_is_not_replayed(models):
    policy = _policy(models["qwen3_moe"], routed_experts=False)
    pairs = _pairs(6, count=2)
    good = _rollout_routing(policy, pairs, seed=7)
    gap = good[1].copy()
    gap[3] = 255  # a position the rollout could not fill (routing_capture.py)
    routed = RoutedExperts(pairs, [good[0][:-1], gap], policy.model.config.num_hidden_layers, 2, 8)
    assert routed.missing == 2 and bool((routed.plan == -1).all())
    assert RoutedExperts(pairs, good, policy.model.config.num_hidden_layers, 2, 8).missing == 0
