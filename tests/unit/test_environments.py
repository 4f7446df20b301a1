"""Multi-turn episodes without a server: tool calls, the calculator, chat-template token deltas,
the episode runner (token ids, masks, log-probs, limits, concurrency) and the learner's masks."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from orbit_runtime.algorithms.mismatch import measure_mismatch
from orbit_runtime.config import parse_job_spec
from orbit_runtime.config.environment import EnvironmentSpec
from orbit_runtime.data.datasets import Example
from orbit_runtime.environments.base import Environment, EnvReply, EpisodeState
from orbit_runtime.environments.calculator import calculator
from orbit_runtime.environments.chat_tokens import ChatTokens
from orbit_runtime.environments.tool_calls import format_tool_call, parse_tool_calls
from orbit_runtime.environments.tools import Tool, ToolEnvironment, load_tool
from orbit_runtime.errors import OrbitError
from orbit_runtime.learner.update import UpdateBatch
from orbit_runtime.rewards.scoring import RewardScorer
from orbit_runtime.rollout.client import Completion
from orbit_runtime.trainer.episodes import EnvironmentFailed, EpisodeRunner


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from orbit_runtime.demo_model import write_demo_model

    return AutoTokenizer.from_pretrained(write_demo_model(tmp_path_factory.mktemp("m") / "demo"))


# ---- tool calls and tools --------------------------------------------------------------------
def test_tool_calls_are_parsed_and_malformed_ones_reported():
    text, calls = parse_tool_calls('ok <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>')
    assert text == "ok" and calls[0].name == "calculator" and calls[0].arguments == {"expression": "2*3"}
    assert parse_tool_calls(format_tool_call("f", {"x": 1}))[1][0].arguments == {"x": 1}
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert calls[0].arguments == {"x": 2} and calls[0].error is None  # arguments as a JSON string
    assert "not JSON" in parse_tool_calls("<tool_call>{nope</tool_call>")[1][0].error
    assert "without </tool_call>" in parse_tool_calls('<tool_call>{"name": "f"')[1][0].error
    assert parse_tool_calls("\\boxed{6}") == ("\\boxed{6}", [])


def test_calculator_computes_and_refuses_what_is_not_arithmetic():
    assert calculator("47*38") == "1786" and calculator("(1+2)*3-4/2") == "7" and calculator("7/2") == "3.5"
    for bad, match in [("__import__('os')", "only numbers"), ("2**100000", "too large"), ("1/0", "division by zero"),
                       ("9" * 300, "longer"), ("2+", "not an arithmetic")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            calculator(bad)


def test_tool_schema_comes_from_the_function_and_bad_tools_name_the_field():
    schema = Tool.of(calculator).schema["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]
    with pytest.raises(OrbitError, match="environment.tools 'no_such_module:f'"):
        load_tool("no_such_module:f")

    def undocumented(x):
        return x

    with pytest.raises(OrbitError, match="no JSON schema"):
        Tool.of(undocumented)


def test_tool_environment_answers_calls_errors_and_ends_without_a_call():
    env = ToolEnvironment([Tool.of(calculator)], timeout_s=1.0)
    state = env.reset(Example("What is 2*3?", "6"))
    reply = env.step(state, {"role": "assistant", "content": format_tool_call("calculator", {"expression": "2*3"})})
    assert not reply.done and reply.messages == [{"role": "tool", "name": "calculator", "content": "6"}]
    bad = env.step(state, {"role": "assistant", "content": format_tool_call("calculator", {"expr": "1"})})
    assert bad.messages[0]["content"].startswith("error: bad arguments")
    unknown = env.step(state, {"role": "assistant", "content": format_tool_call("search", {})})
    assert "no tool 'search'" in unknown.messages[0]["content"]
    assert env.step(state, {"role": "assistant", "content": "\\boxed{6}"}).done


# ---- tokens across turns ---------------------------------------------------------------------
def test_environment_turn_tokens_are_the_templates_text_for_the_new_messages(tokenizer):
    """opening + the model's turn (ending in EOS) + the delta == the tokens of the whole conversation
    rendered at once, for a template whose render is stable (the demo's): the delta is exactly
    what the template writes, and it is appended, never re-tokenized with the history."""
    chat = ChatTokens(tokenizer)
    tools = [Tool.of(calculator).schema]
    opening = [{"role": "user", "content": "What is 12*3?"}]
    model_turn = tokenizer.encode(format_tool_call("calculator", {"expression": "12*3"}), add_special_tokens=False)
    model_turn.append(tokenizer.eos_token_id)
    tool = [{"role": "tool", "name": "calculator", "content": "36"}]
    ids = chat.opening(opening, tools) + model_turn + chat.environment_turn(tool, tools, model_turn)
    whole = tokenizer.apply_chat_template([*opening, {"role": "assistant", "content": tokenizer.decode(model_turn[:-1])}, *tool],
                                          tools=tools, add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert ids == tokenizer.encode(whole, add_special_tokens=False)
    assert tokenizer.decode(chat.environment_turn(tool, tools, model_turn)) == "\n<|im_start|>tool\n36<|im_end|>\n<|im_start|>assistant\n"


class ScriptedGenerate:
    """Stands in for vLLM: each call returns the next scripted turn (tokens of TEXT + EOS, log-prob -0.5 each)
    and records the prompt it was sent."""

    def __init__(self, tokenizer, turns: list[str], finish: str = "stop") -> None:
        self.tokenizer, self.turns, self.finish = tokenizer, turns, finish
        self.prompts: list[list[int]] = []
        self.lock = threading.Lock()

    def __call__(self, ids: list[int], budget: int, seed: int | None) -> Completion:
        with self.lock:
            index = sum(1 for p in self.prompts if p[: len(ids)] == ids[: len(p)] and len(p) <= len(ids))
            self.prompts.append(list(ids))
        text = self.turns[min(index, len(self.turns) - 1)]
        tokens = self.tokenizer.encode(text, add_special_tokens=False)[:budget]
        finish = self.finish
        if len(tokens) < budget and finish == "stop":
            tokens.append(self.tokenizer.eos_token_id)
        else:
            finish = "length"
        return Completion(list(ids), tokens, [-0.5] * len(tokens), finish)


def _runner(tokenizer, env=None, **limits) -> EpisodeRunner:
    spec = EnvironmentSpec(type="tools", tools=["calculator"], **limits)
    return EpisodeRunner(env or ToolEnvironment([Tool.of(calculator)]), tokenizer, spec, turn_max_tokens=64, max_model_len=512)


def test_an_episode_is_the_generated_ids_plus_the_environments_with_a_mask(tokenizer):
    call = format_tool_call("calculator", {"expression": "12*3"})
    generate = ScriptedGenerate(tokenizer, [call, "\\boxed{36}"])
    episode = _runner(tokenizer).episode(generate, Example("What is 12*3?", "36"), 0, 7)
    first = tokenizer.encode(call, add_special_tokens=False) + [tokenizer.eos_token_id]
    second = tokenizer.encode("\\boxed{36}", add_special_tokens=False) + [tokenizer.eos_token_id]
    # the environment's turn as the demo template writes it (after the model's <|im_end|>)
    env_ids = tokenizer.encode("\n<|im_start|>tool\n36<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    c = episode.completion
    assert c.token_ids == first + env_ids + second
    assert c.token_mask == [True] * len(first) + [False] * len(env_ids) + [True] * len(second)
    assert c.logprobs == [-0.5] * len(first) + [0.0] * len(env_ids) + [-0.5] * len(second)
    # the second request was sent exactly the first's prompt + its tokens + the environment's
    assert generate.prompts[1] == generate.prompts[0] + first + env_ids == c.prompt_ids + first + env_ids
    assert episode.ending == "done" and episode.turns == 2 and c.finish_reason == "stop"
    assert episode.answer == "\\boxed{36}" and [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant"]
    assert episode.model_tokens == len(first) + len(second)


def test_episode_limits_truncate_like_a_single_turn_cut(tokenizer):
    call = format_tool_call("calculator", {"expression": "1+1"})
    example = Example("What is 1+1?", "2")
    turns = _runner(tokenizer, max_turns=2).episode(ScriptedGenerate(tokenizer, [call]), example, 0, None)
    assert turns.ending == "max_turns" and turns.turns == 2 and turns.completion.finish_reason == "length"
    assert turns.completion.token_mask[-1] is True  # no environment tokens after the last model turn
    tokens = _runner(tokenizer, max_tokens=80).episode(ScriptedGenerate(tokenizer, [call]), example, 0, None)
    assert tokens.ending == "max_tokens" and len(tokens.completion.token_ids) <= 80
    cut = _runner(tokenizer).episode(ScriptedGenerate(tokenizer, ["x" * 100], finish="length"), example, 0, None)
    assert cut.ending == "turn_cut" and cut.turns == 1 and cut.completion.finish_reason == "length"
    assert cut.messages[-1] == {"role": "assistant", "content": "x" * 64}  # the cut turn is in the transcript


class Raising(Environment):
    def __init__(self, every: bool) -> None:
        self.every = every

    def reset(self, example: Example) -> EpisodeState:
        return EpisodeState(example, [{"role": "user", "content": example.prompt}])

    def step(self, state: EpisodeState, message) -> EnvReply:
        if self.every or state.example.prompt == "bad":
            raise RuntimeError("environment bug")
        return EnvReply([], done=True, reward=0.75)


def test_an_environment_that_raises_ends_its_episode_and_a_mostly_failing_one_fails_the_step(tokenizer):
    runner = _runner(tokenizer, env=Raising(every=False))
    episodes = runner.run(ScriptedGenerate(tokenizer, ["hi"]), [Example("bad", None), Example("good", None)], 2, None)
    assert [e.ending for e in episodes] == ["env_error", "env_error", "done", "done"]
    assert [e.environment_reward for e in episodes] == [None, None, 0.75, 0.75]
    with pytest.raises(EnvironmentFailed, match="raised on 2 of 2"):
        _runner(tokenizer, env=Raising(every=True)).run(ScriptedGenerate(tokenizer, ["hi"]), [Example("x", None)], 2, None)


def test_episodes_are_in_flight_at_once(tokenizer):
    """Eight episodes with concurrency 8: every first turn is requested before any is answered
    (a barrier that only opens when all eight wait on it at once)."""
    barrier = threading.Barrier(8, timeout=10)
    scripted = ScriptedGenerate(tokenizer, ["\\boxed{2}"])

    def generate(ids, budget, seed):
        barrier.wait()
        return scripted(ids, budget, seed)

    episodes = _runner(tokenizer, concurrency=8).run(generate, [Example(f"q{i}", "2") for i in range(4)], 2, [1, 2, 3, 4])
    assert len(episodes) == 8 and all(e.ending == "done" for e in episodes)


# ---- the learner's view ----------------------------------------------------------------------
def test_environment_tokens_count_in_neither_the_loss_nor_the_mismatch():
    masks = [torch.tensor([True, True, False, False, True])]
    batch = UpdateBatch(pairs=[([1, 2], [3, 4, 5, 6, 7])], rollout_logprobs=[torch.tensor([-1.0, -1.0, 0.0, 0.0, -1.0])],
                        advantages=torch.tensor([1.0]), token_masks=masks)  # fmt: skip
    assert batch.trained_length(0) == 3 and batch.trained_tokens(0).tolist() == [1, 1, 0, 0, 1]
    learner = [torch.tensor([-1.1, -0.9, -7.0, -9.0, -1.0])]  # wildly off at the environment's tokens
    stats = measure_mismatch(learner, batch.rollout_logprobs, masks)
    assert stats.tokens == 3 and stats.max_abs_dlogp == pytest.approx(0.1)
    assert measure_mismatch(learner, batch.rollout_logprobs).max_abs_dlogp == pytest.approx(9.0)  # without the mask


def test_environment_reward_reaches_the_rewards_that_take_it():
    def takes_it(completions, *, environment_rewards, **_):
        return [2 * r for r in environment_rewards]

    def does_not(completions, prompts, answers):
        return [1.0 for _ in completions]

    import sys
    import types

    module = types.ModuleType("orbit_test_rewards")
    module.takes_it, module.does_not = takes_it, does_not
    sys.modules["orbit_test_rewards"] = module
    from orbit_runtime.config.spec import RewardSpec

    scorer = RewardScorer([RewardSpec(function="environment"), RewardSpec(function="orbit_test_rewards:takes_it"),
                           RewardSpec(function="orbit_test_rewards:does_not")])  # fmt: skip
    result = scorer.score(["a", "b"], ["p", "q"], [None, None], extra={"environment_rewards": [0.5, 0.0]})
    assert result.total == [0.5 + 1.0 + 1.0, 0.0 + 0.0 + 1.0] and not result.errors


# ---- the job spec ----------------------------------------------------------------------------
@pytest.mark.parametrize(("environment", "extra", "message"), [
    ({"type": "tools"}, {}, "type tools needs at least one entry in tools"),
    ({"type": "tools", "tools": ["nope"]}, {}, "not a built-in tool"),
    ({"type": "verifiers"}, {}, "type verifiers needs load"),
    ({"type": "tools", "tools": ["calculator"]}, {"moe": {"routing_replay": True}}, "moe.routing_replay"),
    ({"type": "tools", "tools": ["calculator"]}, {"data": {"type": "environment"}}, "only a verifiers environment"),
    ({"type": "verifiers", "load": "m:f"}, {"data": {"type": "synthetic_arithmetic"}}, "runs its own tasks"),
])  # fmt: skip
def test_environment_spec_errors_name_the_field(environment, extra, message):
    with pytest.raises(OrbitError, match=message):
        parse_job_spec({"model": {"path": "x"}, "environment": environment, **extra})


def test_a_verifiers_job_defaults_to_its_rubric_and_its_own_tasks():
    spec = parse_job_spec({"model": {"path": "x"}, "environment": {"type": "verifiers", "load": "m:f"}})
    assert [r.function for r in spec.rewards] == ["environment"] and spec.data.type == "environment"
    with pytest.raises(OrbitError, match="environment reward needs an environment"):
        parse_job_spec({"model": {"path": "x"}, "rewards": [{"function": "environment"}]})


# ---- verifiers environments (built locally: tests/verifiers_envs.py) --------------------------
def _verifiers_env(name: str):
    from orbit_runtime.environments.verifiers_adapter import VerifiersEnvironment
    from tests import verifiers_envs

    return VerifiersEnvironment(getattr(verifiers_envs, name)())


def test_a_verifiers_single_turn_environment_is_scored_by_its_rubric(tokenizer):
    env = _verifiers_env("qa_taskset")
    splits = env.splits(validation_size=4, seed=0)
    assert len(splits.train) == 8 and len(splits.validation) == 4 and env.tools(splits.train[0]) is None
    example = next(e for e in splits.train + splits.validation if e.prompt == "What is 3+3?")
    assert env.reset(example).messages == [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 3+3?"}]
    runner = EpisodeRunner(env, tokenizer, EnvironmentSpec(type="verifiers", load="m:f"), turn_max_tokens=32, max_model_len=512)
    right, wrong = (runner.episode(ScriptedGenerate(tokenizer, [text]), example, 0, None) for text in ("It is 6", "no"))
    assert right.turns == wrong.turns == 1 and right.ending == "done"
    assert right.environment_reward == pytest.approx(1.0 + 0.5 * 1 / 7) and wrong.environment_reward == 0.0


def test_a_verifiers_tool_environment_runs_its_tools_and_its_rubric_reward_reaches_the_loss(tokenizer):
    from orbit_runtime.algorithms.grpo import group_advantages

    env = _verifiers_env("calc_taskset")
    splits = env.splits(4, 0)
    example = next(e for e in splits.train + splits.validation if e.prompt == "Use the tool to compute 10+13.")
    schema = env.tools(example)[0]["function"]
    assert schema["name"] == "calc_add" and set(schema["parameters"]["required"]) == {"a", "b"}
    runner = EpisodeRunner(env, tokenizer, EnvironmentSpec(type="verifiers", load="m:f"), turn_max_tokens=64, max_model_len=512)
    call = format_tool_call("calc_add", {"a": 10, "b": 13})
    used = runner.episode(ScriptedGenerate(tokenizer, [call, "23"]), example, 0, None)
    assert [m["role"] for m in used.messages] == ["user", "assistant", "tool", "assistant"]
    assert used.messages[2]["content"] == "23" and used.ending == "done"
    skipped = runner.episode(ScriptedGenerate(tokenizer, ["maybe 7"]), example, 0, None)
    assert used.environment_reward == pytest.approx(1.5) and skipped.environment_reward == pytest.approx(0.5 / 7)
    # the rubric's reward is the `environment` reward, and its spread across a group is the advantage
    scorer = RewardScorer(parse_job_spec({"model": {"path": "x"}, "environment": {"type": "verifiers", "load": "m:f"}}).rewards)
    rewards = scorer.score([used.answer, skipped.answer], [example.prompt] * 2, [example.answer] * 2,
                           extra={"environment_rewards": [used.environment_reward, skipped.environment_reward]})  # fmt: skip
    advantages = group_advantages(torch.tensor(rewards.total), 2, True)
    assert rewards.total == [used.environment_reward, skipped.environment_reward] and advantages[0] > 0 > advantages[1]


# ---- BFCL (the data files of the installed bfcl-eval package) --------------------------------
def _ground_truth_calls(answer: str) -> list[str]:
    """One call text per expected call, with each parameter's first allowed value (optional ones left out)."""
    calls = []
    for expected in json.loads(answer):
        ((name, params),) = expected.items()
        arguments = {p: allowed[0] for p, allowed in params.items() if allowed and allowed[0] != ""}
        calls.append(format_tool_call(name, arguments))
    return calls


def test_bfcl_possible_answers_score_1_and_wrong_calls_0(tokenizer):
    from orbit_runtime.environments.bfcl import CATEGORIES, BfclEnvironment, bfcl_examples

    examples = bfcl_examples(list(CATEGORIES))
    assert len(examples) == 400 + 200 + 200 + 200
    env = BfclEnvironment()
    for example in examples:  # every task's own answer, its calls in reverse order (parallel ones may come in any)
        state = env.reset(example)
        reply = env.step(state, {"role": "assistant", "content": "".join(reversed(_ground_truth_calls(example.answer)))})
        assert reply.done and reply.reward == 1.0, example.source["id"]
    example = examples[0]  # simple_python_0: calculate_triangle_area(base=10, height=5)
    wrong = [format_tool_call("calculate_triangle_area", {"base": 11, "height": 5}),
             format_tool_call("calculate_triangle_area", {"base": 10}),
             format_tool_call("calculate_triangle_area", {"base": 10, "height": 5, "colour": "red"}),
             format_tool_call("area", {"base": 10, "height": 5}), "the area is 25", _ground_truth_calls(example.answer)[0] * 2]  # fmt: skip
    assert [env.step(env.reset(example), {"role": "assistant", "content": w}).reward for w in wrong] == [0.0] * 6
    assert env.step(env.reset(example), {"role": "assistant", "content": format_tool_call(
        "calculate_triangle_area", {"base": 10.0, "height": 5, "unit": "Units "})}).reward == 1.0  # fmt: skip
    schema = env.tools(example)[0]
    assert schema["function"]["parameters"]["type"] == "object"  # BFCL's "dict", as OpenAI's tools format has it
    opening = ChatTokens(tokenizer).opening(env.reset(example).messages, env.tools(example))
    assert "tools: calculate_triangle_area(base,height,unit)" in tokenizer.decode(opening)


def test_a_bfcl_job_scores_with_the_answer_check():
    spec = parse_job_spec({"model": {"path": "x"}, "environment": {"type": "bfcl"}})
    assert spec.data.type == "bfcl" and [r.function for r in spec.rewards] == ["environment"]
    with pytest.raises(OrbitError, match="go together"):
        parse_job_spec({"model": {"path": "x"}, "environment": {"type": "tools", "tools": ["calculator"]}, "data": {"type": "bfcl"}})


# ---- review fixes: templates that rewrite earlier turns, masks in the loss, limits, the spec ---
QWEN3_LIKE = (  # as Qwen3's template: an empty think block on the assistant turn only while it is the last message
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_that_rewrites_the_last_assistant_turn_still_gives_the_delta(tokenizer):
    """Qwen3 adds an empty <think> block to the last assistant message only: the conversation
    rendered without the new messages is then not a prefix of the one with them."""
    import copy

    qwen3 = copy.deepcopy(tokenizer)
    qwen3.chat_template = QWEN3_LIKE
    chat = ChatTokens(qwen3)
    tool = [{"role": "tool", "content": "36"}]
    model_turn = qwen3.encode("\\boxed{36}", add_special_tokens=False) + [qwen3.eos_token_id]
    assert qwen3.decode(chat.environment_turn(tool, None, model_turn)) == "\n<|im_start|>tool\n36<|im_end|>\n<|im_start|>assistant\n"
    # a turn that stopped on another EOS id (<|endoftext|>) gets the end-of-turn marker first, as environment tokens
    other_end = model_turn[:-1] + [qwen3.pad_token_id]
    assert qwen3.decode(chat.environment_turn(tool, None, other_end)).startswith("<|im_end|>\n<|im_start|>tool")


def test_the_loss_and_its_gradient_ignore_whatever_sits_at_environment_tokens():
    from orbit_runtime.algorithms.grpo import LossConfig, LossInputs, grpo_loss

    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 1.0, 1.0, 1.0]])
    for level in ("token", "sequence"):
        config = LossConfig(kl_beta=0.1, correction="tis", mismatch_level=level)
        results = []
        for junk in (0.0, -30.0):  # the environment tokens' values: placeholders or anything else
            base = torch.randn(2, 5) * 0.1 - 1.0
            noisy = torch.where(mask.bool(), base, torch.full_like(base, junk))
            logprobs = noisy.clone().requires_grad_(True)
            inputs = LossInputs(logprobs=logprobs, old_logprobs=noisy + 0.01, rollout_logprobs=noisy - 0.02,
                                advantages=torch.tensor([1.0, -0.5]), mask=mask, ref_logprobs=noisy + 0.03)  # fmt: skip
            out = grpo_loss(inputs, config)
            out.loss.backward()
            results.append((float(out.loss), logprobs.grad.clone()))
            torch.manual_seed(0)
        assert results[0][0] == pytest.approx(results[1][0]) and torch.allclose(results[0][1], results[1][1])
        assert (results[0][1][~mask.bool()] == 0).all()


def test_an_episode_whose_environment_raised_is_left_out_of_the_loss(tokenizer):
    from orbit_runtime.rewards.scoring import RewardResult
    from orbit_runtime.trainer.batch import RolloutBatch

    runner = _runner(tokenizer, env=Raising(every=False))
    episodes = runner.run(ScriptedGenerate(tokenizer, ["hi"]), [Example("bad", None), Example("good", None)], 2, None)
    batch = RolloutBatch([0, 1], [Example("bad", None), Example("good", None)], [e.completion for e in episodes],
                         [e.answer for e in episodes], RewardResult([0.0] * 4, {}), torch.zeros(4), None, episodes=episodes)  # fmt: skip
    update = batch.for_update()
    assert update.loss_mask == [False, False, True, True] and [update.trained_length(i) for i in range(4)][:2] == [0, 0]
    assert batch.tokens == sum(e.model_tokens for e in episodes)


def test_an_episode_stops_before_the_context_is_full(tokenizer):
    call = format_tool_call("calculator", {"expression": "1+1"})
    spec = EnvironmentSpec(type="tools", tools=["calculator"], max_turns=8, max_tokens=400)
    runner = EpisodeRunner(ToolEnvironment([Tool.of(calculator)]), tokenizer, spec, turn_max_tokens=64, max_model_len=200)
    episode = runner.episode(ScriptedGenerate(tokenizer, [call]), Example("What is 1+1?", "2"), 0, None)
    assert episode.ending == "max_tokens" and len(episode.completion.prompt_ids) + len(episode.completion.token_ids) <= 200
    assert episode.completion.token_mask[-1] is True  # ends on the model's turn, no dangling environment tokens


def test_single_turn_jobs_keep_their_config_hash():
    """A job without an environment hashes as before the section existed, so its old checkpoints resume."""
    from orbit_runtime.config.fingerprint import training_fields

    assert not any(k.startswith("environment") for k in training_fields(parse_job_spec({"model": {"path": "x"}})))


@pytest.mark.parametrize(("job", "message"), [
    ({"environment": {"type": "tools", "tools": ["calculator"], "max_turns": 0}}, "environment.max_turns"),
    ({"environment": {"type": "python", "load": "nocolon"}}, "expected 'module:callable'"),
    ({"environment": {"type": "tools", "tools": ["calculator"], "load": "m:f"}}, "load and kwargs are for"),
    ({"environment": {"type": "bfcl", "system_prompt": "hi"}}, "system_prompt is for type tools"),
    ({"environment": {"type": "tools", "tools": ["calculator"], "max_tokens": 600}}, "below rollout.max_model_len"),
    ({"environment": {"type": "tools", "tools": ["calculator"]}, "rewards": [{"function": "environment"}]}, "gives no environment reward"),
    ({"environment": {"type": "tools", "tools": ["calculator"]}, "rollout": {"use_chat_template": False}}, "use_chat_template"),
    ({"environment": {"type": "tools", "tools": ["calculator"], "concurrency": 500}}, "environment.concurrency"),
])  # fmt: skip
def test_more_environment_spec_errors_name_the_field(job, message):
    with pytest.raises(OrbitError, match=message):
        parse_job_spec({"model": {"path": "x"}, **job})


def test_calculator_float_powers():
    assert calculator("2.5**2") == "6.25"
    for bad in ("(-8)**0.5", "10.0**400"):
        with pytest.raises(ValueError):
            calculator(bad)
