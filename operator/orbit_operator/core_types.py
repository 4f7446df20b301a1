"""The core/v1 objects a job passes to its pod (Toleration, Affinity), typed as pydantic models.

Typed so that the CRD's schema has their fields (the API server prunes and checks them, and
`kubectl explain` shows them) and the operator's validation refuses the same mistakes (an
unknown key, a wrong type) naming the field. The fields are those of Kubernetes 1.32's API
(a test compares them with the official JSON schemas); the enums are what the API server
accepts in a pod.

A job's `tolerations` and `affinity` stay plain dicts once validated (`AsDict`): what the user
set, without nulls, copied into the pod as is.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import core_schema


class _Core(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Toleration(_Core):
    """core/v1 Toleration: the pod tolerates taints matching <key, value, effect> by operator."""

    key: str | None = Field(None, description="The taint key (empty with operator Exists: every taint).")
    operator: Literal["Exists", "Equal", ""] | None = Field(None, description="Exists or Equal (the default).")
    value: str | None = Field(None, description="The taint value matched with operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute", ""] | None = Field(
        None, description="The taint effect to match (empty: every effect)."
    )
    tolerationSeconds: int | None = Field(
        None, description="With effect NoExecute: how long the pod stays bound to a tainted node."
    )


class NodeSelectorRequirement(_Core):
    """A node label (or field) requirement."""

    key: str = Field(description="The label key (or field name, in matchFields).")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(description="How key relates to values.")
    values: list[str] | None = Field(
        None, description="The values (one integer for Gt and Lt, none for Exists and DoesNotExist)."
    )


class NodeSelectorTerm(_Core):
    """Requirements a node must all meet."""

    matchExpressions: list[NodeSelectorRequirement] | None = Field(None, description="Requirements on node labels.")
    matchFields: list[NodeSelectorRequirement] | None = Field(None, description="Requirements on node fields.")


class NodeSelector(_Core):
    """Terms of which a node must meet one."""

    nodeSelectorTerms: list[NodeSelectorTerm] = Field(description="The terms (ORed).")


class PreferredSchedulingTerm(_Core):
    """A weighted node preference."""

    weight: int = Field(ge=1, le=100, description="Weight, 1-100.")
    preference: NodeSelectorTerm = Field(description="The node selector term.")


class NodeAffinity(_Core):
    """Node affinity scheduling rules."""

    requiredDuringSchedulingIgnoredDuringExecution: NodeSelector | None = Field(
        None, description="Nodes the pod must be scheduled on."
    )
    preferredDuringSchedulingIgnoredDuringExecution: list[PreferredSchedulingTerm] | None = Field(
        None, description="Nodes the scheduler prefers, by weight."
    )


class LabelSelectorRequirement(_Core):
    """A label requirement."""

    key: str = Field(description="The label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="How key relates to values.")
    values: list[str] | None = Field(None, description="The values (none for Exists and DoesNotExist).")


class LabelSelector(_Core):
    """meta/v1 LabelSelector: matchLabels and matchExpressions, ANDed."""

    matchLabels: dict[str, str] | None = Field(None, description="Labels that must have these values.")
    matchExpressions: list[LabelSelectorRequirement] | None = Field(None, description="Label requirements.")


class PodAffinityTerm(_Core):
    """Pods (by labels, in namespaces) that must or must not run in the same topology domain."""

    labelSelector: LabelSelector | None = Field(None, description="The pods this term is about.")
    namespaceSelector: LabelSelector | None = Field(None, description="The namespaces of those pods (by labels).")
    namespaces: list[str] | None = Field(None, description="The namespaces of those pods (by name; none: the pod's own).")
    topologyKey: str = Field(description="The node label whose value is the topology domain (e.g. kubernetes.io/hostname).")
    matchLabelKeys: list[str] | None = Field(None, description="Pod label keys whose values are added to labelSelector (In).")
    mismatchLabelKeys: list[str] | None = Field(
        None, description="Pod label keys whose values are added to labelSelector (NotIn)."
    )


class WeightedPodAffinityTerm(_Core):
    """A weighted pod (anti-)affinity preference."""

    weight: int = Field(ge=1, le=100, description="Weight, 1-100.")
    podAffinityTerm: PodAffinityTerm = Field(description="The pod affinity term.")


class PodAffinity(_Core):
    """Run near the pods the terms select."""

    requiredDuringSchedulingIgnoredDuringExecution: list[PodAffinityTerm] | None = Field(
        None, description="Terms that must hold."
    )
    preferredDuringSchedulingIgnoredDuringExecution: list[WeightedPodAffinityTerm] | None = Field(
        None, description="Terms the scheduler prefers, by weight."
    )


class PodAntiAffinity(_Core):
    """Run away from the pods the terms select."""

    requiredDuringSchedulingIgnoredDuringExecution: list[PodAffinityTerm] | None = Field(
        None, description="Terms that must hold."
    )
    preferredDuringSchedulingIgnoredDuringExecution: list[WeightedPodAffinityTerm] | None = Field(
        None, description="Terms the scheduler prefers, by weight."
    )


class Affinity(_Core):
    """core/v1 Affinity: node affinity, pod affinity and pod anti-affinity."""

    nodeAffinity: NodeAffinity | None = Field(None, description="Node affinity rules.")
    podAffinity: PodAffinity | None = Field(None, description="Pod affinity rules.")
    podAntiAffinity: PodAntiAffinity | None = Field(None, description="Pod anti-affinity rules.")


class AsDict:
    """`Annotated[dict[str, Any], AsDict(Model)]`: validated (and its JSON schema given) by MODEL,
    kept as the plain dict of what was set (no nulls), as the pod takes it."""

    def __init__(self, model: type[BaseModel]) -> None:
        self.model = model

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(
            lambda value: value.model_dump(mode="json", exclude_none=True),
            handler.generate_schema(self.model),
            serialization=core_schema.plain_serializer_function_ser_schema(lambda value: value),
        )
