"""The RLTrainingJob CustomResourceDefinition, generated from `RLTrainingJobSpec`.

Kubernetes wants a *structural* OpenAPI v3.0 schema: every node typed, no `$ref`, no
`anyOf` of types, `nullable` instead of a null type, boolean `exclusiveMinimum`. Pydantic
writes JSON Schema 2020-12; `structural()` translates it:

- `$ref` is inlined; `anyOf: [X, null]` becomes X, with `nullable: true` only where null
  means something else than leaving the field out (its default is not null, e.g.
  `algorithm.dual_clip: null` disables the clip). Where the default is null the API server
  prunes an explicit null, which the operator reads as unset anyway, so a rule's `has()`
  sees one meaning;
- a discriminated union (data: synthetic_arithmetic | jsonl | parquet) becomes one object
  with every variant's properties, the discriminator an enum of all tags, and no defaults
  (a variant's default would land in the others; the operator's pydantic validation checks
  which properties go with which tag); a union of scalars (`max_mismatch`: a number or
  "auto") takes any value, checked by the operator;
- a quantity (`resources.*.cpu`, `memory`) is `x-kubernetes-int-or-string` with
  apimachinery's pattern (the pattern applies to strings): `cpu: 8` and `cpu: 500m` pass,
  `cpu: 1.2.3` does not;
- `const` becomes a one-value enum; numeric exclusive bounds become OpenAPI 3.0's form;
- defaults are kept, the static ones and those of a section's default factory (JSON, nulls
  left out): the API server fills them in, so `kubectl get -o yaml` shows the effective
  spec and the operator reads what it would have defaulted itself (a default under an
  optional object applies only when that object is given, as in pydantic);
- no `x-kubernetes-preserve-unknown-fields` but on the free-form maps (`base.modelConfig`,
  a reward's `kwargs`), `max_mismatch` and the status (STATUS_SCHEMA says why). What changes:
  the API server prunes unknown fields (it used to keep them, for the operator to name), and
  `kubectl apply` (field validation Strict, kubectl's default since 1.27) refuses a typo
  naming the field: a typo is now refused before it is stored. The operator's own validation
  (pydantic, extra fields forbidden) still refuses one too, for `orbit validate` and clients
  that turn field validation off (their typos are pruned with a warning);
- CEL rules (`x-kubernetes-validations`, crd_rules.py) say what a schema cannot: exactly one base
  source, the name's length, and what cannot change while the job's pod runs.

    orbit crd            # writes charts/orbit/crds/rltrainingjob.yaml
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic.json_schema import GenerateJsonSchema

from orbit_operator.job_spec import RLTrainingJobSpec

GROUP = "orbit.dev"
VERSION = "v1alpha1"
KIND = "RLTrainingJob"
PLURAL = "rltrainingjobs"
SINGULAR = "rltrainingjob"
SHORT_NAMES = ["rljob"]
DROPPED_KEYWORDS = {"title", "default", "discriminator", "examples"}


class _WithFactoryDefaults(GenerateJsonSchema):
    """Pydantic's JSON schema, with the defaults of default factories too (a section's defaults)."""

    def get_default_value(self, schema: Any) -> Any:
        factory = schema.get("default_factory")
        if factory is not None and not schema.get("default_factory_takes_data"):
            return factory()
        return super().get_default_value(schema)


def _without_nulls(value: Any) -> Any:
    """A default as the API server stores it: no null members (a null default means: not set)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _without_defaults(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_without_defaults(v) for v in node]
    return node


def _resolve(node: dict, defs: dict) -> dict:
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return {**target, **extra}
    return node


def _merge_variants(variants: list[dict]) -> dict:
    """One object schema holding every variant's properties (a discriminated union), without defaults."""
    if not all(v.get("type") == "object" for v in variants):  # e.g. a number or "auto": any value, the operator checks it
        return {"x-kubernetes-preserve-unknown-fields": True}
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
    merged: dict[str, Any] = {"type": "object", "properties": _without_defaults(properties)}
    if required:
        merged["required"] = sorted(required)
    return merged


def structural(node: dict, defs: dict) -> dict:
    """Translate one pydantic JSON-schema node (see the module docstring)."""
    node = _resolve(node, defs)
    description = node.get("description")
    if "anyOf" in node or "oneOf" in node:
        options = [_resolve(o, defs) for o in node.get("anyOf", node.get("oneOf"))]
        nullable = any(o.get("type") == "null" for o in options) and not ("default" in node and node["default"] is None)
        options = [structural(o, defs) for o in options if o.get("type") != "null"]
        out = options[0] if len(options) == 1 else _merge_variants(options)
        if nullable and "type" in out:
            out = {**out, "nullable": True}
            if "enum" in out:  # the API server checks enum before nullable: null must be one of the values
                out["enum"] = [*out["enum"], None]
    elif node.get("x-kubernetes-int-or-string"):
        out = {k: node[k] for k in ("x-kubernetes-int-or-string", "pattern", "maxLength") if k in node}
    elif node.get("type") == "object" or "properties" in node:
        out = {"type": "object"}
        if "properties" in node:
            out["properties"] = {name: structural(prop, defs) for name, prop in node["properties"].items()}
            if node.get("required"):
                out["required"] = list(node["required"])
        elif isinstance(node.get("additionalProperties"), dict) and node["additionalProperties"]:
            out["additionalProperties"] = structural(node["additionalProperties"], defs)
        else:  # dict[str, Any]: free-form (base.modelConfig, a reward's kwargs)
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
    if node.get("default") is not None:
        out["default"] = _without_nulls(node["default"])
    if description:  # the field's own description wins over its type's
        out["description"] = description
    return out


def _typed(type_: str, description: str, **extra: Any) -> dict:
    return {"type": type_, "description": description, **extra}


# What the operator writes (reconcile.py, decision.py, learner_report.py; docs/operator.md lists it). The status keeps
# unknown fields: only the operator writes it (the status subresource), and a field a newer operator adds, or one this
# list misses, must never be pruned silently; progress too (a newer learner may report more).
STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "What the operator observed and decided (written by the operator only).",
    "x-kubernetes-preserve-unknown-fields": True,
    "properties": {
        "phase": _typed("string", "The job's phase.",
                        enum=["Queued", "Pending", "Preparing", "Running", "Succeeded", "Failed", "Suspended"]),
        "observedGeneration": _typed("integer", "The newest spec generation the operator applied."),
        "conditions": {
            "type": "array",
            "description": "One condition per type (Ready, Failed, Invalid, Suspended, SpecChangeRefused, OnPolicy, ...).",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
            "items": {
                "type": "object",
                "required": ["type", "status"],
                "properties": {
                    "type": _typed("string", "The condition's type (one entry per type)."),
                    "status": _typed("string", "True, False or Unknown.", enum=["True", "False", "Unknown"]),
                    "reason": _typed("string", "Why, in one CamelCase word."),
                    "message": _typed("string", "Why, for people."),
                    "lastTransitionTime": _typed("string", "When status last changed.", format="date-time"),
                    "observedGeneration": _typed("integer", "The job generation this condition was decided at."),
                },
            },
        },
        "progress": {
            "type": "object",
            "description": "The learner's progress, from its /status.",
            "x-kubernetes-preserve-unknown-fields": True,
            "properties": {
                "step": _typed("integer", "The last finished step."),
                "maxSteps": _typed("integer", "The run's steps (schedule.steps)."),
                "stepText": _typed("string", "step/maxSteps, for the printer column."),
                "learnerPhase": _typed("string", "The learner's own phase (starting, running, succeeded, stopped, failed)."),
                "reward": _typed("number", "The last step's mean training reward."),
                "heldoutAccuracy": _typed("number", "The last held-out evaluation's accuracy."),
                "heldoutStderr": _typed("number", "Standard error of heldoutAccuracy over the prompts."),
                "heldoutPrompts": _typed("integer", "Prompts in the last held-out evaluation."),
                "adapterVersion": _typed("integer", "The adapter version the rollout serves."),
                "lastCheckpoint": {"type": "object", "description": "The newest complete checkpoint.", "properties": {
                    "uri": _typed("string", "Where it is."), "step": _typed("integer", "Its step.")}},
                "roleRestarts": _typed("object", "Restarts of each sidecar role (rollout, reference).",
                                       additionalProperties={"type": "integer"}),
            },
        },
        "plan": _typed("string", "Whether the job fits its node, in one line (orbit plan): what each GPU or container needs "
                       "of what it has, and the tightest row."),
        "attempt": _typed("integer", "The current pod's number (the pod is <job>-<attempt>)."),
        "failures": _typed("integer", "Pod failures counted against backoffLimit."),
        "podName": _typed("string", "The current attempt's pod."),
        "restartId": _typed("string", "The spec.restartId applied."),
        "ignoredRestartId": _typed("string", "A restartId set on a finished job (ignored, reported once)."),
        "reapply": _typed("boolean", "The next pod takes the current spec (a resume or a restart)."),
        "startTime": _typed("string", "When the job (or its resume) started.", format="date-time"),
        "activeSince": _typed("string", "When activeDeadlineSeconds started counting (the pod was scheduled).",
                              format="date-time"),
        "completionTime": _typed("string", "When the job finished.", format="date-time"),
        "nextAttemptAt": _typed("string", "When the backoff after a pod failure ends.", format="date-time"),
        "learnerStatusError": _typed("string", "What of the learner's /status was ignored, and why."),
    },
}  # fmt: skip

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Step", "type": "string", "jsonPath": ".status.progress.stepText"},
    {"name": "Reward", "type": "number", "jsonPath": ".status.progress.reward"},
    {"name": "Held-out", "type": "number", "jsonPath": ".status.progress.heldoutAccuracy"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def spec_schema() -> dict:
    """The structural OpenAPI schema of RLTrainingJob.spec."""
    from orbit_operator.crd_rules import BASE_RULES

    schema = RLTrainingJobSpec.model_json_schema(mode="validation", schema_generator=_WithFactoryDefaults)
    spec = structural(schema, schema.get("$defs", {}))
    spec["properties"]["base"]["x-kubernetes-validations"] = BASE_RULES
    return spec


def crd_manifest() -> dict:
    """The whole CustomResourceDefinition (apiextensions.k8s.io/v1)."""
    from orbit_operator.crd_rules import ROOT_RULES  # (crd_rules -> validation -> crd)

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
                                "apiVersion": {"type": "string", "description": f"{GROUP}/{VERSION}"},
                                "kind": {"type": "string", "description": KIND},
                                # only `type`: the API server refuses anything else on the root metadata
                                # (a description too: the schema would not be structural); the name rule says 40
                                "metadata": {"type": "object"},
                                "spec": spec_schema(),
                                "status": STATUS_SCHEMA,
                            },
                            "x-kubernetes-validations": ROOT_RULES,
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
    """The CRD schema as JSON Schema, to validate manifests offline with `jsonschema`: nullable -> a null type,
    int-or-string -> integer or string, no unknown fields but where the schema keeps them (as `kubectl apply`'s
    Strict field validation). CEL rules are not checked here (the tests evaluate them with cel-python)."""
    node = {k: v for k, v in openapi.items() if not k.startswith("x-kubernetes")}
    if openapi.get("x-kubernetes-int-or-string"):
        node["type"] = ["integer", "string"]
    if "properties" in node and not openapi.get("x-kubernetes-preserve-unknown-fields"):
        node["additionalProperties"] = False
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
