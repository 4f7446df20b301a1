"""`orbit plan`: will a job fit one node, and how? (the arithmetic is orbit_runtime/plan).

    orbit plan deepseek-v3 --gpu H200 --gpus 8            a catalog model, a default job
    orbit plan path/to/config.json --prompts 8 --group 16  a model's config.json (or its directory)
    orbit plan examples/quickstart.yaml                    an `orbit train` config (its base's config.json)
    orbit plan rljob.yaml [--model-config config.json]     an RLTrainingJob: the layouts, and its own pod
    orbit plan --compare runs/quickstart                   the planned learner against what a run measured
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from orbit_runtime.errors import OrbitError

DTYPES = ("bf16", "fp16", "fp32")
DOES_NOT_FIT_EXIT = 3  # `orbit prepare-base --enforce-fit`: the operator fails the job (DoesNotFit) without retrying
TERMINATION_MESSAGE_BYTES = 4096  # what the kubelet keeps of a termination message


def _architecture(ref: str):
    """A catalog name, a config.json, or a model directory."""
    from orbit_runtime.plan.architecture import read_architecture
    from orbit_runtime.plan.catalog import catalog_architecture, names

    if not Path(ref).exists() and ref in names():
        return catalog_architecture(ref)
    return read_architecture(Path(ref))


def _job_source(path: Path):
    """(runtime JobSpec or None, RLTrainingJobSpec or None) of a YAML file; (None, None) for a model config."""
    from orbit_operator.validation import ManifestError, read_documents, validate_job
    from orbit_runtime.config import load_job_spec

    if path.is_dir() or path.suffix == ".json":
        return None, None
    try:
        documents = read_documents(path.read_bytes(), str(path))
    except (ManifestError, OSError) as exc:
        raise OrbitError(str(exc)) from None
    jobs = [d for d in documents if isinstance(d, dict) and d.get("kind") == "RLTrainingJob"]
    if not jobs:
        return load_job_spec(path), None
    if len(jobs) > 1:
        raise OrbitError(f"{path}: {len(jobs)} RLTrainingJobs; plan one file per job")
    check = validate_job(jobs[0], str(path))
    if not check.ok:
        raise OrbitError(f"{path}: invalid RLTrainingJob:\n  " + "\n  ".join(check.errors))
    return check.spec, check.spec


def register(app: typer.Typer, fail) -> None:
    """Add `orbit plan` to APP (FAIL prints one error line and exits 2)."""

    @app.command()
    def plan(
        source: Annotated[str | None, typer.Argument(help="A model's config.json (or directory), a catalog name (see --list), "
                                                     "an `orbit train` config, or an RLTrainingJob manifest.")] = None,
        model_config: Annotated[str | None, typer.Option(help="The model's config.json or catalog name, for a job (or a "
                                                         "--compare run) whose base is not readable here.")] = None,
        gpu: Annotated[str | None, typer.Option(help="GPU model: H100, H200, B200, MI300X, or cpu. Default: the job's "
                                                "nodeSelector product, else H200.")] = None,
        gpus: Annotated[int, typer.Option(help="GPUs in the node.", min=1)] = 8,
        gpu_memory_gib: Annotated[float | None, typer.Option(help="One GPU's total memory, instead of --gpu.")] = None,
        host_memory_gib: Annotated[float | None, typer.Option(help="The machine's memory (needed with --gpu cpu).")] = None,
        prompts: Annotated[int | None, typer.Option(help="Prompts a step (rollout.prompts_per_step).", min=1)] = None,
        group: Annotated[int | None, typer.Option(help="Completions a prompt (rollout.group_size).", min=1)] = None,
        prompt_tokens: Annotated[int | None, typer.Option(help="Longest prompt (default: max_model_len - max_tokens).", min=1)] = None,
        completion_tokens: Annotated[int | None, typer.Option(help="Completion length (rollout.max_tokens).", min=1)] = None,
        micro_batch_tokens: Annotated[int | None, typer.Option(help="learner.micro_batch_tokens.", min=1)] = None,
        rank: Annotated[int | None, typer.Option(help="LoRA rank.", min=1)] = None,
        routed_experts: Annotated[bool | None, typer.Option(help="LoRA on routed experts too.")] = None,
        gradient_checkpointing: Annotated[bool | None, typer.Option(help="learner.gradient_checkpointing.")] = None,
        learner_dtype: Annotated[str | None, typer.Option(help="bf16, fp16 or fp32.")] = None,
        reference: Annotated[str | None, typer.Option(help="Reference mode: shared or server.")] = None,
        group_size: Annotated[int | None, typer.Option(help="INT4 group size (when the config has no INT4 quantization_config).")] = None,
        ignore: Annotated[list[str] | None, typer.Option(help="A module kept 16-bit (as orbit quantize --ignore; replaces its defaults). Repeatable.")] = None,
        sharded_learner: Annotated[bool, typer.Option(help="Plan the learner sharded over its GPUs (as DESIGN.md plans; "
                                                      "today's learner uses one device).")] = False,
        compare: Annotated[Path | None, typer.Option(help="A run directory: set the learner's planned memory against what it measured.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON (keys: docs/plan.md).")] = False,
        list_models: Annotated[bool, typer.Option("--list", help="List the catalog's models.")] = False,
    ) -> None:
        """Plan a job's memory on one node: per GPU, for separate copies, one shared copy, and full fine-tuning."""
        from rich.console import Console

        from orbit_runtime.plan.catalog import names

        if list_models:
            typer.echo("\n".join(names()))
            return
        if compare is not None:
            from orbit_runtime.plan.compare import compare_run, render_comparison

            try:
                result = compare_run(compare, Path(model_config) if model_config else None)
            except OrbitError as exc:
                fail(exc)
            typer.echo(json.dumps(result, indent=2)) if as_json else render_comparison(result, Console())
            return
        if source is None:
            fail(OrbitError("name a model config, catalog model or job file (or --compare RUN_DIR); see orbit plan --help"))
        changes = {k: v for k, v in dict(prompts=prompts, group=group, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                           micro_batch_tokens=micro_batch_tokens, rank=rank, routed_experts=routed_experts,
                                           gradient_checkpointing=gradient_checkpointing, learner_dtype=learner_dtype,
                                           reference_mode=reference, group_size=group_size,
                                           ignore=tuple(ignore) if ignore else None).items() if v is not None}  # fmt: skip
        try:
            doc, printed = _plan(source, model_config, gpu, gpus, gpu_memory_gib, host_memory_gib, changes, sharded_learner, as_json)
        except (OrbitError, ValueError) as exc:
            fail(exc)
        if as_json:
            typer.echo(json.dumps(doc, indent=2))
        else:
            printed(Console(soft_wrap=True))


def _plan(source: str, model_config: str | None, gpu: str | None, gpus: int, gpu_memory_gib: float | None,
          host_memory_gib: float | None, changes: dict, sharded: bool, as_json: bool):  # fmt: skip
    """(the JSON document, a function printing the human report)."""
    from orbit_runtime.config.spec import JobSpec
    from orbit_runtime.plan.hardware import GIB, gpu_from_node_selector
    from orbit_runtime.plan.job_fit import fit_job
    from orbit_runtime.plan.planner import make_plan
    from orbit_runtime.plan.report import plan_json, render
    from orbit_runtime.plan.request import NodeSpec, from_job_spec

    path = Path(source)
    runtime, cluster = _job_source(path) if path.is_file() else (None, None)
    if model_config is not None:
        arch = _architecture(model_config)
    elif cluster is not None:
        from orbit_operator.fit import job_architecture

        arch = job_architecture(cluster)
        if arch is None:
            raise OrbitError(f"{source}: the RLTrainingJob names no model; pass --model-config (its config.json or a catalog "
                             "name), or set spec.base.architecture")  # fmt: skip
    elif runtime is not None:
        arch = _architecture(runtime.model.path)
    else:
        arch = _architecture(source)
    spec = runtime or JobSpec.model_validate({"model": {"path": "-"}})
    if changes.get("learner_dtype") not in (None, *DTYPES) or changes.get("reference_mode") not in (None, "shared", "server"):
        raise OrbitError("--learner-dtype is bf16, fp16 or fp32; --reference is shared or server")
    if gpu is None and gpu_memory_gib is None and cluster is not None:
        found = gpu_from_node_selector(cluster.nodeSelector)
        gpu = found.name if found else None
    cpu = gpu is not None and gpu.lower() == "cpu"
    if cpu and not host_memory_gib:
        raise OrbitError("--gpu cpu: give the machine's memory with --host-memory-gib")
    node = NodeSpec(gpus=0 if cpu else gpus, gpu=None if cpu or gpu_memory_gib else (gpu or "H200"),
                    gpu_memory_bytes=int(gpu_memory_gib * GIB) if gpu_memory_gib else None,
                    host_memory_bytes=int(host_memory_gib * GIB) if host_memory_gib else None)  # fmt: skip
    if cluster is not None and "group_size" not in changes:
        changes["group_size"] = cluster.base.groupSize
    request = from_job_spec(spec, node=node, learner_sharded=sharded, **changes)
    plan = make_plan(arch, request)
    doc = plan_json(plan)
    job_fit = None
    if cluster is not None:
        from orbit_operator.fit import plan_request
        from orbit_operator.settings import OperatorSettings

        pod = plan_request(cluster, OperatorSettings(max_gpus_per_node=max(gpus, 1)))
        job_fit = fit_job(arch, request.model_copy(update={"roles": pod.roles}))
        doc["job_fit"] = {"fits": job_fit.fits, "summary": job_fit.summary(), "message": job_fit.message()}

    def printed(console) -> None:
        render(plan, console)
        if job_fit is not None:
            console.print(f"[bold]this job's pod[/] ({source}): {job_fit.summary()}")
            if not job_fit.fits:
                console.print(f"  {job_fit.message()}")

    return doc, printed


def check_pod_fit(plan_file: Path, cache: Path, source: str | None, console) -> dict | None:
    """prepare-base's plan of its pod: {"fits", "summary", "message"} from the operator's plan request
    and the base's config.json; None (with a warning) when it cannot be planned: the planner then
    never stops a job (a model it does not know, a ConfigMap from an older operator)."""
    from orbit_runtime.base_cache import base_model_config
    from orbit_runtime.plan.architecture import parse_architecture
    from orbit_runtime.plan.job_fit import fit_job
    from orbit_runtime.plan.request import PlanRequest

    try:
        request = PlanRequest.model_validate_json(Path(plan_file).read_text())
        arch = parse_architecture(base_model_config(cache, source), f"{source or cache}/config.json")
        fit = fit_job(arch, request)
    except (OrbitError, OSError, ValueError) as exc:
        console.print(f"[yellow]warning:[/] the job was not planned: {exc}")
        return None
    console.print(f"plan: {fit.summary()}")
    return {"fits": fit.fits, "summary": fit.summary(), "message": fit.message()}


def write_termination_log(path: Path | None, document: dict) -> None:
    """DOCUMENT as JSON at PATH (the kubelet's termination message), its strings cut to fit 4 KiB."""
    if path is None:
        return
    text = json.dumps(document)
    while len(text.encode()) > TERMINATION_MESSAGE_BYTES:
        longest = max((k for k, v in document.items() if isinstance(v, str)), key=lambda k: len(document[k]))
        document = {**document, longest: document[longest][: len(document[longest]) // 2] + "..."}
        text = json.dumps(document)
    try:
        Path(path).write_text(text)
    except OSError:
        pass  # outside a pod (no /dev/termination-log): the verdict is on stderr too


def admission_check(spec, model_config: str | None, gpu: str | None, gpu_memory_gib: float | None, max_gpus: int):
    """The operator's admission plan of an RLTrainingJob (`orbit validate`): its JobFit, or None when
    neither --model-config nor the job names the model."""
    from orbit_operator.fit import job_architecture, plan_request
    from orbit_operator.settings import OperatorSettings
    from orbit_runtime.plan.hardware import gpu_model
    from orbit_runtime.plan.job_fit import fit_job

    arch = _architecture(model_config) if model_config is not None else job_architecture(spec)
    if arch is None:
        return None
    if gpu is not None:
        try:
            gpu_model(gpu)
        except OrbitError as exc:
            raise OrbitError(f"--gpu: {exc}") from None
    settings = OperatorSettings(max_gpus_per_node=max_gpus, node_gpu=gpu, node_gpu_memory_gib=gpu_memory_gib)
    return fit_job(arch, plan_request(spec, settings))

