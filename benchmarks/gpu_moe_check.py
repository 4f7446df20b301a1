"""Self-checking GPU run of the MoE learner (not run by CI; needs CUDA for the real check).

Builds a random Qwen3-MoE model (by default ~1.9B parameters: 6 layers, 64 experts of width
768, 8 per token, hidden 2048), quantizes it with `orbit quantize`'s code, loads the packed
learner with LoRA on the GPU (attention, and with --routed-experts every routed expert) and
runs `orbit train`'s update (`policy_update`: micro-batches, gradient checkpointing, GRPO
loss, AdamW) on an RL-length batch. Reports peak GPU memory, step time, log-prob agreement
of the GPU learner (fp32 and bf16) with a CPU fp32 transformers model holding the
dequantized INT4 weights (its own fused experts and routing), and how often both choose the
same experts. Also (issue: grouped experts and routing replay) on the device: the grouped expert
compute equals the per-expert loop (bf16 log-probs, LoRA gradients) and is timed against it,
and replaying the learner's own routing reproduces its log-probs while a perturbed router
leaves replayed experts unchanged. Exits non-zero if a check fails.

    python benchmarks/gpu_moe_check.py --json gpu-moe-check.json          # on a CUDA machine
    python benchmarks/gpu_moe_check.py --device cpu --layers 2 --hidden 256 --experts 8 --top-k 2 \
        --expert-intermediate 128 --vocab 512 --prompts 2 --group 2 --completion-tokens 32  # smoke test
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmark_output import emit_json
from gpu_update_timing import timed_updates


def reference_with_adapter(dense_dir: Path, int4_dir: Path, adapter, adapter_state: dict):
    """CPU fp32 transformers model on the dequantized INT4 weights, with the learner's adapter values."""
    import torch
    from peft import get_peft_model

    from orbit_runtime.learner.dense_reference import load_dequantized_dense_model
    from orbit_runtime.learner.model import lora_config
    from orbit_runtime.learner.moe import per_expert_peft_layout

    base = load_dequantized_dense_model(dense_dir, int4_dir)
    with per_expert_peft_layout(base):  # keep PEFT from remapping targets onto the fused experts
        model = get_peft_model(base, lora_config(adapter))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(set(adapter_state) - set(params))
    if missing:  # routed-expert LoRA has no module in transformers' fused experts
        return None, missing
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(adapter_state[name].float().cpu())
    return model.eval(), []


def logprobs_and_routing(model, ids, router_type):
    """Token log-probs [1, T-1] and each MoE layer's chosen experts per token (sorted)."""
    import torch

    chosen = []

    def hook(_module, _inputs, output):
        indices = output[-1] if isinstance(output, tuple) else output
        chosen.append(indices.sort(-1).values.cpu())

    hooks = [m.register_forward_hook(hook) for m in model.modules() if type(m).__name__ == router_type]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    for handle in hooks:
        handle.remove()
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logprobs.cpu(), chosen


def grouped_and_replay_checks(policy, batch, args, cuda: bool, result: dict, checks: dict) -> None:
    """On the device: grouped == loop (log-probs, LoRA grads) and their times; replay of the learner's own
    routing changes nothing; with replay a perturbed router moves the gate weights, not the experts."""
    import torch

    pairs = batch.pairs[: max(2, len(batch.pairs) // 8)]

    def run(mode: str):
        policy.set_expert_compute(mode)
        policy.model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        with policy.training():
            rows = policy.completion_logprobs(pairs)
            sum(r.float().sum() for r in rows).backward()
        if cuda:
            torch.cuda.synchronize()
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).float().clone()
                 for n, p in policy.model.named_parameters() if p.requires_grad}  # fmt: skip
        return [r.detach().float() for r in rows], grads, time.perf_counter() - started

    run("grouped")  # warm-up
    grouped_rows, grouped_grads, grouped_s = run("grouped")
    loop_rows, loop_grads, loop_s = run("loop")
    policy.set_expert_compute("grouped")
    result["grouped_vs_loop"] = {
        "max_abs_dlogp": max(float((a - b).abs().max()) for a, b in zip(grouped_rows, loop_rows, strict=True)),
        "max_abs_dgrad": max(float((grouped_grads[n] - loop_grads[n]).abs().max()) for n in loop_grads),
        "largest_grad": max(float(g.abs().max()) for g in loop_grads.values()),
        "grouped_seconds": grouped_s, "loop_seconds": loop_s,
    }  # fmt: skip
    g = result["grouped_vs_loop"]
    checks["grouped_equals_loop"] = g["max_abs_dlogp"] < 5e-2 and g["max_abs_dgrad"] <= 5e-2 * max(1.0, g["largest_grad"])
    # replay: the learner's own routing, captured in compare mode, replayed
    compared_positions = [len(p) + len(c) - 1 for p, c in pairs]
    layers = policy.model.config.num_hidden_layers
    top_k = policy.moe_blocks()[0].gate.spec.top_k
    import numpy as np

    probe = policy.routed_experts_for(pairs, [np.zeros((n, layers, top_k), dtype=np.uint8) for n in compared_positions],
                                      mode="compare", keep_own=True)  # fmt: skip
    with torch.no_grad(), policy.routed(probe):
        own_rows = policy.completion_logprobs(pairs)
    moe_layers = [b.layer_index for b in policy.moe_blocks()]
    routing = []
    for sample in range(len(pairs)):
        rows = np.zeros((compared_positions[sample], layers, top_k), dtype=np.int64)
        for layer in moe_layers:
            rows[:, layer] = probe.own_experts(sample, layer).cpu().numpy()
        routing.append(rows.astype(np.uint8 if policy.moe_blocks()[0].gate.spec.num_experts < 256 else np.uint16))
    with torch.no_grad(), policy.routed(policy.routed_experts_for(pairs, routing)):
        replayed_rows = policy.completion_logprobs(pairs)
    result["replay_own_routing_max_abs_dlogp"] = max(float((a.float() - b.float()).abs().max())
                                                     for a, b in zip(own_rows, replayed_rows, strict=True))  # fmt: skip
    checks["replay_of_own_routing_is_identity"] = result["replay_own_routing_max_abs_dlogp"] < 1e-2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-intermediate", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="learner.micro_batch_tokens")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--routed-experts", action="store_true", help="LoRA on every routed expert too")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from orbit_runtime.config import AdapterSpec
    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int
    from orbit_runtime.learner.model import load_policy

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available; run with --device cpu for a smoke test", file=sys.stderr)
        return 2
    cuda = args.device.startswith("cuda")
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "args": vars(args)}
    result["args"]["json"] = str(args.json) if args.json else None
    checks: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="orbit-gpu-moe-check-") as tmp:
        dense_dir, int4_dir = Path(tmp) / "dense", Path(tmp) / "int4"
        config = Qwen3MoeConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=max(2, args.hidden // 128),
            num_key_value_heads=max(1, args.hidden // 512), head_dim=min(128, args.hidden // 2),
            num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_intermediate,
            norm_topk_prob=True, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
        result["model_params"] = sum(p.numel() for p in model.parameters())
        model.save_pretrained(dense_dir)
        del model
        started = time.monotonic()
        quantize_checkpoint(dense_dir, int4_dir, W4A16Int(group_size=128))
        result["quantize_seconds"] = round(time.monotonic() - started, 1)

        adapter = AdapterSpec(rank=args.rank, alpha=2 * args.rank, routed_experts=args.routed_experts)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        policy = load_policy(int4_dir, adapter, dtype="bf16", device=args.device)
        policy.init_adapter_randomly(std=0.02, seed=0)
        policy.set_gradient_checkpointing(True)
        result["base_memory"] = vars(policy.base_memory())
        result["adapter_params"] = sum(p.numel() for p in policy.trainable_parameters())
        batch = timed_updates(policy, args, cuda, result, checks)
        grouped_and_replay_checks(policy, batch, args, cuda, result, checks)

        adapter_state = policy.adapter_state()
        prompt, completion = batch.pairs[0]
        probe = torch.tensor([(prompt + completion)[:128]])
        learner_bf16, _ = logprobs_and_routing(policy.model, probe.to(args.device), "Router")
        with policy.adapter_disabled():
            learner_bf16_base, _ = logprobs_and_routing(policy.model, probe.to(args.device), "Router")
        del policy
        if cuda:
            torch.cuda.empty_cache()
            torch.backends.cuda.matmul.allow_tf32 = False
        fp32_policy = load_policy(int4_dir, adapter, dtype="fp32", device=args.device)
        fp32_policy.load_adapter_state(adapter_state)
        learner_fp32, learner_routes = logprobs_and_routing(fp32_policy.model, probe.to(args.device), "Router")
        reference, missing = reference_with_adapter(dense_dir, int4_dir, adapter, adapter_state)
        if reference is None:  # compare the base only: disable the adapter on the learner
            result["reference_note"] = f"routed-expert LoRA ({len(missing)} tensors) has no transformers module; base compared"
            with fp32_policy.adapter_disabled():
                learner_fp32, learner_routes = logprobs_and_routing(fp32_policy.model, probe.to(args.device), "Router")
            learner_bf16 = learner_bf16_base
            from orbit_runtime.learner.dense_reference import load_dequantized_dense_model

            reference = load_dequantized_dense_model(dense_dir, int4_dir)
        reference_logprobs, reference_routes = logprobs_and_routing(reference, probe, "Qwen3MoeTopKRouter")
        result["mean_abs_dlogp_fp32_vs_cpu_reference"] = float((learner_fp32 - reference_logprobs).abs().mean())
        result["mean_abs_dlogp_bf16_vs_cpu_reference"] = float((learner_bf16 - reference_logprobs).abs().mean())
        same = sum(int((a == b.cpu()).all(-1).sum()) for a, b in zip(learner_routes, reference_routes, strict=True))
        result["routing_agreement_fp32"] = same / sum(len(a) for a in learner_routes)
        checks["fp32_matches_reference"] = result["mean_abs_dlogp_fp32_vs_cpu_reference"] < 1e-3
        checks["bf16_near_reference"] = result["mean_abs_dlogp_bf16_vs_cpu_reference"] < 1e-1
        checks["routing_agrees"] = result["routing_agreement_fp32"] >= 0.99
    result["checks"] = checks
    result["ok"] = all(checks.values())
    emit_json(result, args.json)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
