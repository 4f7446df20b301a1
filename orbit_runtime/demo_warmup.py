"""A brief supervised warm-up of the demo model, standing in for pretraining.

Real RL starts from a pretrained model that already holds the skills RL elicits. The demo
model starts random, so it first learns, as plain text (full-parameter SFT of the 16-bit
model, before quantization):
  * arithmetic facts as raw text, "3+4=7" (the "pretraining corpus"), and
  * the chat answer format on OTHER problems: "What is 37?" -> "\\boxed{37}".
It never sees an addition question in chat form, so it does not answer "What is 3+4?" with
"\\boxed{7}" (it tends to copy a number); RL on the INT4 base + LoRA is what connects the two.
"""

from __future__ import annotations

import random
from pathlib import Path

from orbit_runtime.demo_model import CHAT_TEMPLATE  # noqa: F401  (documents the format used below)


def warmup_corpus(seed: int, max_value: int = 9) -> list[tuple[str, str]]:
    """(prompt, completion) text pairs; the loss is on the completion only."""
    rng = random.Random(seed)
    pairs: list[tuple[str, str]] = []
    for a in range(max_value + 1):
        for b in range(max_value + 1):
            pairs.append((f"{a}+{b}=", f"{a + b}\n"))
    for n in range(100):
        prompt = f"<|im_start|>user\nWhat is {n}?<|im_end|>\n<|im_start|>assistant\n"
        pairs.append((prompt, f"\\boxed{{{n}}}<|im_end|>"))
    rng.shuffle(pairs)
    return pairs


def warm_up(model_dir: Path, steps: int = 300, seed: int = 0, lr: float = 3e-3, batch: int = 32) -> float:
    """Train MODEL_DIR in place on `warmup_corpus`; returns the final loss."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    encoded = []
    for prompt, completion in warmup_corpus(seed):
        p = tokenizer.encode(prompt, add_special_tokens=False)
        c = tokenizer.encode(completion, add_special_tokens=False)
        encoded.append((p, c))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    rng = random.Random(seed)
    loss_value = float("nan")
    for _ in range(steps):
        rows = [encoded[rng.randrange(len(encoded))] for _ in range(batch)]
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        labels = torch.full((batch, width), -100)
        for i, (p, c) in enumerate(rows):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        loss_value = float(loss.detach())
    model.to(torch.bfloat16).save_pretrained(model_dir)
    return loss_value
