"""Building one rollout batch: prompts -> vLLM samples (seeded per prompt) -> rewards ->
group advantages -> reference log-probs."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch

from orbit_runtime.algorithms.grpo import group_advantages
from orbit_runtime.config.spec import JobSpec
from orbit_runtime.data.datasets import Example
from orbit_runtime.learner.update import UpdateBatch
from orbit_runtime.rewards.scoring import RewardResult, RewardScorer
from orbit_runtime.rollout.client import Completion
from orbit_runtime.trainer.episodes import Episode, EpisodeRunner
from orbit_runtime.trainer.roles import ReferenceRole, RolloutRole


def sampling_seeds(run_seed: int, step: int, count: int) -> list[int]:
    """One vLLM seed per prompt position of step STEP: reproducible (also after a resume) and
    distinct, so a prompt drawn twice in one batch gets two different groups. vLLM gives the
    j-th completion of a prompt seed + j; seeds are spread over 2**31 so those ranges do not meet."""
    return [
        int.from_bytes(hashlib.sha256(f"{run_seed}:{step}:{position}".encode()).digest()[:4], "big") >> 1
        for position in range(count)
    ]


def encode_prompt(tokenizer, example: Example, use_chat_template: bool) -> list[int]:
    """Token ids of EXAMPLE's prompt, wrapped in the tokenizer's chat template when it has one."""
    if use_chat_template and tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": example.prompt}], add_generation_prompt=True, tokenize=False
        )
    else:
        text = example.prompt
    return tokenizer.encode(text, add_special_tokens=False)


def canary_pairs(spec: JobSpec, tokenizer, examples: list[Example]) -> list[tuple[list[int], list[int]]]:
    """Fixed sequences both engines score after each sync: held-out prompts followed by
    sync.canary_completion (with the prompt's answer; 'ok' without one), then EOS."""
    pairs = []
    for example in examples[: spec.sync.canary_sequences]:
        text = spec.sync.canary_completion.format(answer=example.answer) if example.answer is not None else "ok"
        completion = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        pairs.append((encode_prompt(tokenizer, example, spec.rollout.use_chat_template), completion))
    return pairs


def truncated_rewards(totals: list[float], truncated: list[bool], mode: str, reward: float) -> list[float]:
    """rollout.truncated == 'reward' (DAPO's overlong reward): a completion cut at max_tokens gets REWARD
    instead of its score; 'keep' and 'mask' leave the rewards as scored."""
    if mode != "reward":
        return list(totals)
    return [reward if cut else total for total, cut in zip(totals, truncated, strict=True)]


@dataclass
class RolloutBatch:
    """One step's samples, scored."""

    indices: list[int]  # training-set indices of the prompts
    examples: list[Example]
    completions: list[Completion]  # prompt-major: group_size completions per prompt
    texts: list[str]
    rewards: RewardResult
    advantages: torch.Tensor
    ref_logprobs: list[torch.Tensor] | None
    mask_truncated: bool = False  # rollout.truncated == "mask": truncated samples are left out of the loss
    replay_routing: bool = False  # moe.routing_replay: the learner uses the rollout's experts
    episodes: list[Episode] | None = None  # multi-turn: each sample's whole episode (its completion is completions[i])

    @property
    def truncated(self) -> list[bool]:
        """Which completions were cut at rollout.max_tokens (vLLM's finish_reason 'length')."""
        return [c.finish_reason == "length" for c in self.completions]

    def for_update(self) -> UpdateBatch:
        return UpdateBatch(
            pairs=[(c.prompt_ids, c.token_ids) for c in self.completions],
            rollout_logprobs=[torch.tensor(c.logprobs) for c in self.completions],
            advantages=self.advantages,
            ref_logprobs=self.ref_logprobs,
            loss_mask=self.loss_mask(),
            routed_experts=[c.routed_experts for c in self.completions] if self.replay_routing else None,
            token_masks=[torch.tensor(c.token_mask, dtype=torch.bool) for c in self.completions] if self.episodes else None,
        )

    def loss_mask(self) -> list[bool] | None:
        """Which samples the loss counts: not the truncated ones under rollout.truncated mask, never an
        episode whose environment raised. None: all of them."""
        keep = [not t for t in self.truncated] if self.mask_truncated else [True] * len(self.completions)
        if self.episodes is not None:
            keep = [k and e.ending != "env_error" for k, e in zip(keep, self.episodes, strict=True)]
        return keep if not all(keep) else None

    @property
    def tokens(self) -> int:
        """Tokens the model generated (an episode's environment tokens are not counted)."""
        return sum(sum(c.token_mask) if c.token_mask is not None else len(c.token_ids) for c in self.completions)


class BatchBuilder:
    """Turns the sampler's prompt indices into a scored RolloutBatch."""

    def __init__(self, spec: JobSpec, tokenizer, scorer: RewardScorer, rollout: RolloutRole, reference: ReferenceRole,
                 episodes: EpisodeRunner | None = None) -> None:  # fmt: skip
        self.spec = spec
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.rollout = rollout
        self.reference = reference
        self.episodes = episodes  # multi-turn jobs: each sample is an episode with the environment

    def encode_prompt(self, example: Example) -> list[int]:
        return encode_prompt(self.tokenizer, example, self.spec.rollout.use_chat_template)

    def run_episodes(self, examples: list[Example], group: int, temperature: float, seeds: list[int] | None,
                     max_tokens: int | None = None, kind: str = "episodes") -> list[Episode]:  # fmt: skip
        """GROUP episodes per example (prompt-major), each turn one seeded request to the served adapter.
        The whole batch is one supervised call: if the engine dies, it is restarted and the batch rerun."""
        runner = self.episodes
        assert runner is not None

        def batch(client) -> list[Episode]:
            model = self.rollout.served_name  # read per attempt: a restarted server may serve another name

            def turn(ids: list[int], budget: int, seed: int | None) -> Completion:
                return client.generate([ids], model=model, n=1, max_tokens=min(budget, max_tokens or budget),
                                       temperature=temperature, seed=seed)[0][0]  # fmt: skip

            return runner.run(turn, examples, group, seeds)

        return self.rollout.call(batch, kind=kind)

    def score_episodes(self, episodes: list[Episode], examples: list[Example], scorer: RewardScorer) -> RewardResult:
        """SCORER's rewards of each episode's answer (its last model turn), with the environment's own reward and the
        conversation passed to the functions that take them; an episode whose environment failed scores 0."""
        result = scorer.score([e.answer for e in episodes], [x.prompt for x in examples], [x.answer for x in examples],
                              extra={"environment_rewards": [e.environment_reward for e in episodes],
                                     "transcripts": [e.messages for e in episodes]})  # fmt: skip
        failed = [e.ending == "env_error" for e in episodes]
        result.total = [0.0 if bad else t for bad, t in zip(failed, result.total, strict=True)]
        result.per_function = {name: [0.0 if bad else v for bad, v in zip(failed, values, strict=True)]
                               for name, values in result.per_function.items()}  # fmt: skip
        return result

    def generate(self, examples: list[Example], step: int) -> list[Completion]:
        """group_size samples per example, prompt-major, seeded per (run seed, step, position)."""
        rollout = self.spec.rollout
        prompts = [self.encode_prompt(e) for e in examples]
        seeds = sampling_seeds(self.spec.schedule.seed, step, len(prompts))
        groups = self.rollout.call(  # served_name read per attempt: a restarted server may serve another name
            lambda c: c.generate(prompts, model=self.rollout.served_name, n=rollout.group_size, max_tokens=rollout.max_tokens,
                                 temperature=rollout.temperature, top_p=rollout.top_p, seed=seeds),
            kind="generate",
        )  # fmt: skip
        return [c for g in groups for c in g]

    def build(self, indices: list[int], examples: list[Example], step: int, timings: dict[str, float]) -> RolloutBatch:
        spec, group = self.spec, self.spec.rollout.group_size
        per_sample = [e for e in examples for _ in range(group)]
        t = time.monotonic()
        episodes = None
        if self.episodes is not None:
            episodes = self.run_episodes(examples, group, spec.rollout.temperature,
                                         sampling_seeds(spec.schedule.seed, step, len(examples)))  # fmt: skip
            completions = [e.completion for e in episodes]
        else:
            completions = self.generate(examples, step)
        timings["generate_s"] = time.monotonic() - t
        if episodes is not None:
            timings["environment_s"] = sum(e.environment_seconds for e in episodes)  # summed over episodes in flight

        t = time.monotonic()
        if episodes is not None:
            texts = [e.answer for e in episodes]
            rewards = self.score_episodes(episodes, per_sample, self.scorer)
        else:
            texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
            rewards = self.scorer.score(texts, [e.prompt for e in per_sample], [e.answer for e in per_sample])
        truncated = [c.finish_reason == "length" for c in completions]
        rewards.total = truncated_rewards(rewards.total, truncated, spec.rollout.truncated, spec.rollout.truncated_reward)
        advantages = group_advantages(torch.tensor(rewards.total), group, spec.algorithm.normalize_advantage_std)
        timings["reward_s"] = time.monotonic() - t

        t = time.monotonic()
        ref = None
        if spec.algorithm.kl_beta > 0 or spec.reference.report_kl:
            pairs = [(c.prompt_ids, c.token_ids) for c in completions]
            ref = self.reference.logprobs(pairs, spec.rollout.temperature)
        timings["reference_s"] = time.monotonic() - t
        return RolloutBatch(indices, examples, completions, texts, rewards, advantages, ref,
                            mask_truncated=spec.rollout.truncated == "mask",
                            replay_routing=spec.moe.routing_replay, episodes=episodes)  # fmt: skip
