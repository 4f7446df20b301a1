"""`orbit demo-model` and `orbit demo-warmup`: the tiny demo models the examples train, built locally.

`demo-model` writes a fresh model (and optionally warms it up: the stand-in for pretraining);
`demo-warmup` trains one further, a later stage of a recipe such as the calculator demo's
(Makefile, demo-calculator).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from orbit_runtime.errors import OrbitError

console = Console(stderr=True, soft_wrap=True)


def register(app: typer.Typer, fail: Callable[[Exception], None]) -> None:
    @app.command("demo-model")
    def demo_model(
        out_dir: Annotated[Path, typer.Argument(help="Directory to write the tiny model and tokenizer to.")],
        seed: Annotated[int, typer.Option(help="Random seed of the weights.")] = 0,
        arch: Annotated[
            str, typer.Option(help="Architecture: qwen2 (dense), qwen3_moe, or deepseek_v3 (MLA + shared expert, small).")
        ] = "qwen2",
        warmup_steps: Annotated[
            int, typer.Option(help="Supervised warm-up steps standing in for pretraining (0: random weights).")
        ] = 0,
        warmup_tools: Annotated[
            bool, typer.Option(help="The warm-up also teaches the calculator tool-call format (for examples/calculator.yaml).")
        ] = False,
        warmup_tool_episodes: Annotated[
            int, typer.Option(help="Distinct calculator episodes in the tool warm-up (with --warmup-tools).")
        ] = 600,
        overwrite: Annotated[bool, typer.Option(help="Replace OUT_DIR if it is not empty.")] = False,
    ) -> None:
        """Write a tiny model (dense Qwen2 or an MoE) with a local character-level tokenizer (no network)."""
        from orbit_runtime.demo_model import write_demo_model

        try:
            path = write_demo_model(out_dir, seed=seed, arch=arch, overwrite=overwrite)
        except OrbitError as exc:
            fail(exc)
        if warmup_steps:
            from orbit_runtime.demo_warmup import warm_up

            loss = warm_up(path, steps=warmup_steps, seed=seed, tools=warmup_tools, tool_episodes=warmup_tool_episodes)
            what = "the answer and tool-call formats" if warmup_tools else "the answer format"
            console.print(f"warm-up: {warmup_steps} supervised steps on {what} (other questions), final loss {loss:.3f}")
        console.print(f"wrote demo model to {path}")
        typer.echo(str(path))

    @app.command("demo-warmup")
    def demo_warmup(
        model_dir: Annotated[Path, typer.Argument(help="A demo model directory (`orbit demo-model`), trained in place.")],
        steps: Annotated[int, typer.Option(help="Supervised steps (a fresh warm-up and decay of the learning rate).")],
        seed: Annotated[int, typer.Option(help="Seed of the corpus and the batches.")] = 0,
        lr: Annotated[float, typer.Option(help="Peak learning rate.")] = 3e-3,
        tools: Annotated[bool, typer.Option(help="Add calculator episodes (the tool-call format).")] = False,
        tool_episodes: Annotated[int, typer.Option(help="Distinct calculator episodes (with --tools).")] = 600,
        tool_share: Annotated[
            float, typer.Option(help="The share of calculator episodes that call the tool; the rest box the answer directly.")
        ] = 1.0,
    ) -> None:
        """Train a demo model further on the warm-up corpus: another stage of the calculator demo's recipe."""
        from orbit_runtime.demo_warmup import warm_up

        if not (model_dir / "config.json").is_file():
            fail(OrbitError(f"{model_dir}: no config.json here; build a demo model with `orbit demo-model` first"))
        for bad, message in ((steps < 1, f"--steps must be at least 1, not {steps}"), (lr <= 0, f"--lr must be positive, not {lr}"),
                             (tool_episodes < 1, f"--tool-episodes must be at least 1, not {tool_episodes}"),
                             (not 0.0 < tool_share <= 1.0, f"--tool-share must be in (0, 1], not {tool_share}")):  # fmt: skip
            if bad:
                fail(OrbitError(f"demo-warmup: {message}"))
        loss = warm_up(model_dir, steps=steps, seed=seed, lr=lr, tools=tools, tool_episodes=tool_episodes, tool_share=tool_share)
        console.print(f"warm-up: {steps} more supervised steps on {model_dir}, final loss {loss:.3f}")
