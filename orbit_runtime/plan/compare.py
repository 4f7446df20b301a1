"""`orbit plan --compare runs/<name>`: the learner's planned memory against what the run measured.

A run records its job spec (`job.json`) and, in every step row of `metrics.jsonl`, the
learner process's peaks (`peak_rss_bytes`, on CUDA `cuda_peak_allocated_bytes`) and where
the step started (`rss_at_step_start_bytes`, `cuda_allocated_at_step_start_bytes`). What a
step adds is compared with the plan's step rows: gradients, activations, logits, the step
snapshot, and on a fresh run's first step AdamW's moments, which are allocated then (see
planner.learner_step). On CUDA the peak allocated memory is also compared with the whole
planned learner (base, adapter state, activations, logits): CUDA allocations are tensors
only, nothing of the runtime.
"""

from __future__ import annotations

import json
from pathlib import Path

from orbit_runtime.errors import OrbitError
from orbit_runtime.plan.architecture import read_architecture
from orbit_runtime.plan.hardware import GIB
from orbit_runtime.plan.planner import learner_step
from orbit_runtime.plan.request import from_job_spec
from orbit_runtime.plan.roles import learner_rows
from orbit_runtime.plan.weights import base_weights, quantization_of


def _rows(run: Path) -> list[dict]:
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise OrbitError(f"{run}: no metrics.jsonl (not a run directory?)")
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if row.get("kind") == "step" and "rss_at_step_start_bytes" in row:
            rows.append(row)
    if not rows:
        raise OrbitError(f"{run}/metrics.jsonl: no step rows with step-start memory (a run of an older Orbit, or no step yet)")
    return rows


def compare_run(run: Path, model_config: Path | None = None) -> dict:
    """The comparison document (bytes); OrbitError if RUN is not a run directory with steps. MODEL_CONFIG:
    the base's config.json when the run's model path is not readable here (a pod's /base)."""
    from orbit_runtime.config.spec import JobSpec
    from orbit_runtime.run_paths import RunPaths

    run = Path(run)
    job = RunPaths(run).job_spec
    try:
        spec = JobSpec.model_validate_json(job.read_text())
    except FileNotFoundError:
        raise OrbitError(f"{run}: no {job.name} (a run of an older Orbit, or not a run directory)") from None
    except ValueError as exc:
        raise OrbitError(f"{job}: not a job spec ({exc})") from None
    arch = read_architecture(Path(model_config or spec.model.path))
    request = from_job_spec(spec)
    rows = _rows(run)
    first_plan, later_plan = learner_step(arch, request, first=True), learner_step(arch, request, first=False)
    first, later = first_plan.peak, later_plan.peak
    cuda = "cuda_peak_allocated_bytes" in rows[0]
    key, start = ("cuda_peak_allocated_bytes", "cuda_allocated_at_step_start_bytes") if cuda else ("peak_rss_bytes", "rss_at_step_start_bytes")
    measured = [{"step": r["step"], "peak_above_start_bytes": r[key] - r[start]} for r in rows]
    first_rows = [m for m in measured if m["step"] == 1]  # a fresh run's first step (a resumed life restores the moments)
    later_rows = [m for m in measured if m["step"] != 1]
    doc: dict = {
        "run": str(run), "device": "cuda" if cuda else "cpu", "model": str(spec.model.path), "steps": len(rows),
        "planned": {"first_step_bytes": first, "later_step_bytes": later, "first_step": first_plan.rows, "later_step": later_plan.rows},
        "measured": {"first_step_peak_above_start_bytes": max((m["peak_above_start_bytes"] for m in first_rows), default=None),
                     "later_step_peak_above_start_bytes": max((m["peak_above_start_bytes"] for m in later_rows), default=None)},
    }  # fmt: skip
    if first_rows:
        doc["ratio_first_step"] = round(doc["measured"]["first_step_peak_above_start_bytes"] / first, 3)
    if later_rows:
        doc["ratio_later_steps"] = round(doc["measured"]["later_step_peak_above_start_bytes"] / later, 3)
    if cuda:
        total = learner_rows(arch, base_weights(arch, quantization_of(arch, request)), request)
        planned_total = sum(v for k, v in total.items() if k != "runtime")
        measured_total = max(r["cuda_peak_allocated_bytes"] for r in rows)
        doc["planned"]["learner_total_bytes"] = planned_total
        doc["measured"]["cuda_peak_allocated_bytes"] = measured_total
        doc["ratio_learner_total"] = round(measured_total / planned_total, 3)
    return doc


def render_comparison(doc: dict, console) -> None:
    def gib(value) -> str:
        return "-" if value is None else f"{value / GIB:.3f} GiB"

    console.print(f"{doc['run']} ({doc['device']}, {doc['steps']} steps; base {doc['model']})")
    planned, measured = doc["planned"], doc["measured"]
    if "ratio_first_step" in doc:
        console.print(f"first step:  planned {gib(planned['first_step_bytes'])}, measured "
                      f"{gib(measured['first_step_peak_above_start_bytes'])} above the step's start "
                      f"(measured/planned {doc['ratio_first_step']})")  # fmt: skip
    if "ratio_later_steps" in doc:
        console.print(f"later steps: planned {gib(planned['later_step_bytes'])}, measured at most "
                      f"{gib(measured['later_step_peak_above_start_bytes'])} (measured/planned {doc['ratio_later_steps']})")  # fmt: skip
    if "ratio_learner_total" in doc:
        console.print(f"learner on its GPU: planned {gib(planned['learner_total_bytes'])}, peak allocated "
                      f"{gib(measured['cuda_peak_allocated_bytes'])} (measured/planned {doc['ratio_learner_total']})")  # fmt: skip
    console.print("planned first step: " + ", ".join(f"{k} {gib(v)}" for k, v in planned["first_step"].items()))
