"""Held-out evaluation: completions of the validation prompts through the rollout engine (the
served adapter), scored by `eval.reward`.

One greedy completion per prompt by default; with `eval.samples` k > 1, k completions at
`eval.temperature` (default rollout.temperature), seeded the same way at every evaluation so
two evaluations differ by the policy, not by the draw. Accuracy is the mean over prompts of
each prompt's mean score (mean@k), reported with its standard error over prompts (the
prompts are the sample; with k > 1 each prompt's mean is one observation); pass@k is the
mean over prompts of the best of the k scores.
"""

from __future__ import annotations

import math

from orbit_runtime.config.spec import JobSpec, RewardSpec
from orbit_runtime.data.datasets import Example
from orbit_runtime.rewards.scoring import RewardScorer
from orbit_runtime.trainer.batch import BatchBuilder, sampling_seeds
from orbit_runtime.trainer.roles import RolloutRole

SAMPLES_PER_EVAL = 3  # completions kept in the eval row (shown in the report)
EVAL_SEED_STEP = -1  # the seeds' "step" for evaluation: the same draw at every evaluation


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """The mean of VALUES and its standard error (sample std / sqrt(n); 0 for a single value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def eval_reward_spec(spec: JobSpec) -> RewardSpec:
    """eval.reward, or exact_match with the kwargs of the job's exact_match reward (if any)."""
    if spec.eval.reward is not None:
        return spec.eval.reward
    if spec.environment is not None and spec.environment.type in ("verifiers", "bfcl"):
        return RewardSpec(function="environment")  # its rubric, BFCL's answer check
    kwargs = next((r.kwargs for r in spec.rewards if r.function == "exact_match"), {})
    return RewardSpec(function="exact_match", kwargs=kwargs)


def heldout_summary(evals: list[dict], samples_per_prompt: int) -> dict:
    """summary.json's held-out fields: accuracy before and after RL with standard errors, pass@k after."""
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    after = len(evals) > 1
    return {
        "heldout_accuracy_before": first.get("accuracy"),
        "heldout_accuracy_before_stderr": first.get("accuracy_stderr"),
        "heldout_accuracy_after": last.get("accuracy") if after else None,
        "heldout_accuracy_after_stderr": last.get("accuracy_stderr") if after else None,
        "heldout_pass_at_k_after": last.get("pass_at_k") if after else None,
        "heldout_prompts": last.get("examples"),
        "heldout_samples_per_prompt": samples_per_prompt,
    }


def describe_eval(row: dict) -> str:
    """'83.3% ± 4.1% (64 prompts, greedy)': an eval row's accuracy with its standard error."""
    k = row.get("samples_per_prompt", 1)
    how = "greedy" if k == 1 and not row.get("temperature") else f"mean@{k} at T={row.get('temperature', 0):g}"
    extra = f", pass@{k} {row['pass_at_k']:.1%}" if k > 1 and row.get("pass_at_k") is not None else ""
    return f"{row['accuracy']:.1%} ± {row.get('accuracy_stderr', 0.0):.1%} ({row['examples']} prompts, {how}{extra})"


class Evaluator:
    def __init__(self, spec: JobSpec, tokenizer, builder: BatchBuilder, rollout: RolloutRole, examples: list[Example]) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.builder = builder
        self.rollout = rollout
        self.examples = examples
        self.metric = eval_reward_spec(spec)
        self.accuracy_scorer = RewardScorer([self.metric])

    @property
    def temperature(self) -> float:
        configured = self.spec.eval.temperature
        if configured is not None:
            return configured
        return 0.0 if self.spec.eval.samples == 1 else self.spec.rollout.temperature

    def evaluate(self, step: int) -> dict:
        """One eval row: held-out accuracy (mean@k of eval.reward) with its standard error, pass@k, the
        training rewards' mean, a few samples."""
        examples, k, temperature = self.examples, self.spec.eval.samples, self.temperature
        max_tokens = self.spec.eval.max_tokens or self.spec.rollout.max_tokens
        seeds = sampling_seeds(self.spec.schedule.seed, EVAL_SEED_STEP, len(examples)) if temperature > 0 else None
        prompt_texts = [e.prompt for e in examples for _ in range(k)]
        answers = [e.answer for e in examples for _ in range(k)]
        transcripts = None
        if self.builder.episodes is not None:  # multi-turn: whole episodes, each turn up to MAX_TOKENS
            episodes = self.builder.run_episodes(examples, k, temperature, seeds, max_tokens=max_tokens, kind="eval")
            per_sample = [e for e in examples for _ in range(k)]
            texts = [e.answer for e in episodes]
            transcripts = [e.messages for e in episodes]
            scores = self.builder.score_episodes(episodes, per_sample, self.accuracy_scorer).per_function[self.metric.function]
            rewards = self.builder.score_episodes(episodes, per_sample, self.builder.scorer)
        else:
            prompts = [self.builder.encode_prompt(e) for e in examples]
            groups = self.rollout.call(
                lambda c: c.generate(prompts, model=self.rollout.served_name, n=k, max_tokens=max_tokens,
                                     temperature=temperature, seed=seeds), kind="eval",
            )  # fmt: skip
            texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for g in groups for c in g]
            scores = self.accuracy_scorer.score(texts, prompt_texts, answers).per_function[self.metric.function]
            rewards = self.builder.scorer.score(texts, prompt_texts, answers)
        per_prompt = [scores[i * k : (i + 1) * k] for i in range(len(examples))]
        accuracy, stderr = mean_and_stderr([sum(s) / k for s in per_prompt])
        shown = range(0, min(SAMPLES_PER_EVAL * k, len(texts)), k)
        return {
            "kind": "eval",
            "step": step,
            "accuracy": accuracy,
            "accuracy_stderr": stderr,
            "pass_at_k": sum(max(s) for s in per_prompt) / len(per_prompt),
            "samples_per_prompt": k,
            "temperature": temperature,
            "accuracy_metric": self.metric.function,
            "reward_mean": sum(rewards.total) / len(rewards.total),
            "examples": len(examples),
            "samples": [
                {"prompt": prompt_texts[i], "completion": texts[i], "answer": answers[i], "score": scores[i],
                 **({"messages": transcripts[i]} if transcripts is not None else {})}
                for i in shown
            ],  # fmt: skip
        }
