"""The `orbit` command line. Arguments are parsed first; torch and friends load only when a
command runs, so `orbit --help` is instant."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from orbit_runtime.errors import OrbitError

app = typer.Typer(
    help="Orbit: RL post-training on one frozen INT4 base shared by vLLM and the learner.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)


def _fail(exc: OrbitError) -> None:
    console.print(f"[bold red]error:[/] {exc}")
    raise typer.Exit(code=2)


@app.command()
def quantize(
    src: Annotated[Path, typer.Argument(help="Hugging Face checkpoint directory (config.json + safetensors).")],
    dst: Annotated[Path, typer.Argument(help="Output directory for the INT4 checkpoint.")],
    group_size: Annotated[int, typer.Option(help="Columns per INT4 scale group.")] = 128,
    ignore: Annotated[
        list[str] | None,
        typer.Option(help="Module to keep in 16 bit: exact name, last name components, or re:REGEX. Repeatable."),
    ] = None,
    scheme: Annotated[str, typer.Option(help="4-bit weight scheme.")] = "w4a16",
    overwrite: Annotated[bool, typer.Option(help="Replace DST if it exists.")] = False,
) -> None:
    """Quantize SRC to a compressed-tensors W4A16 pack-quantized checkpoint at DST (shard by shard)."""
    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import make_scheme

    try:
        report = quantize_checkpoint(
            src, dst, make_scheme(scheme, group_size), extra_ignore=tuple(ignore or ()), overwrite=overwrite
        )
    except OrbitError as exc:
        _fail(exc)
    console.print(
        f"quantized {report.quantized_modules} linear layers, kept {report.kept_tensors} tensors in 16 bit "
        f"(ignored modules: {', '.join(report.ignored_modules) or 'none'}); "
        f"{report.source_bytes / 2**20:.1f} MiB -> {report.output_bytes / 2**20:.1f} MiB in {report.seconds:.1f}s"
    )
    typer.echo(str(dst))


@app.command("demo-model")
def demo_model(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the tiny model and tokenizer to.")],
    seed: Annotated[int, typer.Option(help="Random seed of the weights.")] = 0,
    warmup_steps: Annotated[
        int, typer.Option(help="Supervised warm-up steps standing in for pretraining (0: random weights).")
    ] = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace OUT_DIR if it is not empty.")] = False,
) -> None:
    """Write a tiny Qwen2-architecture model with a local character-level tokenizer (no network)."""
    from orbit_runtime.demo_model import write_demo_model

    try:
        path = write_demo_model(out_dir, seed=seed, overwrite=overwrite)
    except OrbitError as exc:
        _fail(exc)
    if warmup_steps:
        from orbit_runtime.demo_warmup import warm_up

        loss = warm_up(path, steps=warmup_steps, seed=seed)
        console.print(f"warm-up: {warmup_steps} supervised steps on the answer format (other questions), final loss {loss:.3f}")
    console.print(f"wrote demo model to {path}")
    typer.echo(str(path))


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="Job spec YAML (see examples/quickstart.yaml).")],
    max_steps: Annotated[int | None, typer.Option(help="Stop after N steps (overrides schedule.steps).")] = None,
    output_dir: Annotated[Path | None, typer.Option(help="Override run.output_dir.")] = None,
) -> None:
    """Run GRPO locally: starts vLLM (and the reference server) as child processes, trains the LoRA adapter."""
    from orbit_runtime.config import load_job_spec

    try:
        spec = load_job_spec(config)
    except OrbitError as exc:
        _fail(exc)
    if output_dir is not None:
        spec = spec.model_copy(update={"run": spec.run.model_copy(update={"output_dir": str(output_dir)})})
    from orbit_runtime.trainer.loop import Trainer

    try:
        trainer = Trainer(spec, console=console)
        summary = trainer.run(max_steps=max_steps)
    except OrbitError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        raise typer.Exit(code=130) from None
    console.print(
        f"held-out accuracy: {summary['heldout_accuracy_before']:.1%} before -> {summary['heldout_accuracy_after']:.1%} after "
        f"{summary['steps']} steps in {summary['wall_seconds']:.0f}s; report {trainer.paths.report}"
    )
    typer.echo(json.dumps(summary))


@app.command()
def validate(config: Annotated[Path, typer.Argument(help="Job spec YAML.")]) -> None:
    """Validate a job spec file, exactly as `orbit train` reads it."""
    from orbit_runtime.config import load_job_spec

    try:
        load_job_spec(config)
    except OrbitError as exc:
        _fail(exc)
    console.print(f"{config}: valid")


if __name__ == "__main__":
    app()
