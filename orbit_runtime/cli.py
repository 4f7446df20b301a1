"""The `orbit` command line. Arguments are parsed first; torch and friends load only when a
command runs, so `orbit --help` is instant."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from orbit_runtime.code_reward_command import register as register_code_reward_command
from orbit_runtime.demo_commands import register as register_demo_commands
from orbit_runtime.errors import OrbitError
from orbit_runtime.plan_command import DOES_NOT_FIT_EXIT, admission_check, check_pod_fit, write_termination_log
from orbit_runtime.plan_command import register as register_plan_command
from orbit_runtime.role_commands import register as register_role_commands

app = typer.Typer(
    help="Orbit: RL post-training on one frozen INT4 base shared by vLLM and the learner.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True, soft_wrap=True)  # an error stays one line, whatever the terminal width


def _fail(exc: Exception) -> None:
    from orbit_runtime.redaction import redact

    console.print(f"[bold red]error:[/] {redact(str(exc))}", markup=True, highlight=False)
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


def _configure_logging() -> None:
    """Warnings and progress lines from the runtime on stderr, with credentials redacted."""
    import logging

    from rich.logging import RichHandler

    from orbit_runtime.redaction import RedactingFilter

    handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
    handler.addFilter(RedactingFilter())
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[handler], force=True)
    for noisy in ("httpx", "httpcore", "botocore", "boto3", "s3transfer", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="Job spec YAML (see examples/quickstart.yaml).")],
    max_steps: Annotated[int | None, typer.Option(help="Stop after N steps (overrides schedule.steps).", min=1)] = None,
    output_dir: Annotated[Path | None, typer.Option(help="Override run.output_dir.")] = None,
    checkpoint_uri: Annotated[
        str | None, typer.Option(help="Override checkpoint.uri (s3://bucket/prefix or file:///path).")
    ] = None,
    checkpoint_every: Annotated[int | None, typer.Option(help="Override checkpoint.every_steps.", min=1)] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus /metrics and /healthz on this port (0: any free port).", min=0)
    ] = None,
    resume: Annotated[
        bool, typer.Option(help="Require resuming from the newest checkpoint (runs resume automatically when one exists).")
    ] = False,
    resume_from: Annotated[
        str | None, typer.Option(help="Resume from this checkpoint (URI ending in /step-NNNNNNNN), even under a changed config.")
    ] = None,
) -> None:
    """Run GRPO locally: starts vLLM (and the reference server) as child processes, trains the LoRA adapter."""
    from orbit_runtime.config import load_job_spec, parse_job_spec

    try:
        spec = load_job_spec(config)
        overrides = spec.model_dump()
        if output_dir is not None:
            overrides["run"]["output_dir"] = str(output_dir.resolve())
        if checkpoint_uri is not None:
            overrides["checkpoint"]["uri"] = checkpoint_uri
        if checkpoint_every is not None:
            overrides["checkpoint"]["every_steps"] = checkpoint_every
        if metrics_port is not None:
            overrides["metrics"]["port"] = metrics_port
        spec = parse_job_spec(overrides, f"{config} (with command-line overrides)")
    except OrbitError as exc:
        _fail(exc)
    _configure_logging()
    from orbit_runtime.sync.adapter_sync import SyncError
    from orbit_runtime.trainer.loop import Trainer
    from orbit_runtime.trainer.roles import RoleDied

    try:
        trainer = Trainer(spec, console=console, resume=resume, resume_from=resume_from)
        summary = trainer.run(max_steps=max_steps)
    except (OrbitError, SyncError, RoleDied) as exc:  # once the loop ran, its last consistent state was checkpointed
        _fail(exc)
    except OSError as exc:  # a full disk, a permission: say what, keep the traceback for a bug report
        import logging

        logging.getLogger("orbit").error("the run stopped on an OS error", exc_info=True)
        _fail(OrbitError(f"{type(exc).__name__}: {exc}"))
    except KeyboardInterrupt as stop:
        signum = stop.args[0] if stop.args and isinstance(stop.args[0], int) else 2
        raise typer.Exit(code=128 + signum) from None
    before, after = summary.get("heldout_accuracy_before"), summary.get("heldout_accuracy_after")
    if before is not None and after is not None:
        console.print(
            f"held-out accuracy: {before:.1%} ± {summary.get('heldout_accuracy_before_stderr') or 0:.1%} before -> "
            f"{after:.1%} ± {summary.get('heldout_accuracy_after_stderr') or 0:.1%} after "
            f"({summary.get('heldout_prompts')} prompts) "
            f"{summary['steps']} steps in {summary['wall_seconds']:.0f}s; report {trainer.paths.report}"
        )
    typer.echo(json.dumps(summary))


checkpoints_app = typer.Typer(help="Inspect and export checkpoints (s3://bucket/prefix or file:///path).", no_args_is_help=True)
app.add_typer(checkpoints_app, name="checkpoints")


def _catalog(uri: str):
    from orbit_runtime.checkpoint.catalog import CheckpointCatalog
    from orbit_runtime.checkpoint.storage import open_store

    return CheckpointCatalog(open_store(uri))


@checkpoints_app.command("list")
def checkpoints_list(
    uri: Annotated[str, typer.Argument(help="Checkpoint prefix, as in checkpoint.uri.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
) -> None:
    """List the checkpoints under URI, complete or torn (a torn one has no valid manifest and is never used)."""
    from orbit_runtime.checkpoint.storage import StorageError

    try:
        entries = _catalog(uri).entries()
    except (OrbitError, StorageError) as exc:
        _fail(exc)
    if as_json:
        typer.echo(json.dumps([e.to_json() for e in entries], indent=2))
        return
    from rich.table import Table

    table = Table("step", "complete", "adapter", "score", "MB", "uri")
    for e in entries:
        row = e.to_json()
        score = "" if row["score"] is None else f"{row['score']:.3f}"
        table.add_row(str(e.step), "yes" if e.complete else "TORN", str(row["adapter_version"] or ""), score,
                      f"{row['bytes'] / 1e6:.2f}", e.uri)  # fmt: skip
    Console().print(table)


@checkpoints_app.command("export")
def checkpoints_export(
    uri: Annotated[str, typer.Argument(help="Checkpoint prefix, as in checkpoint.uri.")],
    step: Annotated[int, typer.Argument(help="Step of a complete checkpoint (see `orbit checkpoints list`).")],
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the PEFT adapter to.")],
) -> None:
    """Write checkpoint STEP's adapter (verified against its manifest) to OUT_DIR, ready for `vllm --lora-modules`."""
    from orbit_runtime.atomic_dir import atomic_directory
    from orbit_runtime.checkpoint.storage import StorageError
    from orbit_runtime.trainer.checkpointing import ADAPTER

    if out_dir.exists() and any(out_dir.iterdir()):
        _fail(OrbitError(f"{out_dir}: exists and is not empty"))
    try:
        catalog = _catalog(uri)
        entry = catalog.get(step)
        with atomic_directory(out_dir) as staging:
            catalog.download(entry, staging, only=ADAPTER + "/")
    except (OrbitError, StorageError) as exc:
        _fail(exc)
    console.print(f"exported the adapter of {entry.uri} (adapter version {entry.manifest.get('adapter_version')})")
    typer.echo(str(out_dir))


@app.command()
def validate(
    file: Annotated[Path, typer.Argument(help="An `orbit train` config, or RLTrainingJob manifest(s) (multi-document YAML).")],
    max_gpus_per_node: Annotated[int, typer.Option(help="GPUs per node in your cluster (the operator's ORBIT_MAX_GPUS_PER_NODE).")] = 8,
    allow_image_override: Annotated[bool, typer.Option(help="The operator allows per-role images (ORBIT_ALLOW_IMAGE_OVERRIDE).")] = False,
    model_config: Annotated[str | None, typer.Option(help="The base's config.json (or a catalog name): also check that each "
                                                     "job fits its node (default: what the job's base.architecture names).")] = None,
    gpu: Annotated[str | None, typer.Option(help="Your nodes' GPU (the operator's ORBIT_NODE_GPU), for jobs whose "
                                            "nodeSelector names none.")] = None,
    gpu_memory_gib: Annotated[float | None, typer.Option(help="One GPU's memory instead (ORBIT_NODE_GPU_MEMORY_GIB).")] = None,
) -> None:
    """Validate FILE: a plain job config exactly as `orbit train` reads it, or every RLTrainingJob
    in it exactly as the operator would (including its fit, when the job or --model-config names the
    model). Exit 0 if valid, 1 with one line per problem otherwise."""
    from orbit_operator.validation import ManifestError, read_documents, validate_job
    from orbit_runtime.config import load_job_spec

    try:
        data = file.read_bytes()
    except OSError as exc:
        console.print(f"[bold red]error:[/] {file}: {exc.strerror or exc}")
        raise typer.Exit(code=1) from None
    try:
        documents = read_documents(data, str(file))
    except ManifestError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(code=1) from None
    if not documents:
        console.print(f"[bold red]error:[/] {file}: no YAML document")
        raise typer.Exit(code=1)
    if len(documents) == 1 and isinstance(documents[0], dict) and "kind" not in documents[0] and "apiVersion" not in documents[0]:
        try:  # a plain runtime config
            load_job_spec(file)
        except OrbitError as exc:
            console.print(f"[bold red]error:[/] {exc}")
            raise typer.Exit(code=1) from None
        console.print(f"{file}: valid job config")
        return
    failed = False
    for index, document in enumerate(documents, start=1):
        check = validate_job(document, f"{file}: document {index}", max_gpus_per_node, allow_image_override)
        label = f"{file}: document {index} (RLTrainingJob {check.name or '?'})"
        if check.ok:
            try:
                fit = admission_check(check.spec, model_config, gpu, gpu_memory_gib, max_gpus_per_node)
            except OrbitError as exc:
                check.errors.append(f"plan: {exc}")
                fit = None
            if fit is not None and not fit.fits:
                check.errors.append(f"DoesNotFit: {fit.message()}")
        if check.ok:
            console.print(f"{label}: valid" + (f"; {fit.summary()}" if fit is not None else ""))
            continue
        failed = True
        console.print(f"[bold red]error:[/] {label}: invalid")
        for error in check.errors:
            typer.echo(f"  {error}", err=True)  # one unwrapped line per problem
    if failed:
        raise typer.Exit(code=1)


@app.command("prepare-base")
def prepare_base_command(
    cache: Annotated[Path, typer.Option(help="This base's directory in the node cache (the pod mounts only it).")],
    format: Annotated[str, typer.Option("--format", help="hf: quantize a Hugging Face checkpoint; int4: copy an INT4 base.")] = "hf",
    source: Annotated[str | None, typer.Option(help="Source directory or s3:// prefix (none: the base must be there).")] = None,
    group_size: Annotated[int, typer.Option(help="INT4 scale group size (format hf).")] = 128,
    plan: Annotated[Path | None, typer.Option(help="The job's plan request (plan.json from the operator): plan the pod "
                                              "with the base's config.json before preparing it.")] = None,
    enforce_fit: Annotated[bool, typer.Option(help=f"Fail (exit {DOES_NOT_FIT_EXIT}, DoesNotFit) when the plan says the pod "
                                              "cannot fit (the job's first start).")] = False,
    termination_log: Annotated[Path | None, typer.Option(help="Write the plan's verdict here as JSON (the pod's "
                                                         "terminationMessagePath).")] = None,
    base_id: Annotated[Path | None, typer.Option(help="Write the prepared base's digest here (the pod's base-id volume: "
                                                 "its roles refuse to start on another base).")] = None,
) -> None:
    """Put the INT4 base into the node cache once: verify it if it is there, else quantize or copy it
    (atomic, under a lock shared by every pod on the node). The pod's init container."""
    from orbit_runtime.base_cache import prepare_base

    if format not in ("hf", "int4"):
        console.print(f"[bold red]error:[/] --format must be hf or int4, got {format!r}")
        raise typer.Exit(code=1)
    report = check_pod_fit(plan, cache, source, console) if plan is not None else None
    if report is not None and not report["fits"] and enforce_fit:
        write_termination_log(termination_log, {"reason": "DoesNotFit", "message": report["message"], "plan": report["summary"]})
        console.print(f"[bold red]error:[/] DoesNotFit: {report['message']}")
        raise typer.Exit(code=DOES_NOT_FIT_EXIT)
    try:
        result = prepare_base(cache, format, source, group_size)  # type: ignore[arg-type]
    except OrbitError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(code=1) from None
    verb = {"verified": "reused (verified)", "quantized": "quantized", "copied": "copied and verified"}[result.action]
    console.print(f"base {verb} ({result.reason}) in {result.seconds:.1f}s (waited {result.waited_for_lock_s:.1f}s for the lock): "
                  f"digest {result.digest}")  # fmt: skip
    base = f"{result.action} ({result.reason}): {result.digest}"  # e.g. "quantized (source changed: ...): sha256:..."
    if base_id is not None:
        from orbit_runtime.base_lease import write_base_id

        write_base_id(base_id, result.digest)
    write_termination_log(termination_log, {**({"plan": report["summary"]} if report is not None else {}), "base": base})
    typer.echo(result.path)


@app.command("cache-cleanup")
def cache_cleanup_command(
    root: Annotated[Path, typer.Option(help="The node cache root (the pod mounts all of it).")],
    max_bytes: Annotated[int, typer.Option(help="Evict least recently used bases until the cache is at most this size.")],
    keep: Annotated[str | None, typer.Option(help="This pod's base directory (relative to --root): never evicted.")] = None,
    min_idle_seconds: Annotated[float, typer.Option(help="Never evict a base a pod started on more recently than this.")] = 6 * 3600,
    termination_log: Annotated[Path | None, typer.Option(help="Write the result here as JSON (the pod's terminationMessagePath).")] = None,
) -> None:  # fmt: skip
    """Keep the node's base cache under --max-bytes: remove replaced bases, then the least recently used
    ones, never a base in use, being prepared, kept, or an administrator's. The pod's first init container."""
    from orbit_runtime.cache_cleanup import cleanup

    try:
        result = cleanup(root, max_bytes, keep, min_idle_seconds)
    except Exception as exc:  # best effort: a cleanup that cannot run (or a bug in it) never fails the job's pod
        if not isinstance(exc, OrbitError):
            import traceback

            traceback.print_exc()  # to the container's log: a bug is seen, the pod still starts
        why = str(exc) if isinstance(exc, OrbitError) else f"{type(exc).__name__}: {exc}"
        console.print(f"[bold yellow]warning:[/] cache-cleanup did nothing: {why}", markup=True, highlight=False)
        write_termination_log(termination_log, {"cleanup": f"did nothing: {why}"})
        return
    console.print(result.summary())
    write_termination_log(termination_log, {"cleanup": result.summary(), "freedBytes": result.freed_bytes,
                                            "evicted": len(result.evicted), "remainingBytes": result.remaining_bytes})  # fmt: skip


@app.command()
def crd(
    out: Annotated[Path | None, typer.Option(help="Write here instead of stdout.")] = None,
) -> None:
    """Print (or write) the RLTrainingJob CRD generated from the job spec's pydantic models."""
    from orbit_operator.crd import crd_yaml

    text = crd_yaml()
    if out is None:
        typer.echo(text, nl=False)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    console.print(f"wrote {out}")


register_role_commands(app, _fail, _configure_logging)
register_plan_command(app, _fail)
register_code_reward_command(app, _fail)
register_demo_commands(app, _fail)

if __name__ == "__main__":
    app()
