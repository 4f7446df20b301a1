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
