"""Rewards: built-ins, plugins by dotted path (sync and async), and failure isolation."""

import sys
import textwrap

import pytest

from orbit_runtime.config.spec import RewardSpec
from orbit_runtime.errors import OrbitError
from orbit_runtime.rewards.builtin import boxed_format, exact_match, extract_answer, regex
from orbit_runtime.rewards.scoring import RewardScorer, RewardsFailed


def test_builtins():
    assert extract_answer("first 3 then \\boxed{ 12 }") == "12"
    assert extract_answer("the answer is 7. Or -4") == "-4"
    assert extract_answer("none") is None
    assert exact_match(["\\boxed{12}", "12.0", "13", "x"], answers=["12", "12", "12", None]) == [1.0, 1.0, 0.0, None]
    assert exact_match(["\\boxed{12}", "12"], answers=["12", "12"], require_boxed=True) == [1.0, 0.0]
    assert boxed_format(["\\boxed{3}", " \\boxed{3}\n", "so \\boxed{3}", "\\boxed{3"]) == [1.0, 1.0, 0.0, 0.0]
    assert regex(["abc", "xyz"], pattern="b.") == [1.0, 0.0]


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            import asyncio

            def length_bonus(completions, **kwargs):
                return [len(c) * kwargs.get("scale", 1.0) for c in completions]

            async def async_one(completions, **kwargs):
                await asyncio.sleep(0)
                return [1.0 for _ in completions]

            def fragile(completions, **kwargs):
                if any("boom" in c for c in completions):
                    raise RuntimeError("reward service down")
                return [0.5 for _ in completions]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_plugins_sync_async_weighted(plugin_module):
    scorer = RewardScorer(
        [
            RewardSpec(function=f"{plugin_module}:length_bonus", weight=0.5, kwargs={"scale": 2.0}),
            RewardSpec(function=f"{plugin_module}.async_one"),
        ]
    )
    result = scorer.score(["ab", "abcd"], prompts=["p", "p"], answers=[None, None])
    assert result.total == [0.5 * 4 + 1, 0.5 * 8 + 1]
    assert result.errors == {}


def test_a_raising_reward_zeroes_only_its_failing_samples(plugin_module):
    scorer = RewardScorer([RewardSpec(function=f"{plugin_module}:fragile"), RewardSpec(function="exact_match")])
    result = scorer.score(["\\boxed{1}", "boom \\boxed{2}"], prompts=["a", "b"], answers=["1", "2"])
    assert result.per_function[f"{plugin_module}:fragile"] == [0.5, 0.0]
    assert result.total == [1.5, 1.0]
    assert result.errors == {f"{plugin_module}:fragile": 1}


def test_a_reward_that_fails_on_most_samples_fails_the_step_naming_it(plugin_module):
    name = f"{plugin_module}:fragile"
    scorer = RewardScorer([RewardSpec(function="exact_match"), RewardSpec(function=name, max_error_fraction=0.3)])
    with pytest.raises(RewardsFailed, match=rf"reward {name} \(rewards\[1\]\) raised on 2 of 3 samples.*0.3.*RuntimeError: reward service down"):
        scorer.score(["boom", "boom", "ok"], prompts=["a"] * 3, answers=["1"] * 3)
    assert scorer.score(["boom", "ok", "ok", "ok"], prompts=["a"] * 4, answers=["1"] * 4).errors == {name: 1}  # 1/4: goes on


def test_bad_reward_names_are_clear():
    with pytest.raises(OrbitError, match="not a built-in"):
        RewardScorer([RewardSpec(function="nonsense")])
    with pytest.raises(OrbitError, match="cannot import no_such_module"):
        RewardScorer([RewardSpec(function="no_such_module:fn")])
    with pytest.raises(OrbitError, match="no callable 'nope'"):
        RewardScorer([RewardSpec(function="json:nope")])


def test_prefix_match_gives_partial_credit():
    from orbit_runtime.rewards.builtin import prefix_match

    scores = prefix_match(["\\boxed{470}", "\\boxed{47}", "\\boxed{4700}", "\\boxed{9}", "470"], answers=["470"] * 5)
    assert scores == [1.0, 2 / 3, 3 / 4, 0.0, 0.0]
