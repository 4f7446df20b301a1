"""`orbit demo-model`: a tiny model vLLM's CPU backend accepts, with a tokenizer that round-trips text."""

import json

from transformers import AutoTokenizer

from orbit_runtime.demo_model import CHAT_TEMPLATE


def test_shape_respects_vllm_cpu_limits(demo_dir):
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] >= 32
    for key in ("hidden_size", "intermediate_size"):
        assert config[key] % 128 == 0  # multiples of 32 and of the INT4 group size
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    assert config["vocab_size"] == len(tokenizer)
    assert config["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_tokenizer_round_trips_and_has_chat_template(demo_dir):
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    text = "What is 12 + 7?\nAnswer: \\boxed{19}"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.decode(ids) == text
    assert tokenizer.chat_template == CHAT_TEMPLATE
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_cli_refuses_non_empty_dir(tmp_path):
    import subprocess
    import sys

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("data")
    result = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "demo-model", str(tmp_path / "x")], capture_output=True, text=True)
    assert result.returncode == 2 and "--overwrite" in result.stderr
    assert (tmp_path / "x" / "keep.txt").read_text() == "data"


def test_warmup_corpus_never_shows_the_rl_task():
    """The warm-up teaches the answer format on other questions; 'N*10' is left to RL."""
    import re

    from orbit_runtime.demo_warmup import warmup_corpus

    corpus = warmup_corpus(seed=0)
    multipliers = {m for prompt, _ in corpus for m in re.findall(r"\*(\d+)", prompt)}
    assert multipliers == {"1"}
    assert all(completion.startswith("\\boxed{") for _, completion in corpus)



def test_tool_warmup_episodes_are_what_the_calculator_environment_renders(demo_dir):
    """Each warm-up episode is the demo template's render of its messages with the calculator's schema,
    token for token, so what the warm-up teaches is what the calculator environment shows the model."""
    from orbit_runtime.demo_warmup import tool_warmup_corpus
    from orbit_runtime.environments.tools import load_tool

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    schema = load_tool("calculator").schema
    for segments in tool_warmup_corpus(seed=0)[:50]:
        question = segments[0][0].split("What is ")[1].split("?")[0]
        messages = [{"role": "user", "content": f"What is {question}?"}]
        for text, trained in segments[1:]:
            if trained:
                messages.append({"role": "assistant", "content": text.removesuffix("<|im_end|>")})
            else:
                messages.append({"role": "tool", "content": text.split("<|im_start|>tool\n")[1].split("<|im_end|>")[0]})
        rendered = tokenizer.apply_chat_template(messages, tools=[schema], tokenize=False).rstrip("\n")
        assert "".join(text for text, _ in segments) == rendered
        pieces = [tokenizer.encode(text, add_special_tokens=False) for text, _ in segments]  # the warm-up encodes each part
        assert sum(pieces, []) == tokenizer.encode(rendered, add_special_tokens=False)
        assert segments[-1][0] == f"\\boxed{{{messages[-2]['content']}}}<|im_end|>"  # the box holds the tool's answer


def test_warm_up_reports_every_step_to_on_step(demo_dir, tmp_path):
    """benchmarks/calculator_warmup.py probes the model in training through ON_STEP."""
    import shutil

    import torch

    from orbit_runtime.demo_warmup import warm_up

    model_dir = shutil.copytree(demo_dir, tmp_path / "demo")
    seen: list[tuple[int, bool, float]] = []
    loss = warm_up(model_dir, steps=3, batch=4, tools=True, tool_episodes=2,
                   on_step=lambda step, model, value: seen.append((step, model.training, value)))  # fmt: skip
    assert [step for step, _, _ in seen] == [1, 2, 3]
    assert all(training for _, training, _ in seen)  # the callback gets the model being trained, in train mode
    assert seen[-1][2] == loss and torch.isfinite(torch.tensor(loss))


def test_optional_tool_corpus_boxes_the_rest_directly_and_leaves_the_all_tool_corpus_as_it_was():
    """TOOL_SHARE < 1 (the calculator recipe's third stage); at 1.0 the corpus is the one earlier results were measured on."""
    from orbit_runtime.demo_warmup import tool_prompt, tool_warmup_corpus

    everything = tool_warmup_corpus(7, count=400)
    assert tool_warmup_corpus(7, count=400, tool_share=1.0) == everything and len(everything) == 400
    assert all(len(episode) == 4 for episode in everything)  # call, tool turn, box
    mixed = tool_warmup_corpus(7, count=400, tool_share=0.4)
    direct = [episode for episode in mixed if len(episode) == 2]
    assert 0.5 < len(direct) / len(mixed) < 0.7  # about 60% box directly
    for (prompt, prompt_trained), (answer, answer_trained) in direct:
        expression = prompt.split("What is ")[1].split("?")[0]
        assert prompt == tool_prompt(expression) and not prompt_trained and answer_trained
        a, op, b = expression[:2], expression[2], expression[3:]  # two-digit + and - only
        assert answer == f"\\boxed{{{int(a) + int(b) if op == '+' else int(a) - int(b)}}}<|im_end|>"


def test_demo_warmup_trains_a_model_further_and_names_bad_input(demo_dir, tmp_path):
    """`orbit demo-warmup`: a later stage of the calculator recipe (Makefile, demo-calculator), trained in place."""
    import shutil

    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from orbit_runtime.cli import app

    model_dir = shutil.copytree(demo_dir, tmp_path / "demo")
    before = load_file(model_dir / "model.safetensors")
    result = CliRunner().invoke(app, ["demo-warmup", str(model_dir), "--steps", "2", "--tools", "--tool-episodes", "4",
                                      "--tool-share", "0.5", "--seed", "3"])  # fmt: skip
    assert result.exit_code == 0, result.output
    after = load_file(model_dir / "model.safetensors")
    assert any(not after[name].equal(before[name]) for name in before)  # trained in place
    for args, named in ((["--steps", "2", "--tool-share", "0"], "--tool-share"), (["--steps", "0"], "--steps"),
                        (["--steps", "1", "--lr", "0"], "--lr"), (["--steps", "1", "--tool-episodes", "0"], "--tool-episodes")):  # fmt: skip
        result = CliRunner().invoke(app, ["demo-warmup", str(model_dir), *args])
        assert result.exit_code == 2 and named in result.output
        assert not any(flag in result.output for flag in ("--steps", "--lr", "--tool-share", "--tool-episodes") if flag != named)
    result = CliRunner().invoke(app, ["demo-warmup", str(tmp_path / "missing"), "--steps", "1"])
    assert result.exit_code == 2 and "config.json" in result.output
