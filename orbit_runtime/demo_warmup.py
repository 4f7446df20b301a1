"""A brief supervised warm-up of the demo model, standing in for pretraining.

Real RL starts from a pretrained model that can already read a question and write an
answer in the expected format. The demo model starts random, so it first learns (full-
parameter SFT of the 16-bit model, before quantization) the answer format on OTHER
problems: "What is 437?" and "What is 437*1?" -> "\\boxed{437}". It never sees another
multiplier, so it answers "What is 43*10?" with "\\boxed{43}"; RL on the INT4 base + LoRA is
what teaches it to multiply by ten, a rule it then applies to questions never used in RL
(the held-out accuracy).

With tools (`tool_warmup_corpus`, for the calculator environment) it also learns the Hermes/Qwen
tool-call format on two-digit additions and subtractions: call the calculator with the question's
expression, then box what the tool answered. With a TOOL_SHARE below 1 some questions are boxed
directly instead, so the model learns that the tool is optional. examples/calculator.yaml asks
such questions (held out from RL, not guaranteed disjoint from the warm-up's). The Makefile's
demo-calculator recipe warms up in three stages; RL then teaches the model to call the tool
(docs/multi-turn.md, "Measured").
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any


def warmup_corpus(seed: int, count: int = 600) -> list[tuple[str, str]]:
    """(prompt, completion) text pairs in the chat format; the loss is on the completion only."""
    rng = random.Random(seed)
    numbers = list(range(100)) + [rng.randrange(100, 10000) for _ in range(count - 100)]
    pairs = []
    for i, n in enumerate(numbers):
        question = f"{n}*1" if i % 2 else str(n)
        prompt = f"<|im_start|>user\nWhat is {question}?<|im_end|>\n<|im_start|>assistant\n"
        pairs.append((prompt, f"\\boxed{{{n}}}<|im_end|>"))
    return pairs


Segments = list[tuple[str, bool]]  # (text, trained): one sequence, the loss on the trained parts only


def tool_prompt(expression: str) -> str:
    """The demo template's render of the calculator environment's first turn asking EXPRESSION."""
    return (f"<|im_start|>system\ntools: calculator(expression)<|im_end|>\n"
            f"<|im_start|>user\nWhat is {expression}?<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip


def tool_warmup_corpus(seed: int, count: int = 600, tool_share: float = 1.0) -> list[Segments]:
    """Calculator questions a + b and a - b (two-digit a, b), a TOOL_SHARE of them (at random) answered with the tool.

    A tool episode is the call, the tool's turn (not trained) and the boxed result. The others box the
    result directly, as a model that rarely reaches for a tool answers from its weights; the tiny model
    cannot add, so on new questions those answers are guesses, and only calling the tool pays.
    """
    from orbit_runtime.environments.calculator import calculator
    from orbit_runtime.environments.tool_calls import format_tool_call

    rng = random.Random(seed + 1)
    episodes = []
    for _ in range(count):
        a, b, op = rng.randrange(10, 100), rng.randrange(10, 100), rng.choice("+-")
        expression = f"{a}{op}{b}"
        result = calculator(expression)
        if tool_share < 1.0 and rng.random() >= tool_share:  # no draw at 1.0: the all-tool corpus stays as it was
            episodes.append([(tool_prompt(expression), False), (f"\\boxed{{{result}}}<|im_end|>", True)])
            continue
        episodes.append([(tool_prompt(expression), False), (format_tool_call("calculator", {"expression": expression}) + "<|im_end|>", True),
                         (f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n", False),
                         (f"\\boxed{{{result}}}<|im_end|>", True)])  # fmt: skip
    return episodes


def warm_up(model_dir: Path, steps: int = 400, seed: int = 0, lr: float = 3e-3, batch: int = 32, tools: bool = False,
            tool_episodes: int = 600, tool_share: float = 1.0, on_step: Callable[[int, Any, float], None] | None = None) -> float:  # fmt: skip
    """Train MODEL_DIR in place on `warmup_corpus` (and, with TOOLS, TOOL_EPISODES of `tool_warmup_corpus`, a
    TOOL_SHARE of them using the tool); returns the final loss. ON_STEP(step, model, loss), if given, runs
    after every step (benchmarks/calculator_warmup.py probes the model with it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    corpus: list[Segments] = [[(prompt, False), (completion, True)] for prompt, completion in warmup_corpus(seed)]
    if tools:
        corpus += tool_warmup_corpus(seed, count=tool_episodes, tool_share=tool_share)
    encoded = []  # (ids, labels) per sequence; labels -100 where not trained
    for segments in corpus:
        ids: list[int] = []
        labels: list[int] = []
        for text, trained in segments:
            part = tokenizer.encode(text, add_special_tokens=False)
            ids += part
            labels += part if trained else [-100] * len(part)
        encoded.append((ids, labels))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    rng = random.Random(seed)
    loss_value = float("nan")
    for step in range(1, steps + 1):
        rows = [encoded[rng.randrange(len(encoded))] for _ in range(batch)]
        width = max(len(row_ids) for row_ids, _ in rows)
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        labels = torch.full((batch, width), -100)
        for i, (row_ids, row_labels) in enumerate(rows):
            ids[i, : len(row_ids)] = torch.tensor(row_ids)
            labels[i, : len(row_labels)] = torch.tensor(row_labels)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        loss_value = float(loss.detach())
        if on_step is not None:
            on_step(step, model, loss_value)
    model.to(torch.bfloat16)
    for module in model.modules():  # DeepSeek-V3's routing bias stays fp32 (transformers keeps it so too)
        if getattr(module, "e_score_correction_bias", None) is not None:
            module.e_score_correction_bias = module.e_score_correction_bias.float()
    model.save_pretrained(model_dir)
    return loss_value
