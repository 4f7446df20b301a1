"""The RLTrainingJob CustomResourceDefinition, generated from `RLTrainingJobSpec`.

Kubernetes wants a *structural* OpenAPI v3.0 schema: every node typed, no `$ref`, no
`anyOf` of types, `nullable` instead of a null type, boolean `exclusiveMinimum`. Pydantic
writes JSON Schema 2020-12; `structural()` translates it:

- `$ref` is inlined; `anyOf: [X, null]` becomes X with `nullable: true`;
- a discriminated union (data: synthetic_arithmetic | jsonl | parquet) becomes one object
  with every variant's properties, the discriminator an enum of all tags (the operator's
  pydantic validation checks which properties go with which tag);
- `const` becomes a one-value enum; numeric exclusive bounds become OpenAPI 3.0's form;
- titles and defaults are dropped: the pydantic model applies defaults, so the stored object
  stays what the user wrote;
- objects from the models keep unknown fields (`x-kubernetes-preserve-unknown-fields`) instead
  of the API server pruning them silently: the operator then rejects a typo with an error
  naming it, exactly as `orbit validate` does.

    orbit crd            # writes charts/orbit/crds/rltrainingjob.yaml
"""

from __future__ import annotations

import copy
from typing import Any

from orbit_operator.job_spec import RLTrainingJobSpec

GROUP = "orbit.dev"
VERSION = "v1alpha1"
KIND = "RLTrainingJob"
PLURAL = "rltrainingjobs"
SINGULAR = "rltrainingjob"
SHORT_NAMES = ["rljob"]
DROPPED_KEYWORDS = {"title", "default", "discriminator", "examples"}


def _resolve(node: dict, defs: dict) -> dict:
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return {**target, **extra}
    return node


def _merge_variants(variants: list[dict]) -> dict:
    """One object schema holding every variant's properties (a discriminated union)."""
    properties: dict[str, dict] = {}
    for variant in variants:
        for name, prop in variant.get("properties", {}).items():
            if name in properties and "enum" in properties[name] and "enum" in prop:
                properties[name] = {**properties[name], "enum": sorted(set(properties[name]["enum"]) | set(prop["enum"]))}
            elif name in properties and prop.get("nullable"):
                properties[name] = {**properties[name], "nullable": True}
            else:
                properties.setdefault(name, prop)
    required = set.intersection(*(set(v.get("required", [])) for v in variants))
    merged: dict[str, Any] = {"type": "object", "properties": properties, "x-kubernetes-preserve-unknown-fields": True}
    if required:
        merged["required"] = sorted(required)
    return merged


def structural(node: dict, defs: dict) -> dict:
    """Translate one pydantic JSON-schema node (see the module docstring)."""
    node = _resolve(node, defs)
    description = node.get("description")
    if "anyOf" in node or "oneOf" in node:
        options = [_resolve(o, defs) for o in node.get("anyOf", node.get("oneOf"))]
        nullable = any(o.get("type") == "null" for o in options)
        options = [structural(o, defs) for o in options if o.get("type") != "null"]
        out = options[0] if len(options) == 1 else _merge_variants(options)
        if nullable:
            out = {**out, "nullable": True}
            if "enum" in out:  # the API server checks enum before nullable: null must be one of the values
                out["enum"] = [*out["enum"], None]
    elif node.get("type") == "object" or "properties" in node:
        out = {"type": "object"}
        if "properties" in node:
            out["properties"] = {name: structural(prop, defs) for name, prop in node["properties"].items()}
            out["x-kubernetes-preserve-unknown-fields"] = True  # the operator rejects unknown fields by name
            if node.get("required"):
                out["required"] = list(node["required"])
        elif isinstance(node.get("additionalProperties"), dict) and node["additionalProperties"]:
            out["additionalProperties"] = structural(node["additionalProperties"], defs)
        else:  # dict[str, Any]
            out["x-kubernetes-preserve-unknown-fields"] = True
    elif node.get("type") == "array":
        out = {"type": "array", "items": structural(node.get("items", {}), defs)}
    elif "type" in node or "const" in node or "enum" in node:
        out = {k: v for k, v in node.items() if k not in DROPPED_KEYWORDS and k != "const"}
        if "const" in node:
            out["enum"] = [node["const"]]
            out.setdefault("type", "string" if isinstance(node["const"], str) else "integer")
        for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(out.get(bound), int | float) and not isinstance(out.get(bound), bool):
                out[plain], out[bound] = out[bound], True
    else:  # Any
        out = {"x-kubernetes-preserve-unknown-fields": True}
    for key in ("minItems", "maxItems") if out.get("type") == "array" else ():
        if key in node:
            out[key] = node[key]
    if description:  # the field's own description wins over its type's
        out["description"] = description
    return out


STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "x-kubernetes-preserve-unknown-fields": True,
    "properties": {
        "phase": {"type": "string", "enum": ["Pending", "Preparing", "Running", "Succeeded", "Failed", "Suspended"]},
        "observedGeneration": {"type": "integer"},
        "conditions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type", "status"],
                "properties": {
                    "type": {"type": "string"},
                    "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                    "lastTransitionTime": {"type": "string", "format": "date-time"},
                    "observedGeneration": {"type": "integer", "description": "the job generation this condition was decided at"},
                },
            },
        },
        "progress": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "properties": {
                "step": {"type": "integer"},
                "maxSteps": {"type": "integer"},
                "stepText": {"type": "string", "description": "step/maxSteps, for the printer column"},
                "reward": {"type": "number"},
                "heldoutAccuracy": {"type": "number"},
                "heldoutStderr": {"type": "number", "description": "standard error of heldoutAccuracy over the prompts"},
                "heldoutPrompts": {"type": "integer"},
                "adapterVersion": {"type": "integer"},
            },
        },
        "plan": {"type": "string", "description": "Whether the job fits its node, in one line (orbit plan): what each GPU "
                 "or container needs of what it has, and the tightest row."},
    },
}

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "string", "jsonPath": ".status.progress.stepText"},
    {"name": "Reward", "type": "number", "jsonPath": ".status.progress.reward"},
    {"name": "Held-out", "type": "number", "jsonPath": ".status.progress.heldoutAccuracy"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def spec_schema() -> dict:
    """The structural OpenAPI schema of RLTrainingJob.spec."""
    schema = RLTrainingJobSpec.model_json_schema(mode="validation")
    return structural(schema, schema.get("$defs", {}))


def crd_manifest() -> dict:
    """The whole CustomResourceDefinition (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "orbit"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR, "shortNames": SHORT_NAMES,
                      "categories": ["orbit"]},  # fmt: skip
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An RL post-training job: one pod (rollout, reference, learner) on a shared INT4 base.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": STATUS_SCHEMA,
                            },
                        }
                    },
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The CRD as the YAML checked in under charts/orbit/crds/ (a header says it is generated)."""
    import yaml

    header = "# GENERATED by `orbit crd` from orbit_operator.job_spec.RLTrainingJobSpec. Do not edit.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=120)


def jsonschema_of(openapi: dict) -> dict:
    """The CRD schema as JSON Schema (nullable -> a null type), to validate manifests offline with `jsonschema`."""
    node = {k: v for k, v in openapi.items() if not k.startswith("x-kubernetes")}
    if node.pop("nullable", False) and "type" in node:
        node["type"] = [node["type"], "null"]
        if "enum" in node and None not in node["enum"]:
            node["enum"] = [*node["enum"], None]
    if "properties" in node:
        node["properties"] = {k: jsonschema_of(v) for k, v in node["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            node[key] = jsonschema_of(node[key])
    if node.get("exclusiveMinimum") is True:
        node["exclusiveMinimum"] = node.pop("minimum")
    if node.get("exclusiveMaximum") is True:
        node["exclusiveMaximum"] = node.pop("maximum")
    return node
