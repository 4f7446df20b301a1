"""Multi-turn episodes against a real vLLM server (CPU build) on the INT4 base + a LoRA adapter:
every request of an episode is the previous one's prompt + exactly the tokens vLLM returned +
the environment's, and the learner's recomputation of the whole episode matches the rollout's
log-prob of every model token within the single-turn bound (test_vllm_parity). Then `orbit
train` on a verifiers tool environment: the rubric's reward reaches the loss."""

from __future__ import annotations

import json
import random
import threading

import pytest
import torch

from orbit_runtime.config import AdapterSpec
from orbit_runtime.config.environment import EnvironmentSpec
from orbit_runtime.data.datasets import Example
from orbit_runtime.environments.base import Environment, EnvReply, EpisodeState
from orbit_runtime.learner.model import load_policy
from orbit_runtime.rollout.client import adapter_name
from orbit_runtime.trainer.episodes import EpisodeRunner
from tests.orbit_train import train_job

from .conftest import RANK

pytestmark = pytest.mark.vllm


class KeepTalking(Environment):
    """A user who answers every turn with "go on", three model turns per episode."""

    def reset(self, example: Example) -> EpisodeState:
        return EpisodeState(example, [{"role": "user", "content": example.prompt}])

    def step(self, state: EpisodeState, message) -> EnvReply:
        turns = sum(m["role"] == "assistant" for m in state.messages)
        return EnvReply([{"role": "user", "content": "go on"}], done=turns >= 3, reward=float(turns))


@pytest.fixture(scope="module")
def short_turns(int4_dir, tmp_path_factory):
    """An adapter trained (fp32) to answer any prompt with a few characters and <|im_end|>, so turns
    end by themselves and episodes have several; served and scored in fp16."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(int4_dir)
    torch.manual_seed(0)
    trainer = load_policy(int4_dir, AdapterSpec(rank=RANK, alpha=16), dtype="fp32")
    rng = random.Random(0)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": f"q{i}"}], add_generation_prompt=True,
                                                      tokenize=False), add_special_tokens=False) for i in range(6)]
    pairs = [(p, [rng.randrange(40, 90) for _ in range(rng.randrange(2, 5))] + [tokenizer.eos_token_id]) for p in prompts]
    optimizer = torch.optim.AdamW(trainer.trainable_parameters(), lr=1e-2)
    for _ in range(30):
        loss = -torch.cat(trainer.completion_logprobs(pairs)).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    policy = load_policy(int4_dir, AdapterSpec(rank=RANK, alpha=16), dtype="fp16")
    policy.load_adapter_state(trainer.adapter_state())
    return policy, tokenizer, policy.save_adapter(tmp_path_factory.mktemp("adapters") / "short")


def test_multi_turn_log_probs_match_the_learner_and_tokens_are_kept_as_generated(rollout_client, short_turns):
    policy, tokenizer, path = short_turns
    name = adapter_name(40)
    rollout_client.load_adapter(name, path)
    sent: list[tuple[list[int], list[int]]] = []  # (prompt ids, returned ids) of every request
    lock = threading.Lock()

    def generate(ids, budget, seed):
        turn = rollout_client.generate([ids], model=name, n=1, max_tokens=budget, temperature=1.0, seed=seed)[0][0]
        with lock:
            sent.append((list(ids), list(turn.token_ids)))
        return turn

    spec = EnvironmentSpec(type="python", load="m:f", max_turns=3, max_tokens=200, concurrency=8)
    runner = EpisodeRunner(KeepTalking(), tokenizer, spec, turn_max_tokens=16, max_model_len=512)
    episodes = runner.run(generate, [Example(f"q{i}", None) for i in range(4)], 2, [11, 12, 13, 14])
    multi = [e for e in episodes if e.turns >= 2]
    assert len(multi) >= 4, [e.ending for e in episodes]
    for episode in episodes:
        c = episode.completion
        # replay the episode's requests: each is the previous prompt + what vLLM returned + the environment's turn
        whole = c.prompt_ids + c.token_ids
        mine = sorted((r for r in sent if whole[: len(r[0]) + len(r[1])] == r[0] + r[1]), key=lambda r: len(r[0]))
        assert len(mine) == episode.turns
        rebuilt, mask = [], []
        for k, (prompt, returned) in enumerate(mine):
            if k:
                env = prompt[len(c.prompt_ids) + len(rebuilt):]
                assert tokenizer.decode(env) == "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
                rebuilt += env
                mask += [False] * len(env)
            rebuilt += returned
            mask += [True] * len(returned)
        assert c.token_ids == rebuilt and c.token_mask == mask
    with torch.no_grad():
        learner = policy.completion_logprobs([(e.completion.prompt_ids, e.completion.token_ids) for e in episodes])
    deltas = [(row.float() - torch.tensor(e.completion.logprobs))[torch.tensor(e.completion.token_mask)].abs()
              for row, e in zip(learner, episodes, strict=True)]  # fmt: skip
    later = torch.cat([d[len(e_first(e, tokenizer)):] for d, e in zip(deltas, episodes, strict=True)])
    delta = torch.cat(deltas)
    assert later.numel() >= 20, "too few model tokens after the first turn"
    assert delta.mean() < 1e-2 and later.mean() < 1e-2, f"mean |dlogp| {delta.mean():.4f}, after turn 1 {later.mean():.4f}"


def e_first(episode, tokenizer) -> list[int]:
    """The model tokens of the episode's first turn (up to and with its first end-of-turn token)."""
    ids = episode.completion.token_ids
    end = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids else len(ids)
    return ids[:end]


def test_orbit_train_on_a_verifiers_tool_environment(tmp_path, int4_dir):
    """A random tiny model against tests/verifiers_envs.py's calculator taskset: its rubric (a dense
    digit-share reward among them) scores every episode, the groups' spread reaches the loss."""
    from orbit_runtime.environments.base import EpisodeState
    from orbit_runtime.environments.verifiers_adapter import VerifiersEnvironment
    from tests.verifiers_envs import calc_taskset

    job = {
        "model": {"path": str(int4_dir), "dtype": "fp16", "learner_dtype": "fp32"},
        "adapter": {"rank": 8, "alpha": 16},
        "environment": {"type": "verifiers", "load": "tests.verifiers_envs:calc_taskset", "max_turns": 2, "max_tokens": 64},
        "data": {"type": "environment", "validation_size": 4},
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_tokens": 12},
        "schedule": {"steps": 2, "learning_rate": 1e-3},
        "eval": {"every_steps": 10},
        "run": {"name": "vf", "output_dir": str(tmp_path / "runs"), "log_samples": 64},
    }
    run_dir = train_job(tmp_path, job)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 4
    env = VerifiersEnvironment(calc_taskset())
    by_prompt = {t.data.prompt: i for i, t in enumerate(env.tasks)}
    for sample in samples:  # the logged reward is the rubric's score of the logged conversation
        assert sample["messages"][0]["role"] == "user" and sample["messages"][1]["role"] == "assistant"
        state = EpisodeState(Example(sample["prompt"], sample["answer"], by_prompt[sample["prompt"]]), sample["messages"],
                             {"task": env.tasks[by_prompt[sample["prompt"]]]})  # fmt: skip
        assert sample["reward"] == pytest.approx(env.score(state)) == pytest.approx(sample["environment_reward"])
    assert any(s["advantage"] != 0 for s in samples), "the rubric's reward never reached the loss"
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert len(steps) == 2 and all(r["grad_norm"] > 0 for r in steps)
    assert all(r["mismatch_mean_abs"] < 1e-2 for r in steps)
