"""Self-checking GPU run of the INT4 learner (not run by CI; needs CUDA for the real check).

Builds a random ~1B-parameter Qwen2-shape model, quantizes it with `orbit quantize`'s code,
loads the packed learner with LoRA on the GPU and runs `orbit train`'s update
(`policy_update`: micro-batches under learner.micro_batch_tokens, gradient checkpointing,
GRPO loss, AdamW) on an RL-length batch (8 prompts x 8 completions x 1,024 tokens by
default). Reports peak GPU memory (allocated and reserved), step time, and log-prob agreement
with a CPU fp32 reference that holds the dequantized INT4 weights densely. Exits non-zero
if a check fails.

    python benchmarks/gpu_learner_check.py --json gpu-check.json           # on a CUDA machine
    python benchmarks/gpu_learner_check.py --device cpu --layers 2 --hidden 256 --intermediate 512 \
        --prompts 2 --group 2 --completion-tokens 64  # smoke test
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmark_output import emit_json
from gpu_update_timing import timed_updates


def dense_reference_logprobs(int4_dir: Path, dense_dir: Path, adapter_dir: Path, ids):
    """fp32 CPU model whose linears hold the dequantized INT4 weights, plus the same adapter."""
    import torch
    from peft import PeftModel

    from orbit_runtime.learner.dense_reference import load_dequantized_dense_model

    model = PeftModel.from_pretrained(load_dequantized_dense_model(dense_dir, int4_dir), adapter_dir)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="learner.micro_batch_tokens")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from orbit_runtime.config import AdapterSpec
    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int
    from orbit_runtime.learner.model import load_policy

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available; run with --device cpu for a smoke test", file=sys.stderr)
        return 2
    cuda = args.device.startswith("cuda")
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    checks: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="orbit-gpu-check-") as tmp:
        dense_dir, int4_dir = Path(tmp) / "dense", Path(tmp) / "int4"
        config = Qwen2Config(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
            num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
            num_key_value_heads=max(1, args.hidden // 512), tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        result["model_params"] = sum(p.numel() for p in model.parameters())
        model.save_pretrained(dense_dir)
        del model
        started = time.monotonic()
        quantize_checkpoint(dense_dir, int4_dir, W4A16Int(group_size=128))
        result["quantize_seconds"] = round(time.monotonic() - started, 1)

        adapter = AdapterSpec(rank=args.rank, alpha=2 * args.rank)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        policy = load_policy(int4_dir, adapter, dtype="bf16", device=args.device)
        policy.init_adapter_randomly(std=0.02, seed=0)
        policy.set_gradient_checkpointing(True)
        result["base_memory"] = vars(policy.base_memory())
        if cuda:
            result["gpu_bytes_after_load"] = torch.cuda.memory_allocated()
        batch = timed_updates(policy, args, cuda, result, checks)

        adapter_dir = policy.save_adapter(Path(tmp) / "adapter")
        prompt, completion = batch.pairs[0]
        probe = torch.tensor([(prompt + completion)[:128]])
        with torch.no_grad():
            learner_bf16 = policy.token_logprobs(probe.to(args.device)).float().cpu()
        del policy
        if cuda:
            torch.cuda.empty_cache()
        fp32_policy = load_policy(int4_dir, adapter, dtype="fp32", device=args.device)
        fp32_policy.load_adapter_state({k: v for k, v in _adapter_tensors(adapter_dir).items()})
        with torch.no_grad():
            if cuda:
                torch.backends.cuda.matmul.allow_tf32 = False
            learner_fp32 = fp32_policy.token_logprobs(probe.to(args.device)).cpu()
        reference = dense_reference_logprobs(int4_dir, dense_dir, adapter_dir, probe)
        result["mean_abs_dlogp_fp32_vs_cpu_reference"] = float((learner_fp32 - reference).abs().mean())
        result["mean_abs_dlogp_bf16_vs_cpu_reference"] = float((learner_bf16 - reference).abs().mean())
        checks["fp32_matches_reference"] = result["mean_abs_dlogp_fp32_vs_cpu_reference"] < 1e-3
        checks["bf16_near_reference"] = result["mean_abs_dlogp_bf16_vs_cpu_reference"] < 1e-1
    result["checks"] = checks
    result["ok"] = all(checks.values())
    emit_json(result, args.json)
    return 0 if result["ok"] else 1


def _adapter_tensors(adapter_dir: Path) -> dict:
    """Saved PEFT adapter tensors keyed like the live model's parameters (with `.default.`)."""
    from safetensors.torch import load_file

    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    return {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}


if __name__ == "__main__":
    sys.exit(main())
