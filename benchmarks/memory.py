"""Peak memory of one RL learner step: Orbit (INT4 base + LoRA) vs a 16-bit base + the same LoRA
(the fair baseline for "INT4 or not") vs full-parameter bf16 fine-tuning.

All three run on the same randomly initialised Qwen2-shape model (>= 300M parameters), each in
a fresh process, on the same RL-sized batch: PROMPTS x GROUP sequences of SEQ_LEN tokens
(default 8 x 8 x 1,024), micro-batched under Orbit's default token budget
(learner.micro_batch_tokens, 16,384: 16 sequences each), gradients accumulated, then one AdamW
step. Every system computes its log-probs the same way (the learner's chunked LM head and
log-softmax, orbit_runtime/learner/token_logprobs.py), with gradient checkpointing on for all
(as in verl and TRL; --no-gradient-checkpointing turns it off for all):
  orbit     packed INT4 base (the quantized checkpoint) + LoRA on Orbit's default targets,
            LoRA weights and AdamW state in fp32, compute in bf16
  lora_bf16 the bf16 base + the same LoRA (Orbit's learner code on the original checkpoint; what
            TRL or verl run for LoRA RL), LoRA weights and AdamW state in fp32
  full_ft   all weights trainable in bf16, AdamW state in bf16 (the SMALLEST full-FT setup;
            mixed precision with fp32 master weights would need twice as much)
Peak = the process's resident-set high-water mark during the step (VmHWM, reset after the model
is loaded) minus its resident set after a warm-up step of a tiny model of the same architecture
(imports, kernel caches): the runtime, the same for all, is not counted; raw numbers are kept.
Weights are memory-mapped by safetensors and count when first touched, i.e. within the step.
The peak after each micro-batch is recorded. The second micro-batch is the first to hold every
gradient and a full set of checkpointed activations at once, and the micro-batches are alike, so
--measured-micro-batches N (N >= 2; default: all) may stop after N on a slow machine: the JSON says
how many ran and whether the peak grew after the second.

Allocator: glibc raises its mmap threshold after large frees (up to 32 MiB), after which freed
per-layer temporaries stay in the heap and RSS measures allocator retention, not live tensors.
Orbit's learner pins the threshold at 128 KiB (learner.pin_malloc_threshold, on by default:
orbit_runtime/learner/allocator.py), and so the headline runs every system with it pinned by that
same call (the baselines get the same setting, their best); `orbit_glibc_dynamic_threshold` repeats
Orbit's run with glibc's default behaviour: what the setting saves and what it costs in time.

The measured step is a steady-state one (after a priming step on a tiny slice, so AdamW's state
exists), run as the learner runs it: zero_grad, micro-batches, clip_grad_norm_, AdamW. orbit and
lora_bf16 use the same learner code and LoRA forward (learner.lora_rounding as shipped), on the
INT4 or the original bf16 checkpoint.

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
    """One training step of a tiny Qwen2: loads lazily imported modules and kernels (and, for every
    system alike, the modules any of them imports: PEFT, Orbit's learner), before the baseline RSS."""
    import peft  # noqa: F401
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import orbit_runtime.learner.model  # noqa: F401
    import orbit_runtime.learner.token_logprobs  # noqa: F401

    tiny = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    ).to(torch.bfloat16)
    tiny.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(tiny.parameters())
    logits = tiny(input_ids=torch.randint(0, 128, (1, seq_len)), use_cache=False).logits
    torch.log_softmax(logits.float(), -1).mean().backward()
    optimizer.step()


def step_logprobs(model, ids):
    """Log-probs of every next token, as Orbit's learner computes them (chunked LM head + log-softmax)."""
    import torch

    from orbit_runtime.learner.token_logprobs import chunked_token_logprobs

    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT or plain
    hidden = causal_lm.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    flat = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    return chunked_token_logprobs(flat, ids[:, 1:].reshape(-1), causal_lm.get_output_embeddings()).to(torch.float32)


def load_system(system: str, model_dir: Path, rank: int, checkpointing: bool, lora_rounding: str):
    """(model, trainable parameters) of SYSTEM, loaded from MODEL_DIR. orbit and lora_bf16 are the same
    learner code (the same LoRA config and forward), on the INT4 checkpoint or the original bf16 one."""
    import torch

    from orbit_runtime.config import AdapterSpec
    from orbit_runtime.learner.model import load_dense_policy, load_policy

    adapter = AdapterSpec(rank=rank, alpha=2 * rank)
    if system in ("orbit", "lora_bf16"):
        if system == "orbit":
            policy = load_policy(model_dir, adapter, dtype="bf16", lora_rounding=lora_rounding)
        else:
            policy = load_dense_policy(model_dir, adapter, dtype="bf16", lora_rounding=lora_rounding)
        policy.set_gradient_checkpointing(checkpointing)
        model, params = policy.model, policy.trainable_parameters()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        params = [p for p in model.parameters() if p.requires_grad]
    model.train()  # transformers checkpoints only in train mode
    return model, params


def worker(system: str, model_dir: Path, sequences: int, seq_len: int, micro_batch_tokens: int, measured: int | None,
           rank: int, checkpointing: bool, pin: bool) -> dict:  # fmt: skip
    """One RL learner step of SYSTEM, measured as the learner runs it (learner/update.py): zero_grad,
    the micro-batches with gradients accumulated, clip_grad_norm_, AdamW; after a priming step on a
    tiny slice, so the optimizer state exists (as in every step but a run's first)."""
    import torch

    from orbit_runtime.config.learner import LearnerSpec
    from orbit_runtime.learner.allocator import pin_mmap_threshold

    if pin:
        assert pin_mmap_threshold(), "mallopt(M_MMAP_THRESHOLD) failed"  # the runtime's own call, first thing
    torch.manual_seed(0)
    lora_rounding = LearnerSpec().lora_rounding  # what Orbit ships
    warm_up_runtime(seq_len)
    baseline = rss_bytes("VmRSS")
    model, params = load_system(system, model_dir, rank, checkpointing, lora_rounding)
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (sequences, seq_len), generator=torch.Generator().manual_seed(0))

    def step(batches: list) -> list[int]:
        optimizer.zero_grad(set_to_none=True)
        peaks = []
        for chunk in batches:
            (-step_logprobs(model, chunk).sum() / ids[:, 1:].numel()).backward()  # a global normaliser, as Orbit's
            peaks.append(rss_bytes("VmHWM") - baseline)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return peaks

    primed = time.monotonic()
    step([ids[:1, :32]])  # AdamW's state, created lazily by its first step
    priming_s = time.monotonic() - primed
    per_micro_batch = max(1, micro_batch_tokens // seq_len)
    micro_batches = list(torch.split(ids, per_micro_batch))
    ran = micro_batches[: measured or len(micro_batches)]
    loaded = rss_bytes("VmRSS")
    reset_peak_rss()
    started = time.monotonic()
    peaks = step(ran)
    measured_s = time.monotonic() - started
    peak = rss_bytes("VmHWM")
    return {
        "peak_bytes": peak - baseline,
        "peak_after_each_micro_batch_bytes": peaks,  # VmHWM only rises: flat after the second = no later micro-batch went higher
        "peak_growth_after_second_micro_batch_bytes": peaks[-1] - peaks[1] if len(peaks) > 1 else None,
        "peak_rss_bytes": peak,
        "rss_after_warmup_bytes": baseline,
        "rss_after_load_and_priming_bytes": loaded,
        "trainable_params": sum(p.numel() for p in params),
        "lora_rounding": lora_rounding if system != "full_ft" else None,
        "micro_batches": len(micro_batches),
        "micro_batches_ran": len(ran),
        "sequences_per_micro_batch": per_micro_batch,
        "measured_seconds": round(measured_s, 2),  # the micro-batches that ran + clip + AdamW
        "seconds_per_micro_batch": round(measured_s / len(ran), 2),
        "priming_seconds": round(priming_s, 2),
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


SYSTEMS = ("orbit", "lora_bf16", "full_ft")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    add_shape_arguments(parser)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--measured-micro-batches", type=int,
                        help="stop after this many micro-batches, at least 2 (default: all)")  # fmt: skip
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sequences = args.prompts * args.group
    if args.measured_micro_batches is not None and args.measured_micro_batches < 2:
        parser.error("--measured-micro-batches must be at least 2: the second is the first to hold every gradient")

    if args.worker:
        print(json.dumps(worker(args.worker, args.model_dir, sequences, args.seq_len, args.micro_batch_tokens,
                                args.measured_micro_batches, args.rank, args.gradient_checkpointing, args.pin)))  # fmt: skip
        return {}

    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int
    from orbit_runtime.learner.allocator import DEFAULT_THRESHOLD

    with tempfile.TemporaryDirectory(prefix="orbit-memory-") as tmp:
        dense_dir, int4_dir = Path(tmp) / "dense", Path(tmp) / "int4"
        params = build_model(dense_dir, args)
        quantize_checkpoint(dense_dir, int4_dir, W4A16Int(group_size=128))
        common = ["--prompts", str(args.prompts), "--group", str(args.group), "--seq-len", str(args.seq_len),
                  "--micro-batch-tokens", str(args.micro_batch_tokens), "--rank", str(args.rank)]  # fmt: skip
        if args.measured_micro_batches:
            common += ["--measured-micro-batches", str(args.measured_micro_batches)]
        common.append("--gradient-checkpointing" if args.gradient_checkpointing else "--no-gradient-checkpointing")
        # glibc left alone, and pinned by the runtime's own call (learner.pin_malloc_threshold), nothing else different
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
        runs, dynamic_runs = {}, {}
        for system in SYSTEMS:
            model_dir = int4_dir if system == "orbit" else dense_dir
            command = [sys.executable, __file__, "--worker", system, "--model-dir", str(model_dir), *common]
            runs[system] = run_worker([*command, "--pin"], env)  # the baselines get the pinned threshold too: their best
            if system == "orbit":  # what the setting does for Orbit, and what it costs
                dynamic_runs[system] = run_worker(command, env)
    peak = {system: runs[system]["peak_bytes"] for system in SYSTEMS}
    result = {
        "model_params": params,
        "shape": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "vocab")},
        "prompts": args.prompts,
        "group": args.group,
        "seq_len": args.seq_len,
        "tokens_per_step": sequences * args.seq_len,
        "micro_batch_tokens": args.micro_batch_tokens,
        "measured_micro_batches": args.measured_micro_batches,
        "lora_rank": args.rank,
        "gradient_checkpointing": args.gradient_checkpointing,
        "malloc_mmap_threshold_bytes": DEFAULT_THRESHOLD,
        "peak_bytes": peak,
        "ratio_lora_bf16_over_orbit": round(peak["lora_bf16"] / peak["orbit"], 2),
        "ratio_full_ft_over_orbit": round(peak["full_ft"] / peak["orbit"], 2),
        "runs": runs,
        "orbit_glibc_dynamic_threshold": {
            **dynamic_runs["orbit"],
            "peak_ratio_dynamic_over_pinned": round(dynamic_runs["orbit"]["peak_bytes"] / peak["orbit"], 2),
            # > 1: pinned is slower (n=1 each, on a 2-core machine: a rough figure)
            "seconds_ratio_pinned_over_dynamic": round(runs["orbit"]["measured_seconds"] / dynamic_runs["orbit"]["measured_seconds"], 2),
        },
    }
    emit_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
