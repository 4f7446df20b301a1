"""Is an RLTrainingJob acceptable? The one check the operator and `orbit validate` share.

`read_documents` parses YAML defensively (size, nesting and alias limits, no custom tags);
`validate_job` checks one manifest: apiVersion/kind/name, the spec against
`RLTrainingJobSpec` (every problem named by its field path), and the rules a schema cannot
say: the paths a job may name stay inside what it mounts (never the node's cache root:
that is operator configuration), checkpoints go to object storage, and the settings the
operator owns are left to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from orbit_operator.crd import GROUP, KIND, VERSION
from orbit_operator.job_spec import RLTrainingJobSpec
from orbit_runtime.config.prompt_data import FileData
from orbit_runtime.config.run_outputs import RunSpec

MAX_BYTES = 1 << 20  # a job manifest is a few KiB; 1 MiB is generous
MAX_DEPTH = 32
MAX_DOCUMENTS = 64
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = 40  # leaves room for the pod and ConfigMap suffixes within 63 characters


@dataclass(frozen=True)
class PodMetadataPolicy:
    """What the operator's configuration lets a job put on its pod (Helm values `operator.allowed*`): the
    priority classes, and the label and annotation keys (a key ending in `/*` allows a whole prefix). An
    empty tuple allows anything, as before these settings existed."""

    priority_classes: tuple[str, ...] = ()
    label_keys: tuple[str, ...] = ()
    annotation_keys: tuple[str, ...] = ()

    def errors(self, spec: RLTrainingJobSpec) -> list[str]:
        out = []
        if self.priority_classes and spec.priorityClassName and spec.priorityClassName not in self.priority_classes:
            out.append(f"spec.priorityClassName: {spec.priorityClassName!r} is not allowed by the operator "
                       f"(ORBIT_ALLOWED_PRIORITY_CLASSES: {', '.join(self.priority_classes)})")  # fmt: skip
        for field_name, allowed, env in (("podLabels", self.label_keys, "ORBIT_ALLOWED_POD_LABELS"),
                                         ("podAnnotations", self.annotation_keys, "ORBIT_ALLOWED_POD_ANNOTATIONS")):  # fmt: skip
            refused = sorted(key for key in getattr(spec, field_name) if allowed and not _key_allowed(key, allowed))
            if refused:
                out.append(f"spec.{field_name}: {', '.join(map(repr, refused))} not allowed by the operator "
                           f"({env}: {', '.join(allowed)})")  # fmt: skip
        return out


def _key_allowed(key: str, allowed: tuple[str, ...]) -> bool:
    return any(key == pattern or (pattern.endswith("/*") and key.startswith(pattern[:-1])) for pattern in allowed)


class ManifestError(ValueError):
    """The file cannot be read as YAML manifests at all."""


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader (no Python tags) that also refuses anchors/aliases (billion-laughs bombs)."""

    def compose_node(self, parent, index):  # type: ignore[override]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(None, None, "YAML aliases (*name) are not allowed", event.start_mark)
        return super().compose_node(parent, index)


def _depth(value: Any, limit: int) -> int:
    stack = [(value, 1)]
    deepest = 0
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return deepest


def read_documents(text: str | bytes, source: str) -> list[Any]:
    """Every YAML document of TEXT (empty ones skipped); ManifestError says why it cannot be read."""
    if len(text) > MAX_BYTES:
        raise ManifestError(f"{source}: {len(text)} bytes, more than the {MAX_BYTES} a manifest may have")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ManifestError(f"{source}: not UTF-8 text ({exc})") from None
    try:
        documents = [d for d in yaml.load_all(text, Loader=_NoAliasLoader) if d is not None]
    except RecursionError:
        raise ManifestError(f"{source}: nested deeper than {MAX_DEPTH} levels") from None
    except yaml.YAMLError as exc:
        raise ManifestError(f"{source}: not valid YAML ({' '.join(str(exc).split())})") from None
    if len(documents) > MAX_DOCUMENTS:
        raise ManifestError(f"{source}: {len(documents)} documents, more than {MAX_DOCUMENTS}")
    for index, document in enumerate(documents):
        if _depth(document, MAX_DEPTH) > MAX_DEPTH:
            raise ManifestError(f"{source}: document {index + 1} is nested deeper than {MAX_DEPTH} levels")
    return documents


@dataclass
class JobCheck:
    """The result of checking one manifest: the parsed spec, or the problems (each naming a field)."""

    name: str | None
    spec: RLTrainingJobSpec | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def _field_path(loc: tuple) -> str:
    tags = {"synthetic_arithmetic", "jsonl", "parquet", "function-after", "function-before"}
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and (p in tags or p.startswith("function-"))))


def _safe_relative(path: str) -> bool:
    return bool(path) and not path.startswith("/") and ".." not in path.split("/") and "\x00" not in path and "\\" not in path


def _cluster_rules(spec: RLTrainingJobSpec, max_gpus_per_node: int, allow_image_override: bool) -> list[str]:
    """What the schema cannot say (see the module docstring)."""
    errors = []
    for role in ("rollout", "reference", "learner"):
        if getattr(spec.resources, role).image and not allow_image_override:
            errors.append(f"spec.resources.{role}.image: image overrides are disabled by the operator (ORBIT_ALLOW_IMAGE_OVERRIDE): "
                          "a custom image would receive the job's Secrets")  # fmt: skip
    roles = spec.resources
    gpus = roles.rollout.gpus + roles.reference.gpus + roles.learner.gpus
    if gpus > max_gpus_per_node:
        errors.append(f"spec.resources: {gpus} GPUs in all (rollout {roles.rollout.gpus}, reference {roles.reference.gpus}, "
                      f"learner {roles.learner.gpus}) exceed this cluster's nodes ({max_gpus_per_node} GPUs)")  # fmt: skip
    if isinstance(spec.data, FileData):
        for name in ("path", "validation_path"):
            value = getattr(spec.data, name)
            if value is not None and not _safe_relative(value):
                errors.append(
                    f"spec.data.{name}: {value!r} must be a relative path without '..' (it is read from the base's "
                    "volume, base.pvc)"
                )
        if spec.base.pvc is None:
            errors.append("spec.data: file data is read from the base's volume: set base.pvc, or use synthetic data")
    uri = spec.checkpoint.uri
    if uri is None or not uri.startswith("s3://"):
        errors.append(
            f"spec.checkpoint.uri: {uri or 'unset'}: a pod's disk is gone when it is replaced, so checkpoints must go to "
            "object storage (s3://bucket/prefix)"
        )
    if spec.run.output_dir != RunSpec.model_fields["output_dir"].default:
        errors.append("spec.run.output_dir: set by the operator in a cluster (leave it out)")
    if spec.metrics.port is not None:
        errors.append("spec.metrics.port: set by the operator in a cluster (leave it out)")
    return errors


def validate_job(document: Any, source: str = "manifest", max_gpus_per_node: int = 8, allow_image_override: bool = False,
                 pod_metadata: PodMetadataPolicy | None = None) -> JobCheck:  # fmt: skip
    """Check one RLTrainingJob manifest (a parsed YAML/JSON document); MAX_GPUS_PER_NODE, ALLOW_IMAGE_OVERRIDE and
    POD_METADATA are the operator's settings."""
    if not isinstance(document, dict):
        return JobCheck(None, errors=[f"{source}: expected a mapping (an RLTrainingJob), got {type(document).__name__}"])
    metadata = document.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    check = JobCheck(name if isinstance(name, str) else None)
    errors = check.errors
    if document.get("apiVersion") != f"{GROUP}/{VERSION}":
        errors.append(f"apiVersion: expected {GROUP}/{VERSION}, got {document.get('apiVersion')!r}")
    if document.get("kind") != KIND:
        errors.append(f"kind: expected {KIND}, got {document.get('kind')!r}")
    if not isinstance(metadata, dict):
        errors.append("metadata: required (with a name)")
    elif not isinstance(name, str) or not NAME.match(name) or len(name) > MAX_NAME:
        errors.append(f"metadata.name: {name!r} must be a DNS label of at most {MAX_NAME} characters (a-z, 0-9, '-')")
    spec = document.get("spec")
    if not isinstance(spec, dict):
        errors.append(f"spec: expected a mapping, got {type(spec).__name__ if spec is not None else 'nothing'}")
        return check
    try:
        check.spec = RLTrainingJobSpec.model_validate(spec)
    except ValidationError as exc:
        for item in exc.errors():
            path = _field_path(item["loc"])
            errors.append(f"spec{'.' + path if path else ''}: {item['msg']}")
        return check
    except RecursionError:
        errors.append("spec: nested too deeply")
        return check
    errors.extend(_cluster_rules(check.spec, max_gpus_per_node, allow_image_override))
    errors.extend((pod_metadata or PodMetadataPolicy()).errors(check.spec))
    return check
