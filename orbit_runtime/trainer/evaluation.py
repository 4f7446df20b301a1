"""Held-out evaluation: greedy completions of the validation prompts through the rollout
engine (the served adapter), scored by `eval.reward`."""

from __future__ import annotations

from orbit_runtime.config.spec import JobSpec, RewardSpec
from orbit_runtime.data.datasets import Example
from orbit_runtime.rewards.scoring import RewardScorer
from orbit_runtime.trainer.batch import BatchBuilder
from orbit_runtime.trainer.roles import RolloutRole

SAMPLES_PER_EVAL = 3  # completions kept in the eval row (shown in the report)


def eval_reward_spec(spec: JobSpec) -> RewardSpec:
    """eval.reward, or exact_match with the kwargs of the job's exact_match reward (if any)."""
    if spec.eval.reward is not None:
        return spec.eval.reward
    kwargs = next((r.kwargs for r in spec.rewards if r.function == "exact_match"), {})
    return RewardSpec(function="exact_match", kwargs=kwargs)


class Evaluator:
    def __init__(self, spec: JobSpec, tokenizer, builder: BatchBuilder, rollout: RolloutRole, examples: list[Example]) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.builder = builder
        self.rollout = rollout
        self.examples = examples
        self.metric = eval_reward_spec(spec)
        self.accuracy_scorer = RewardScorer([self.metric])

    def evaluate(self, step: int) -> dict:
        """One eval row: held-out accuracy (mean of eval.reward), the training rewards' mean, a few samples."""
        examples = self.examples
        prompts = [self.builder.encode_prompt(e) for e in examples]
        max_tokens = self.spec.eval.max_tokens or self.spec.rollout.max_tokens
        groups = self.rollout.call(
            lambda c: c.generate(prompts, model=self.rollout.served_name, n=1, max_tokens=max_tokens, temperature=0.0), kind="eval"
        )
        texts = [self.tokenizer.decode(g[0].token_ids, skip_special_tokens=True) for g in groups]
        prompt_texts, answers = [e.prompt for e in examples], [e.answer for e in examples]
        scores = self.accuracy_scorer.score(texts, prompt_texts, answers).per_function[self.metric.function]
        rewards = self.builder.scorer.score(texts, prompt_texts, answers)
        return {
            "kind": "eval",
            "step": step,
            "accuracy": sum(scores) / len(scores),
            "accuracy_metric": self.metric.function,
            "reward_mean": sum(rewards.total) / len(rewards.total),
            "examples": len(examples),
            "samples": [
                {"prompt": p, "completion": t, "answer": a, "score": s}
                for p, t, a, s in list(zip(prompt_texts, texts, answers, scores, strict=True))[:SAMPLES_PER_EVAL]
            ],
        }
