"""`RLTrainingJob.spec`: the runtime's job spec plus what Kubernetes needs to know.

One source of truth: the runtime sections (algorithm, data, rollout, ...) are the very
pydantic models `orbit train` reads; this module adds where the base comes from, the pod's
resources and placement, and the job's lifecycle. The CRD's schema (`crd.py`), the
operator's validation and `orbit validate` all come from `RLTrainingJobSpec`.

Field names: the runtime's sections keep their names (snake_case, as in an `orbit train`
config, so one file's sections can be pasted into the other); the Kubernetes fields use the
camelCase of the pod API they map to (nodeSelector, priorityClassName, ...).

No torch, no Kubernetes client: importing this is instant and the operator image needs
neither.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, StringConstraints, WithJsonSchema, field_validator, model_validator

from orbit_operator.core_types import Affinity, AsDict, Toleration
from orbit_runtime.config.run_outputs import RunSpec
from orbit_runtime.config.spec import CheckpointSpec, JobSpec, ModelSettings, ModelSpec, Section
from orbit_runtime.config.storage_uri import validate_storage_uri

# a Kubernetes resource quantity (e.g. 8, 500m, 16Gi): apimachinery's regex, as the API server checks it
QUANTITY = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
MAX_GPUS_PER_NODE = 8  # one node; the operator may be configured lower
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def _quantity_text(value: Any) -> Any:
    """A quantity written as a YAML integer (cpu: 8) as the string Kubernetes would print. A fraction must be a
    string (cpu: "500m" or "0.5"): the API server's int-or-string refuses a YAML float, and so does this."""
    if isinstance(value, bool):
        raise ValueError("must be a Kubernetes quantity (a number or a string such as 500m or 16Gi), not a boolean")
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        raise ValueError(f"{value} is not an integer: write a fraction as a string, e.g. '{round(value * 1000)}m'")
    if isinstance(value, int):
        return str(value)
    return value


# int or string, as in a pod's resources (the CRD: x-kubernetes-int-or-string with the pattern); held as a string
Quantity = Annotated[
    str,
    BeforeValidator(_quantity_text),
    StringConstraints(pattern=QUANTITY, max_length=32),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY, "maxLength": 32}),
]


class PvcSource(Section):
    """A checkpoint directory on a PersistentVolumeClaim in the job's namespace."""

    claimName: str = Field(pattern=DNS_LABEL, max_length=63, description="The PVC's name.")
    subPath: str = Field(
        "", max_length=1024, description="Directory inside the volume (relative, no '..'); empty: the volume's root."
    )

    @field_validator("subPath")
    @classmethod
    def validate_sub_path(cls, sub_path: str) -> str:
        if sub_path.startswith("/") or ".." in sub_path.split("/") or "\\" in sub_path or "\x00" in sub_path:
            raise ValueError(f"must be a relative path inside the volume without '..', got {sub_path!r}")
        return sub_path


class BaseSource(Section):
    """Where the INT4 base comes from. Exactly one of pvc, uri and nodeCache."""

    format: Literal["int4", "hf"] = Field(
        "hf",
        description="int4: already an `orbit quantize` output (verified, then used); hf: a Hugging Face-format "
        "checkpoint, quantized once into the node's cache.",
    )
    pvc: PvcSource | None = Field(None, description="The checkpoint on a PVC.")
    uri: str | None = Field(None, max_length=2048, description="The checkpoint in object storage (s3://bucket/prefix).")
    nodeCache: str | None = Field(
        None, pattern=DNS_LABEL, max_length=63,
        description="An INT4 base an administrator put in every node's cache under named/<this name>/model "
        "(a name, never a path; shared by all namespaces).",
    )  # fmt: skip
    groupSize: int = Field(128, description="INT4 scale group size when quantizing (format: hf).")
    credentialsSecret: str | None = Field(
        None, pattern=DNS_LABEL, max_length=253,
        description="Secret with S3 credentials for `uri` (AWS_ACCESS_KEY_ID, ...), given to prepare-base only.",
    )  # fmt: skip
    architecture: str | None = Field(
        None, max_length=63,
        description="The base's architecture, by the name of a model in `orbit plan`'s catalog (deepseek-v3, "
        "kimi-k2-thinking, qwen3-235b-a22b, ...): the operator then checks that the job fits its node before any pod "
        "exists. Optional: prepare-base checks it from the base's own config.json in any case.",
    )  # fmt: skip
    modelConfig: dict[str, Any] | None = Field(
        None,
        description="The base's config.json (at least the fields the planner reads) for a model not in the catalog: "
        "the operator then checks that the job fits before any pod exists. At most one of architecture and modelConfig.",
    )

    @field_validator("architecture")
    @classmethod
    def validate_architecture(cls, name: str | None) -> str | None:
        if name is not None:
            from orbit_runtime.plan.architecture import PlanError
            from orbit_runtime.plan.catalog import catalog_config

            try:
                catalog_config(name)
            except PlanError as exc:
                raise ValueError(str(exc)) from None
        return name

    @field_validator("modelConfig")
    @classmethod
    def validate_model_config(cls, config: dict[str, Any] | None) -> dict[str, Any] | None:
        if config is not None:
            from orbit_runtime.plan.architecture import PlanError, parse_architecture

            try:
                parse_architecture(config, "modelConfig")
            except PlanError as exc:
                raise ValueError(str(exc).removeprefix("modelConfig: ")) from None
        return config

    @field_validator("uri")
    @classmethod
    def validate_uri(cls, uri: str | None) -> str | None:
        if uri is None:
            return None
        if not uri.startswith("s3://"):
            raise ValueError(f"must be an s3:// URI (a pod cannot read this machine's files), got {uri!r}")
        return validate_storage_uri(uri)

    @field_validator("groupSize")
    @classmethod
    def validate_group_size(cls, group_size: int) -> int:
        if group_size not in (32, 64, 128):
            raise ValueError(f"must be 32, 64 or 128, got {group_size}")
        return group_size

    @model_validator(mode="after")
    def validate_one_source(self) -> BaseSource:
        given = [name for name in ("pvc", "uri", "nodeCache") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"set exactly one of pvc, uri, nodeCache (got {', '.join(given) or 'none'})")
        if self.architecture is not None and self.modelConfig is not None:
            raise ValueError("set at most one of architecture and modelConfig")
        if self.nodeCache is not None and self.format != "int4":
            raise ValueError("nodeCache holds INT4 bases only: set format: int4")
        return self


class RoleResources(Section):
    """One container's resources (requests = limits, as GPU pods need) and optional image."""

    gpus: int = Field(0, ge=0, le=MAX_GPUS_PER_NODE, description="nvidia.com/gpu of this container.")
    cpu: Quantity = Field("2", description="CPU (a Kubernetes quantity, e.g. 8 or 500m).")
    memory: Quantity = Field("8Gi", description="Memory (a Kubernetes quantity, e.g. 64Gi).")
    image: str | None = Field(
        None, max_length=512,
        description="Image override for this role (default: the operator's). Refused unless the operator allows "
        "overrides (ORBIT_ALLOW_IMAGE_OVERRIDE): a custom learner image would read the job's Secrets.",
    )  # fmt: skip

    @field_validator("cpu")
    @classmethod
    def validate_cpu(cls, cpu: str) -> str:
        from orbit_operator.quantity import parse_quantity

        if parse_quantity(cpu) < 0:
            raise ValueError(f"{cpu!r} is negative")
        return cpu

    @field_validator("memory")
    @classmethod
    def validate_memory(cls, memory: str) -> str:
        from orbit_operator.quantity import parse_quantity

        if parse_quantity(memory) < 2**20:
            raise ValueError(f"{memory!r} is less than 1Mi: memory is in bytes (e.g. 64Gi)")
        return memory


class PodResources(Section):
    """The resources of the pod's containers (prepare-base's are fixed: 2 CPUs, 8Gi)."""

    rollout: RoleResources = Field(default_factory=lambda: RoleResources(gpus=1, cpu="8", memory="64Gi"),
                                   description="The rollout (vLLM) container.")  # fmt: skip
    reference: RoleResources = Field(default_factory=lambda: RoleResources(gpus=0, cpu="2", memory="16Gi"),
                                     description="The reference container (reference.mode: server only).")  # fmt: skip
    learner: RoleResources = Field(default_factory=lambda: RoleResources(gpus=1, cpu="8", memory="64Gi"),
                                   description="The learner container.")  # fmt: skip


class ClusterCheckpointSpec(CheckpointSpec):
    """Where and when the learner checkpoints; in a cluster, to object storage (checkpoint.uri: s3://...)."""

    credentialsSecret: str | None = Field(
        None, pattern=DNS_LABEL, max_length=253,
        description="Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and optionally AWS_ENDPOINT_URL), "
        "given to the learner only.",
    )  # fmt: skip


class ClusterRunSpec(RunSpec):
    """The run's name and trackers; in a cluster, their credentials come from a Secret."""

    trackingSecret: str | None = Field(
        None, pattern=DNS_LABEL, max_length=253,
        description="Secret with the trackers' credentials (WANDB_API_KEY; MLFLOW_TRACKING_TOKEN or "
        "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD), given to the learner only as environment variables.",
    )  # fmt: skip


def _check_labels(values: dict[str, str], field: str) -> dict[str, str]:
    for key in values:
        if len(key) > 317 or not LABEL_KEY.match(key):
            raise ValueError(f"{field} key {key!r} is not a valid Kubernetes label/annotation key")
    return values


class RLTrainingJobSpec(JobSpec):
    """`RLTrainingJob.spec`. model has no path: the base is `base`, mounted into the pod."""

    model: ModelSettings = Field(default_factory=ModelSettings, description="How the base is computed with.")  # type: ignore[assignment]
    checkpoint: ClusterCheckpointSpec = Field(  # type: ignore[assignment]
        default_factory=ClusterCheckpointSpec, description=ClusterCheckpointSpec.__doc__
    )
    run: ClusterRunSpec = Field(default_factory=ClusterRunSpec, description=ClusterRunSpec.__doc__)  # type: ignore[assignment]
    base: BaseSource = Field(description="Where the INT4 base comes from.")
    resources: PodResources = Field(default_factory=PodResources, description="The containers' CPU, memory, GPUs and images.")
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="The pod's nodeSelector (node labels).")
    tolerations: list[Annotated[dict[str, Any], AsDict(Toleration)]] = Field(
        default_factory=list, description="Pod tolerations (core/v1 Toleration)."
    )
    affinity: Annotated[dict[str, Any], AsDict(Affinity)] | None = Field(None, description="Pod affinity (core/v1 Affinity).")
    priorityClassName: str | None = Field(None, pattern=DNS_LABEL, max_length=253, description="The pod's priorityClassName.")
    suspend: bool = Field(False, description="true: delete the pod and keep the status; false again: resume.")
    backoffLimit: int = Field(3, ge=0, le=100, description="Pod failures retried (with exponential backoff) before Failed.")
    activeDeadlineSeconds: int | None = Field(None, ge=1, description="Fail the job after this long running.")
    ttlSecondsAfterFinished: int | None = Field(None, ge=0, description="Delete the job this long after it finished.")
    restartId: str = Field("", max_length=63, description="Changing it restarts the pod (resuming from the last checkpoint).")
    podLabels: dict[str, str] = Field(default_factory=dict, description="Added to the pod (Kueue's queue label goes on the job).")
    podAnnotations: dict[str, str] = Field(default_factory=dict, description="Added to the pod.")

    @field_validator("podLabels")
    @classmethod
    def validate_pod_labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for value in labels.values():
            if len(value) > 63 or not re.match(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$", value):
                raise ValueError(f"label value {value!r} is not a valid Kubernetes label value")
        return _check_labels(labels, "podLabels")

    @field_validator("podAnnotations", "nodeSelector")
    @classmethod
    def validate_keys(cls, values: dict[str, str], info) -> dict[str, str]:
        return _check_labels(values, info.field_name)

    @model_validator(mode="after")
    def validate_gpus(self) -> RLTrainingJobSpec:
        total = sum(r.gpus for r in (self.resources.rollout, self.resources.reference, self.resources.learner))
        if total > MAX_GPUS_PER_NODE:
            raise ValueError(f"resources: {total} GPUs in all exceed one node ({MAX_GPUS_PER_NODE})")
        if self.placement == "colocated" and (self.resources.rollout.gpus or self.resources.learner.gpus):
            # on GPUs the learner's compute would have to run in the rollout container (the one given the GPUs)
            raise ValueError("placement colocated: resources.rollout.gpus and resources.learner.gpus must be 0 (CPU only)")
        if self.rollout.tensor_parallel_size > max(self.resources.rollout.gpus, 1):
            raise ValueError(
                f"rollout.tensor_parallel_size ({self.rollout.tensor_parallel_size}) exceeds resources.rollout.gpus "
                f"({self.resources.rollout.gpus})"
            )
        return self

    def runtime_spec(self, base_path: str, output_dir: str) -> JobSpec:
        """The `orbit train` config the pod's roles run: the base at BASE_PATH, run files under OUTPUT_DIR."""
        data = self.model_dump(mode="json", include=set(JobSpec.model_fields))
        data["model"] = ModelSpec(path=base_path, **self.model.model_dump()).model_dump(mode="json")
        data["checkpoint"].pop("credentialsSecret", None)
        data["run"].pop("trackingSecret", None)
        data["run"]["output_dir"] = output_dir
        return JobSpec.model_validate(data)
