"""Peak memory of one learner training step: Orbit (INT4 base + LoRA) vs full bf16 fine-tuning.

Both run on the same randomly initialised Qwen2-shape model (>= 300M parameters), each in a
fresh process, the same batch, one step = forward + backward + AdamW step:
  orbit    packed INT4 base (loaded from the quantized checkpoint) + LoRA on all linears,
           LoRA weights and AdamW state in fp32, compute in bf16
  full_ft  all weights trainable in bf16, AdamW state in bf16 (the SMALLEST full-FT setup;
           mixed precision with fp32 master weights would need twice as much)
Peak = the process's resident-set high-water mark during the step (VmHWM, reset after the
model is loaded) minus its resident set after a warm-up step of a tiny model of the same
architecture (imports, lazily loaded modules, kernel caches): the runtime, the same for
both, is not counted. Raw numbers are reported too. Weights are memory-mapped by
safetensors and count when first touched, i.e. within the step. Gradient checkpointing is
on for both by default (as in verl and TRL); --no-gradient-checkpointing turns it off for both.

Allocator: glibc raises its mmap threshold after large frees (up to 32 MiB), after which
freed per-layer temporaries stay in the heap and RSS measures allocator retention rather than
live tensors. The headline numbers pin the threshold at glibc's default 128 KiB
(MALLOC_MMAP_THRESHOLD_) for BOTH systems; `glibc_dynamic_threshold` repeats both runs with
glibc's default behaviour, side by side, so the effect is visible.

    python benchmarks/memory.py --json bench-out/memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmark_output import emit_json


def rss_bytes(field: str) -> int:
    """VmRSS or VmHWM of this process, from /proc/self/status (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def warm_up_runtime(seq_len: int) -> None:
    """One training step of a tiny Qwen2: loads lazily imported modules and kernels."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tiny = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    ).to(torch.bfloat16)
    tiny.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(tiny.parameters())
    logits = tiny(input_ids=torch.randint(0, 128, (1, seq_len)), use_cache=False).logits
    torch.log_softmax(logits.float(), -1).mean().backward()
    optimizer.step()


def worker(system: str, model_dir: Path, batch: int, seq_len: int, rank: int, checkpointing: bool) -> dict:
    import torch

    torch.manual_seed(0)
    from orbit_runtime.config import AdapterSpec
    from orbit_runtime.learner.model import load_policy

    warm_up_runtime(seq_len)
    baseline = rss_bytes("VmRSS")
    if system == "orbit":
        policy = load_policy(model_dir, AdapterSpec(rank=rank, alpha=2 * rank), dtype="bf16")
        policy.set_gradient_checkpointing(checkpointing)
        model = policy.model
        model.train()  # as the update does (Policy.training()): transformers checkpoints only in train mode
        params = policy.trainable_parameters()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len))
    loaded = rss_bytes("VmRSS")
    reset_peak_rss()
    started = time.monotonic()
    logits = model(input_ids=ids, use_cache=False).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])
    loss = -logprobs.mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # keep grads allocated: they are part of the step
    step_s = time.monotonic() - started
    peak = rss_bytes("VmHWM")
    return {
        "peak_bytes": peak - baseline,
        "peak_rss_bytes": peak,
        "rss_after_warmup_bytes": baseline,
        "rss_after_load_bytes": loaded,
        "trainable_params": sum(p.numel() for p in params),
        "step_seconds": round(step_s, 2),
        "loss": float(loss),
    }


def run_worker(command: list[str], env: dict[str, str]) -> dict:
    """Run one measurement in a fresh process; its last stdout line is the JSON result."""
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {command[3:5]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """--hidden, --intermediate, --layers, --vocab: the model build_model writes (398M parameters by default)."""
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32000)


def build_model(out: Path, args: argparse.Namespace) -> int:
    """Write a random Qwen2-shape bf16 checkpoint; returns its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    return count


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    add_shape_arguments(parser)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--worker", choices=["orbit", "full_ft"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(args.worker, args.model_dir, args.batch, args.seq_len, args.rank, args.gradient_checkpointing)))
        return {}

    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int

    with tempfile.TemporaryDirectory(prefix="orbit-memory-") as tmp:
        dense_dir, int4_dir = Path(tmp) / "dense", Path(tmp) / "int4"
        params = build_model(dense_dir, args)
        quantize_checkpoint(dense_dir, int4_dir, W4A16Int(group_size=128))
        common = ["--batch", str(args.batch), "--seq-len", str(args.seq_len), "--rank", str(args.rank)]
        common.append("--gradient-checkpointing" if args.gradient_checkpointing else "--no-gradient-checkpointing")
        pinned = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        dynamic = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        runs, dynamic_runs = {}, {}
        for system, model_dir in (("orbit", int4_dir), ("full_ft", dense_dir)):
            command = [sys.executable, __file__, "--worker", system, "--model-dir", str(model_dir), *common]
            runs[system] = run_worker(command, pinned)
            dynamic_runs[system] = run_worker(command, dynamic)
    result = {
        "model_params": params,
        "shape": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "vocab")},
        "batch": args.batch,
        "seq_len": args.seq_len,
        "lora_rank": args.rank,
        "gradient_checkpointing": args.gradient_checkpointing,
        "orbit_peak_bytes": runs["orbit"]["peak_bytes"],
        "full_ft_peak_bytes": runs["full_ft"]["peak_bytes"],
        "ratio": round(runs["full_ft"]["peak_bytes"] / runs["orbit"]["peak_bytes"], 2),
        "orbit": runs["orbit"],
        "full_ft": runs["full_ft"],
        "glibc_dynamic_threshold": {
            "orbit_peak_bytes": dynamic_runs["orbit"]["peak_bytes"],
            "full_ft_peak_bytes": dynamic_runs["full_ft"]["peak_bytes"],
            "ratio": round(dynamic_runs["full_ft"]["peak_bytes"] / dynamic_runs["orbit"]["peak_bytes"], 2),
        },
    }
    emit_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
