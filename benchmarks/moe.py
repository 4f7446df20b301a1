"""MoE learner: routing agreement and the mismatch routing replay removes; grouped vs looped experts.

Routing (on the warmed-up MoE demo model that `make demo-moe` trains, INT4, LoRA on attention
and every routed expert): per dtype (bf16, fp16, vLLM and learner in the same dtype) and seed
(a seed draws the adapter and the prompts), a real vLLM server (CPU build, Orbit's plugin
model, routed experts returned) samples completions; the learner then scores the same tokens
  own        with its own routing (counting, per layer, positions whose k experts equal vLLM's,
             and positions routed like vLLM in every layer), and
  replayed   with vLLM's experts (routing replay, R3),
reporting mean / max |dlogp| of each, and the mean |dlogp| on tokens whose routing differed.

Compute: the learner's update time (forward, backward, AdamW: `policy_update`) on an RL batch,
experts grouped (one grouped GEMM per projection and layer) vs looped (one call per expert
with tokens: the implementation before), interleaved, several repeats; and one MoE layer's
forward + backward alone at more experts per layer, where the loop's launches add up.

    python benchmarks/moe.py --json benchmarks/results/moe.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmark_output import emit_json

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def sample_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 24))] for _ in range(count)]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def routing_run(policy, completions, dtype: str) -> dict:
    """Score COMPLETIONS' tokens with the learner's own routing and with vLLM's (replayed)."""
    import torch

    from orbit_runtime.algorithms.mismatch import measure_mismatch

    pairs = [(c.prompt_ids, c.token_ids) for c in completions]
    routing = [c.routed_experts for c in completions]
    rollout = [torch.tensor(c.logprobs) for c in completions]
    compared = policy.routed_experts_for(pairs, routing, mode="compare", keep_own=True)
    with torch.no_grad(), policy.routed(compared):
        own = [r.float() for r in policy.completion_logprobs(pairs)]
    with torch.no_grad(), policy.routed(policy.routed_experts_for(pairs, routing)):
        replayed = [r.float() for r in policy.completion_logprobs(pairs)]
    agreement = compared.agreement
    # tokens whose next-token prediction came from a position with some layer routed differently
    differing_own, differing_replayed = [], []
    for sample, (prompt, completion) in enumerate(pairs):
        ours_per_position = None
        for layer in agreement.per_layer():
            experts = torch.from_numpy(routing[sample][:, layer].astype("int64")).sort(-1).values
            mine = compared.own_experts(sample, layer)
            flips = (experts != mine).any(-1)
            ours_per_position = flips if ours_per_position is None else ours_per_position | flips
        # completion token j is predicted at position len(prompt) - 1 + j
        flipped = ours_per_position[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
        differing_own += (own[sample] - rollout[sample])[flipped].abs().tolist()
        differing_replayed += (replayed[sample] - rollout[sample])[flipped].abs().tolist()
    return {
        "routing_agreement": agreement.overall,
        "routing_token_agreement": agreement.token_agreement,
        "routing_agreement_by_layer": {str(k): v for k, v in agreement.per_layer().items()},
        "missing_samples": compared.missing,
        "own_routing": measure_mismatch(own, rollout).as_dict(),
        "replayed_routing": measure_mismatch(replayed, rollout).as_dict(),
        "tokens_after_a_flip": len(differing_own),
        "own_mean_abs_dlogp_after_a_flip": statistics.fmean(differing_own) if differing_own else None,
        "replayed_mean_abs_dlogp_after_a_flip": statistics.fmean(differing_replayed) if differing_replayed else None,
    }


def routing_benchmark(int4: Path, dtype: str, args: argparse.Namespace, workdir: Path) -> dict:
    from orbit_runtime.config import AdapterSpec
    from orbit_runtime.learner.model import load_policy
    from orbit_runtime.rollout.client import RolloutClient, adapter_name
    from orbit_runtime.rollout.server import VLLMServer, VLLMServerConfig

    policy = load_policy(int4, AdapterSpec(rank=args.rank, alpha=2 * args.rank, routed_experts=True), dtype=dtype,
                         lora_rounding="vllm")  # fmt: skip
    config = VLLMServerConfig(int4, dtype=DTYPES[dtype], max_lora_rank=args.rank, log_path=workdir / f"vllm-{dtype}.log",
                              max_loras=len(args.seeds) + 1, return_routed_experts=True)  # fmt: skip
    runs = []
    with VLLMServer(config) as server:
        client = RolloutClient(server.base_url)
        for index, seed in enumerate(args.seeds):
            policy.init_adapter_randomly(std=args.adapter_std, seed=seed)
            name = adapter_name(index + 1)
            client.load_adapter(name, policy.save_adapter(workdir / f"adapter-{dtype}-{seed}"))
            groups = client.generate(sample_prompts(args.prompts, args.prompt_vocab, seed), model=name,
                                     n=args.samples_per_prompt, max_tokens=args.max_tokens, temperature=1.0, seed=seed,
                                     ignore_eos=True)  # fmt: skip
            runs.append({"seed": seed, **routing_run(policy, [c for g in groups for c in g], dtype)})
        client.close()
    summary = {
        key: spread([r[key] for r in runs])
        for key in ("routing_agreement", "routing_token_agreement")
    }
    summary["own_mean_abs_dlogp"] = spread([r["own_routing"]["mean_abs_dlogp"] for r in runs])
    summary["replayed_mean_abs_dlogp"] = spread([r["replayed_routing"]["mean_abs_dlogp"] for r in runs])
    summary["replayed_over_own"] = spread([r["replayed_routing"]["mean_abs_dlogp"] / r["own_routing"]["mean_abs_dlogp"] for r in runs])
    return {"runs": runs, "summary": summary}


def update_timing(int4: Path, args: argparse.Namespace) -> dict:
    """policy_update seconds, experts grouped vs looped, interleaved (fp32 learner, as the MoE demo)."""
    import torch

    from orbit_runtime.algorithms.grpo import LossConfig
    from orbit_runtime.config import AdapterSpec
    from orbit_runtime.learner.model import load_policy
    from orbit_runtime.learner.update import UpdateBatch, policy_update

    policy = load_policy(int4, AdapterSpec(rank=args.rank, alpha=2 * args.rank, routed_experts=True), dtype="fp32")
    policy.init_adapter_randomly(std=args.adapter_std, seed=0)
    rng = random.Random(0)
    pairs = [(sample_prompts(1, args.prompt_vocab, i)[0], [rng.randrange(3, args.prompt_vocab) for _ in range(args.max_tokens)])
             for i in range(args.update_samples)]  # fmt: skip
    batch = UpdateBatch(pairs=pairs, rollout_logprobs=[torch.full((len(c),), -2.0) for _, c in pairs],
                        advantages=torch.randn(len(pairs), generator=torch.Generator().manual_seed(0)))  # fmt: skip
    state = policy.adapter_state()
    seconds: dict[str, list[float]] = {"grouped": [], "loop": []}
    for repeat in range(args.repeats + 1):  # the first pass of each warms up and is dropped
        for mode in ("grouped", "loop"):
            policy.load_adapter_state(state)
            policy.set_expert_compute(mode)
            optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-4)
            started = time.perf_counter()
            policy_update(policy, optimizer, batch, LossConfig(), temperature=1.0, max_grad_norm=1.0)
            if repeat:
                seconds[mode].append(time.perf_counter() - started)
    ratios = [loop / grouped for loop, grouped in zip(seconds["loop"], seconds["grouped"], strict=True)]
    return {"samples": len(pairs), "tokens": sum(len(p) + len(c) for p, c in pairs),
            "grouped_seconds": spread(seconds["grouped"]), "loop_seconds": spread(seconds["loop"]),
            "loop_over_grouped": spread(ratios)}  # fmt: skip


def layer_timing(experts: int, args: argparse.Namespace) -> dict:
    """One MoE layer's forward + backward (INT4 experts, bf16), grouped vs looped, at EXPERTS experts."""
    import torch

    from orbit_runtime.int4.packing import PACK_FACTOR
    from orbit_runtime.learner.grouped_experts import grouped_expert_forward, looped_expert_forward
    from orbit_runtime.learner.int4_linear import Int4Linear
    from orbit_runtime.learner.moe import ExpertMLP, SparseMoeBlock
    from orbit_runtime.moe_routing import RoutingSpec, select_experts

    hidden, width, top_k, tokens, dtype = args.layer_hidden, args.layer_width, args.layer_top_k, args.layer_tokens, torch.bfloat16
    generator = torch.Generator().manual_seed(experts)
    block = SparseMoeBlock(hidden, width, RoutingSpec(experts, top_k, "softmax", True))

    def packed(out_features: int, in_features: int) -> Int4Linear:
        layer = Int4Linear(in_features, out_features, group_size=128, bias=False, dtype=dtype)
        layer.weight_packed.copy_(torch.randint(-2**31, 2**31 - 1, (out_features, in_features // PACK_FACTOR), generator=generator,
                                                dtype=torch.int64).to(torch.int32))  # fmt: skip
        layer.weight_scale.copy_(torch.rand(layer.weight_scale.shape, generator=generator).to(dtype) * 0.01)
        return layer

    for index in range(experts):
        mlp = ExpertMLP(hidden, width)
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = packed(width, hidden), packed(width, hidden), packed(hidden, width)
        block.experts[index] = mlp
    from orbit_runtime.learner.grouped_experts import stack_expert_weights

    stack_expert_weights(block)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=generator), block.gate.spec)
    seconds: dict[str, list[float]] = {"grouped": [], "loop": []}
    for repeat in range(args.repeats + 1):
        for mode in ("grouped", "loop"):
            inputs = x.clone().requires_grad_()
            started = time.perf_counter()
            if mode == "grouped":
                out = grouped_expert_forward(inputs, weights, ids, block)
            else:
                out = looped_expert_forward(inputs, weights, ids, block.experts)
            out.float().square().mean().backward()
            if repeat:
                seconds[mode].append(time.perf_counter() - started)
    ratios = [loop / grouped for loop, grouped in zip(seconds["loop"], seconds["grouped"], strict=True)]
    return {"experts": experts, "top_k": top_k, "tokens": tokens, "hidden": hidden, "expert_width": width,
            "grouped_seconds": spread(seconds["grouped"]), "loop_seconds": spread(seconds["loop"]),
            "loop_over_grouped": spread(ratios)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the result here as well as to stdout")
    parser.add_argument("--warmup-steps", type=int, default=400, help="as `make demo-moe` (orbit demo-model --warmup-steps)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-vocab", type=int, default=96, help="prompt token ids are drawn from [3, N)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--adapter-std", type=float, default=0.02, help="std of lora_B (PEFT's zero init is a no-op)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES))
    parser.add_argument("--update-samples", type=int, default=64, help="samples in the timed policy update")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layer-experts", type=int, nargs="+", default=[8, 64, 128])
    parser.add_argument("--layer-top-k", type=int, default=8)
    parser.add_argument("--layer-tokens", type=int, default=2048)
    parser.add_argument("--layer-hidden", type=int, default=512)
    parser.add_argument("--layer-width", type=int, default=256)
    args = parser.parse_args(argv)

    from orbit_runtime.demo_model import write_demo_model
    from orbit_runtime.demo_warmup import warm_up
    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int

    result: dict = {"model": "the MoE demo model (Qwen3-MoE: 4 layers, 8 experts, 2 per token), warmed up as make demo-moe",
                    "seeds": args.seeds, "tokens_per_run": args.prompts * args.samples_per_prompt * args.max_tokens}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="orbit-moe-") as tmp:
        workdir = Path(tmp)
        src = write_demo_model(workdir / "demo", seed=0, arch="qwen3_moe")
        result["warmup_final_loss"] = warm_up(src, steps=args.warmup_steps, seed=0)
        int4 = workdir / "int4"
        quantize_checkpoint(src, int4, W4A16Int(group_size=128))
        result["routing"] = {dtype: routing_benchmark(int4, dtype, args, workdir) for dtype in args.dtypes}
        result["update"] = update_timing(int4, args)
    result["layer"] = [layer_timing(experts, args) for experts in args.layer_experts]
    emit_json(result, args.json)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
