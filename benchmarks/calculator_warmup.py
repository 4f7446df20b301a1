"""Does the calculator demo's warm-up teach the model to copy the question into its tool call?

RL can only reinforce tool use that already pays sometimes: if the base writes the wrong
expression into `<tool_call>`, calling never earns a reward. This builds a demo model, runs the
tool warm-up (`orbit_runtime.demo_warmup.warm_up` with tools) and probes the model every
--probe-every steps with transformers' greedy generation:

- copy: the turn forced to open with `<tool_call>`, the share of calls whose expression equals
  the question's;
- at the end also the free choice (does greedy call the tool?) and whole-episode success (the
  real tool's answer fed back, then the box checked).

    python benchmarks/calculator_warmup.py --out /tmp/calc-base --steps 1600 --tool-episodes 20000 \\
        --json benchmarks/results/calculator_warmup/stage1.json

--continue trains an existing model directory further (a second stage) instead of a fresh one.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

from benchmark_output import emit_json

from orbit_runtime.demo_model import write_demo_model
from orbit_runtime.demo_warmup import tool_prompt, warm_up
from orbit_runtime.environments.calculator import calculator

CALL_EXPRESSION = re.compile(r'"expression": ?"([^"]*)"')


def questions(count: int, seed: int = 12345) -> list[str]:
    """Two-digit additions and subtractions, as examples/calculator.yaml asks them."""
    rng = random.Random(seed)
    return [f"{rng.randrange(10, 100)}{rng.choice('+-')}{rng.randrange(10, 100)}" for _ in range(count)]


class Probe:
    """Greedy generation on the model being trained (fp32, in place)."""

    def __init__(self, tokenizer, count: int) -> None:
        self.tokenizer, self.questions = tokenizer, questions(count)
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def _generate(self, model, text: str, max_new_tokens: int = 64) -> str:
        import torch

        ids = self.tokenizer.encode(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=self.end,
                                 pad_token_id=self.end)  # fmt: skip
        return self.tokenizer.decode(out[0, ids.shape[1] :]).removesuffix("<|im_end|>")

    def _episode(self, model, expression: str, forced: bool) -> tuple[bool, bool, bool]:
        """(called the tool, the call's expression right, the boxed answer right) for one question."""
        start = tool_prompt(expression) + ("<tool_call>" if forced else "")
        turn = ("<tool_call>" if forced else "") + self._generate(model, start)
        if "<tool_call>" not in turn:
            return False, False, turn.strip() == f"\\boxed{{{calculator(expression)}}}"
        match = CALL_EXPRESSION.search(turn)
        call = match.group(1) if match else None
        try:
            result = calculator(call) if call is not None else "error: no expression"
        except ValueError as error:
            result = f"error: {error}"
        answer = self._generate(model, f"{tool_prompt(expression)}{turn}<|im_end|>\n<|im_start|>tool\n{result}<|im_end|>\n"
                                       f"<|im_start|>assistant\n", 16)  # fmt: skip
        return True, call == expression, answer.strip() == f"\\boxed{{{calculator(expression)}}}"

    def copy_share(self, model) -> float:
        model.eval()
        right = sum(self._episode(model, e, forced=True)[1] for e in self.questions)
        model.train()
        return right / len(self.questions)

    def full(self, model) -> dict:
        model.eval()
        free = [self._episode(model, e, forced=False) for e in self.questions]
        forced = [self._episode(model, e, forced=True) for e in self.questions]
        model.train()
        n = len(self.questions)
        return {"free_tool_share": sum(f[0] for f in free) / n, "free_success": sum(f[2] for f in free) / n,
                "forced_call_right": sum(f[1] for f in forced) / n, "forced_success": sum(f[2] for f in forced) / n}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="The model directory (created, or with --continue trained further).")
    parser.add_argument("--continue", dest="resume", action="store_true", help="Train --out further instead of a fresh model.")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--tool-episodes", type=int, default=600, help="Distinct tool episodes (600: the shipped recipe).")
    parser.add_argument("--tool-share", type=float, default=1.0, help="The share of tool episodes that use the tool (the rest box the answer directly).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--probe-every", type=int, default=200)
    parser.add_argument("--probe-questions", type=int, default=32)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    if not args.resume:
        write_demo_model(args.out, seed=args.seed, overwrite=True)
    probe = Probe(AutoTokenizer.from_pretrained(args.out), args.probe_questions)
    curve: list[dict] = []
    final: dict = {}
    started = time.monotonic()

    def on_step(step: int, model, loss: float) -> None:
        if step % args.probe_every and step != args.steps:
            return
        row = {"step": step, "loss": round(loss, 4), "copy": probe.copy_share(model), "seconds": round(time.monotonic() - started)}
        curve.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        if step == args.steps:
            final.update(probe.full(model))

    loss = warm_up(args.out, steps=args.steps, seed=args.seed, lr=args.lr, tools=True, tool_episodes=args.tool_episodes,
                   tool_share=args.tool_share, on_step=on_step)  # fmt: skip
    emit_json({"command": " ".join(["python", *sys.argv]), "note": args.note,
               "warmup": {"steps": args.steps, "tool_episodes": args.tool_episodes,
                          "tool_share": args.tool_share, "seed": args.seed, "lr": args.lr,
                          "continued": args.resume, "final_loss": round(loss, 4)},
               "probe": f"transformers greedy generation on the fp32 model in training, {args.probe_questions} questions "
                        "(seeded 12345); copy = calls right when the turn is forced to open with <tool_call>",
               "curve": curve, "final": final}, args.json)  # fmt: skip


if __name__ == "__main__":
    main()
