"""Which changes a running job cannot take: every spec field but the lifecycle ones (and the
planner-only ones), compared between the applied spec (the job's ConfigMap) and the current one."""

from __future__ import annotations

from orbit_operator.job_spec import RLTrainingJobSpec
from orbit_operator.observe import LIFECYCLE_FIELDS
from orbit_runtime.config.fingerprint import describe_differences


def _flat(data: dict, prefix: str = "") -> dict:
    out: dict = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(_flat(value, name))
        else:
            out[name] = value
    return out


PLANNER_ONLY_FIELDS = ("base.architecture", "base.modelConfig")  # read by the admission plan only: the pod never changes


def _spec_fields(spec: RLTrainingJobSpec) -> dict:
    fields = _flat({k: v for k, v in spec.model_dump(mode="json").items() if k not in LIFECYCLE_FIELDS})
    return {k: v for k, v in fields.items() if not k.startswith(PLANNER_ONLY_FIELDS)}


def refused_changes(applied: RLTrainingJobSpec | None, spec: RLTrainingJobSpec) -> list[str]:
    """Fields (other than the lifecycle ones) whose value differs between the applied spec and the current one."""
    if applied is None:
        return []
    return describe_differences(_spec_fields(applied), _spec_fields(spec), labels=("running", "spec"))
