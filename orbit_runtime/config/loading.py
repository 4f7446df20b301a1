"""Reading a job spec: YAML or a CR's dict into a validated JobSpec, errors naming each field,
relative paths resolved against the config file's folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from orbit_runtime.config.prompt_data import FileData
from orbit_runtime.config.spec import JobSpec
from orbit_runtime.errors import OrbitError


def format_validation_error(error: ValidationError, source: str) -> str:
    """One line per problem, each naming the field by its dotted path."""
    lines = [f"{source}: invalid job spec"]
    for item in error.errors():
        loc = item["loc"]  # pydantic puts the data type's tag after "data": data.<tag>.field
        path = ".".join(str(p) for i, p in enumerate(loc) if not (i == 1 and loc[0] == "data" and isinstance(p, str)))
        lines.append(f"  {path or '(top level)'}: {item['msg']}")
    return "\n".join(lines)


def parse_job_spec(data: Any, source: str = "config") -> JobSpec:
    """Validate a dict (from YAML or a CR's spec) into a JobSpec; OrbitError names each bad field."""
    if not isinstance(data, dict):
        raise OrbitError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise OrbitError(format_validation_error(exc, source)) from None


def load_job_spec(path: Path) -> JobSpec:
    """Read and validate a YAML job file; relative model/data paths resolve against its folder."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise OrbitError(f"{path}: no such file") from None
    except yaml.YAMLError as exc:
        raise OrbitError(f"{path}: not valid YAML ({exc})") from None
    spec = parse_job_spec(data, str(path))
    return resolve_paths(spec, path.parent)


def resolve_paths(spec: JobSpec, base: Path) -> JobSpec:
    """Make model, data and output paths absolute relative to BASE (the config file's folder)."""

    def absolute(value: str) -> str:
        return value if Path(value).is_absolute() else str((base / value).resolve())

    update: dict[str, Any] = {
        "model": spec.model.model_copy(update={"path": absolute(spec.model.path)}),
        "run": spec.run.model_copy(update={"output_dir": absolute(spec.run.output_dir)}),
    }
    if isinstance(spec.data, FileData):
        data_update = {"path": absolute(spec.data.path)}
        if spec.data.validation_path:
            data_update["validation_path"] = absolute(spec.data.validation_path)
        update["data"] = spec.data.model_copy(update=data_update)
    return spec.model_copy(update=update)
