"""The part both GPU self-checks share: `orbit train`'s update, timed, at RL lengths."""

from __future__ import annotations

import time


def timed_updates(policy, args, cuda: bool, result: dict, checks: dict):
    """ARGS.steps `policy_update`s (AdamW, micro-batches of ARGS.micro_batch_tokens) on a random
    ARGS.prompts x ARGS.group x ARGS.completion_tokens batch; returns the batch.

    Into RESULT: step times, tokens and micro-batches per step and, on CUDA, peak memory against
    the dense bf16 weights (RESULT["model_params"]). Into CHECKS: every loss finite and, on CUDA,
    the peak below the dense bf16 weights (the whole base was never expanded).
    """
    import torch
    from learner_scale import make_batch

    from orbit_runtime.algorithms.grpo import LossConfig
    from orbit_runtime.learner.micro_batches import MicroBatchLimits
    from orbit_runtime.learner.update import policy_update

    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-4)
    batch = make_batch(args.prompts, args.group, args.completion_tokens, args.vocab, seed=0)
    limits = MicroBatchLimits(max_tokens=args.micro_batch_tokens)
    loss_config = LossConfig(max_tokens=args.completion_tokens)
    step_times, micro_batches = [], 0
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        started = time.monotonic()
        update = policy_update(policy, optimizer, batch, loss_config, temperature=1.0, max_grad_norm=1.0, limits=limits)
        if cuda:
            torch.cuda.synchronize()
        step_times.append(time.monotonic() - started)
        micro_batches = update.micro_batches
        checks["update_finite"] = checks.get("update_finite", True) and torch.isfinite(torch.tensor(update.loss)).item()
    result["step_seconds"] = [round(t, 3) for t in step_times]
    result["tokens_per_step"] = sum(len(c) for _, c in batch.pairs)
    result["micro_batches_per_step"] = micro_batches
    result["micro_batch_tokens"] = args.micro_batch_tokens
    if cuda:
        result["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved()
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
        dense_bf16 = result["model_params"] * 2
        result["peak_vs_dense_bf16_weights"] = round(result["peak_gpu_bytes"] / dense_bf16, 3)
        checks["peak_below_dense_weights"] = result["peak_gpu_bytes"] < dense_bf16
    del optimizer
    return batch
