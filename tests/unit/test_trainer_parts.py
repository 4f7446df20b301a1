"""Pure parts of the trainer: per-prompt sampling seeds, the canary and the eval metric from
the config, and the samples a step writes."""

import torch
from transformers import AutoTokenizer

from orbit_runtime.config import parse_job_spec
from orbit_runtime.data.datasets import Example
from orbit_runtime.rewards.scoring import RewardResult
from orbit_runtime.rollout.client import Completion
from orbit_runtime.trainer.batch import RolloutBatch, canary_pairs, sampling_seeds
from orbit_runtime.trainer.evaluation import eval_reward_spec
from orbit_runtime.trainer.recorder import sample_rows


def test_sampling_seeds_are_distinct_per_position_and_step_and_reproducible():
    seeds = sampling_seeds(0, 3, 16)
    assert len(set(seeds)) == 16 and seeds == sampling_seeds(0, 3, 16)
    assert set(seeds).isdisjoint(sampling_seeds(0, 4, 16)) and set(seeds).isdisjoint(sampling_seeds(1, 3, 16))
    assert all(0 <= s < 2**31 for s in seeds)


def test_canary_and_eval_metric_come_from_the_config(int4_dir):
    tokenizer = AutoTokenizer.from_pretrained(int4_dir)
    examples = [Example("What is 2+3?", "5"), Example("Say hi", None)]
    default = parse_job_spec({"model": {"path": "x"}, "rewards": [{"function": "exact_match", "kwargs": {"require_boxed": True}}]})
    (_, boxed), (_, plain) = canary_pairs(default, tokenizer, examples)
    assert tokenizer.decode(boxed) == "\\boxed{5}<|im_end|>" and tokenizer.decode(plain) == "ok<|im_end|>"
    assert eval_reward_spec(default).function == "exact_match" and eval_reward_spec(default).kwargs == {"require_boxed": True}

    custom = parse_job_spec({
        "model": {"path": "x"}, "sync": {"canary_completion": "The answer is {answer}."},
        "eval": {"reward": {"function": "prefix_match"}},
    })  # fmt: skip
    (_, text), _ = canary_pairs(custom, tokenizer, examples)
    assert tokenizer.decode(text) == "The answer is 5.<|im_end|>"
    assert eval_reward_spec(custom).function == "prefix_match"


def test_sample_rows_spread_over_groups_and_all_when_asked():
    examples = [Example(f"q{i}", str(i)) for i in range(4)]
    completions = [Completion([1], [2, 3], [-0.1, -0.2], "stop") for _ in range(8)]
    batch = RolloutBatch([10, 11, 12, 13], examples, completions, [f"c{i}" for i in range(8)],
                         RewardResult(total=[float(i) for i in range(8)], per_function={}), torch.zeros(8), None)  # fmt: skip
    rows = sample_rows(5, batch, group_size=2, limit=4)
    assert [r["group"] for r in rows] == [0, 1, 2, 3] and rows[1]["prompt"] == "q1" and rows[1]["prompt_index"] == 11
    assert {"step", "prompt", "completion", "reward", "group"} <= rows[0].keys() and rows[0]["step"] == 5
    assert len(sample_rows(5, batch, 2, limit=100)) == 8 and sample_rows(5, batch, 2, limit=0) == []


def test_top_p_below_one_is_refused_naming_the_field():
    import pytest

    from orbit_runtime.errors import OrbitError

    with pytest.raises(OrbitError, match=r"rollout\.top_p: .*must be 1\.0"):
        parse_job_spec({"model": {"path": "x"}, "rollout": {"top_p": 0.9}})
