"""One learner update at RL lengths: micro-batches under a token budget vs one big batch.

The workload of the issue: 8 prompts x 8 completions x 1,024 completion tokens (prompts of
32-96 tokens) on a random Qwen2-shape model of >= 100M parameters, quantized to INT4 by
`orbit quantize`'s code, LoRA rank 16 on all linears, bf16 compute. Each configuration runs
in a fresh process and performs exactly what `orbit train` does for one RL step's update:
`learner.update.policy_update` (forward, GRPO loss, backward, AdamW), after a warm-up
update on two short sequences (kernels, lazily loaded modules).

Configurations (all with gradient checkpointing on: the big batch's best setting, since
without it its activations are larger still):
  micro_batches_<N>  learner.micro_batch_tokens = N, for each N of --micro-batch-tokens
                     (default 16384, the spec's default, and 4096)
  one_batch          all 64 sequences in one forward/backward (no token budget)
A second, shorter workload (--short-tokens, default 256) where the big batch fits too gives
the time cost of micro-batching side by side.

Peak memory is the process's resident-set high-water mark during the update (VmHWM, reset
after the warm-up), absolute and above the RSS before the update. Each worker runs under an
address-space limit (--memory-limit-gb, RLIMIT_AS: virtual memory, which bounds resident
memory from above) so a configuration that does not fit fails with an allocation error,
reported as `"fits": false` with the error, instead of taking the machine down. For scale,
`logits_gib_estimate` is what the LM-head output alone needs per forward: padded tokens x
vocab x 10 bytes (bf16 logits, their fp32 copy and the fp32 log-softmax kept for backward).

    python benchmarks/learner_scale.py --json benchmarks/results/learner_scale.json

`--logprobs both` measures, side by side, the learner's log-probs as it takes them (completion
tokens only, LM head and log-softmax 1,024 positions at a time: learner/token_logprobs.py)
and the way it took them before (one fp32 log-softmax over the whole vocabulary at every
position, prompt included), `--repeats` times each:

    python benchmarks/learner_scale.py --completion-tokens 256 --short-tokens 0 --micro-batch-tokens 16384 \
        --skip-one-batch --logprobs both --repeats 2 --json benchmarks/results/learner_logprobs.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmark_output import emit_json

MALLOC_PINNED = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}  # RSS tracks live tensors (see memory.py)


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def make_batch(prompts: int, group: int, completion_tokens: int, vocab: int, seed: int):
    """PROMPTS x GROUP (prompt, completion) pairs of random tokens, rollout log-probs and advantages."""
    import torch

    from orbit_runtime.learner.update import UpdateBatch

    rng = random.Random(seed)
    pairs = []
    for _ in range(prompts):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(32, 97))]
        for _ in range(group):
            pairs.append((prompt, [rng.randrange(vocab) for _ in range(completion_tokens)]))
    generator = torch.Generator().manual_seed(seed)
    rollout = [torch.full((completion_tokens,), -10.4) + 0.1 * torch.randn(completion_tokens, generator=generator) for _ in pairs]
    advantages = torch.randn(len(pairs), generator=generator)
    return UpdateBatch(pairs, rollout, advantages)


def full_vocabulary_logprobs_at(policy, input_ids, attention_mask, rows, positions, temperature=1.0):
    """The baseline: the learner's log-probs before chunking (Policy.token_logprobs until this benchmark's commit)."""
    import torch

    logits = policy.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return logprobs[rows, positions]


def worker(args: argparse.Namespace) -> dict:
    """One configuration, in this (fresh) process."""
    limit = int(args.memory_limit_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import torch

    from orbit_runtime.algorithms.grpo import LossConfig
    from orbit_runtime.config import AdapterSpec
    from orbit_runtime.learner.micro_batches import MicroBatchLimits
    from orbit_runtime.learner.update import policy_update

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    from orbit_runtime.learner.model import load_policy

    policy = load_policy(args.model_dir, AdapterSpec(rank=16, alpha=32), dtype="bf16")
    policy.set_gradient_checkpointing(args.gradient_checkpointing)
    if args.logprobs == "full":
        policy.logprobs_at = lambda *a, **k: full_vocabulary_logprobs_at(policy, *a, **k)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-5)
    vocab = policy.model.config.vocab_size
    config = LossConfig(max_tokens=args.completion_tokens)
    limits = MicroBatchLimits(max_tokens=None if args.one_batch else args.micro_batch_tokens[0])
    warm = make_batch(1, 2, 16, vocab, seed=1)
    policy_update(policy, optimizer, warm, config, temperature=1.0, max_grad_norm=1.0, limits=limits)
    batch = make_batch(args.prompts, args.group, args.completion_tokens, vocab, seed=0)
    before = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    started = time.monotonic()
    try:
        result = policy_update(policy, optimizer, batch, config, temperature=1.0, max_grad_norm=1.0, limits=limits)
    except (RuntimeError, MemoryError) as exc:  # torch's "can't allocate memory" is a RuntimeError
        if "alloc" not in str(exc).lower() and not isinstance(exc, MemoryError):
            raise
        return {"fits": False, "error": str(exc).splitlines()[0][:300], "seconds_until_failure": round(time.monotonic() - started, 1),
                "peak_rss_bytes": status_bytes("VmHWM"), "rss_before_bytes": before}  # fmt: skip
    seconds = time.monotonic() - started
    peak = status_bytes("VmHWM")
    return {
        "fits": True,
        "step_seconds": round(seconds, 2),
        "peak_rss_bytes": peak,
        "rss_before_bytes": before,
        "peak_above_before_bytes": peak - before,
        "micro_batches": result.micro_batches,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "tokens": sum(len(c) for _, c in batch.pairs),
        "padded_tokens_per_forward_max": max(
            len(g) * max(len(batch.pairs[i][0]) + len(batch.pairs[i][1]) for i in g)
            for g in limits.plan([len(p) + len(c) for p, c in batch.pairs])
        ),
    }


def spread(results: list[dict]) -> dict:
    """Median, min and max of the peak and the step time over repeated runs that fit."""
    import statistics

    fitted = [r for r in results if r.get("fits")]
    if not fitted:
        return {"fits": False}
    out: dict = {"fits": True}
    for key in ("peak_above_before_bytes", "step_seconds"):
        values = [r[key] for r in fitted]
        out |= {f"{key}_median": statistics.median(values), f"{key}_min": min(values), f"{key}_max": max(values)}
    return out


def build_int4_model(tmp: Path, hidden: int, intermediate: int, layers: int, vocab: int) -> tuple[Path, int]:
    """A random Qwen2-shape bf16 model (tied embeddings) quantized to INT4 at TMP/int4; returns it and its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), max_position_embeddings=4096,
                         tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp / "dense")
    del model
    quantize_checkpoint(tmp / "dense", tmp / "int4", W4A16Int(group_size=128))
    return tmp / "int4", params


def run_config(args: argparse.Namespace, model_dir: Path, completion_tokens: int, micro_batch_tokens: int | None,
               logprobs: str = "chunked") -> dict:  # fmt: skip
    command = [sys.executable, __file__, "--worker", "--model-dir", str(model_dir),
               "--completion-tokens", str(completion_tokens), "--prompts", str(args.prompts), "--group", str(args.group),
               "--memory-limit-gb", str(args.memory_limit_gb), "--logprobs", logprobs,
               "--gradient-checkpointing" if args.gradient_checkpointing else "--no-gradient-checkpointing"]  # fmt: skip
    command += ["--micro-batch-tokens", str(micro_batch_tokens)] if micro_batch_tokens is not None else ["--one-batch"]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **MALLOC_PINNED})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"fits": False, "error": f"worker exited {proc.returncode}: {proc.stderr.strip()[-500:]}"}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--short-tokens", type=int, default=256, help="the second workload's completion length (0: skip it)")
    parser.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[16384, 4096])
    parser.add_argument("--memory-limit-gb", type=float, default=16.0)
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--logprobs",
        choices=["chunked", "full", "both"],
        default="chunked",
        help="the learner's chunked completion-only log-probs, the full-vocabulary baseline, or both",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration (each in a fresh process)")
    parser.add_argument("--skip-one-batch", action="store_true", help="do not run the one-big-batch configuration")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one-batch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    workloads = {}
    with tempfile.TemporaryDirectory(prefix="orbit-learner-scale-") as tmp:
        model_dir, params = build_int4_model(Path(tmp), args.hidden, args.intermediate, args.layers, args.vocab)
        for tokens in [args.completion_tokens] + ([args.short_tokens] if args.short_tokens else []):
            budgets = args.micro_batch_tokens if tokens == args.completion_tokens else args.micro_batch_tokens[:1]
            kinds = ["chunked", "full"] if args.logprobs == "both" else [args.logprobs]
            runs: dict = {}
            for n in budgets:
                for kind in kinds:
                    name = f"micro_batches_{n}" + ("" if kind == "chunked" else "_full_vocab_logprobs")
                    results = [run_config(args, model_dir, tokens, n, kind) for _ in range(args.repeats)]
                    runs[name] = results[0] if args.repeats == 1 else {"runs": results, **spread(results)}
            if args.logprobs == "both":
                for n in budgets:
                    ours, base = runs[f"micro_batches_{n}"], runs[f"micro_batches_{n}_full_vocab_logprobs"]
                    if "peak_above_before_bytes_median" in ours and "peak_above_before_bytes_median" in base:
                        runs[f"micro_batches_{n}_full_over_chunked_peak_ratio"] = round(
                            base["peak_above_before_bytes_median"] / ours["peak_above_before_bytes_median"], 2
                        )
                        runs[f"micro_batches_{n}_full_over_chunked_time_ratio"] = round(
                            base["step_seconds_median"] / ours["step_seconds_median"], 2
                        )
            workloads[f"{args.prompts}x{args.group}x{tokens}"] = runs
            if args.skip_one_batch:
                continue
            runs["one_batch"] = one = run_config(args, model_dir, tokens, None)
            one["logits_gib_estimate"] = round(args.prompts * args.group * (96 + tokens) * args.vocab * 10 / 2**30, 1)
            micro = runs[f"micro_batches_{budgets[0]}"]
            if micro.get("fits") and one["fits"]:
                runs["one_batch_over_micro_peak_ratio"] = round(
                    one["peak_above_before_bytes"] / micro["peak_above_before_bytes"], 2
                )
                runs["micro_over_one_batch_time_ratio"] = round(micro["step_seconds"] / one["step_seconds"], 2)
    emit_json({
        "model_params": params,
        "shape": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "vocab")},
        "lora_rank": 16, "dtype": "bf16", "gradient_checkpointing": args.gradient_checkpointing,
        "micro_batch_tokens": args.micro_batch_tokens, "memory_limit_gb": args.memory_limit_gb,
        "logprobs": args.logprobs, "repeats": args.repeats,
        "workloads": workloads,
    }, args.json)  # fmt: skip


if __name__ == "__main__":
    main()
