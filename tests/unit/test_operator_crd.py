"""The CRD as an API server uses it (no server runs here): typed nested objects (tolerations, affinity,
quantities), no unknown fields kept, defaults that give what the operator defaults, a description on
every field (what `kubectl explain` shows), conditions as a map list, and the CEL rules, evaluated
with cel-python against jobs that pass and jobs that fail, each agreeing with the operator. Also the
chart's kubeVersion and the applied spec of an older operator's ConfigMap (a stored fixture)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Literal

import celpy
import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel, Field

from orbit_operator import core_types
from orbit_operator.crd import crd_manifest, jsonschema_of, structural
from orbit_operator.crd_rules import BASE_RULES, ROOT_RULES
from orbit_operator.fit import plan_request
from orbit_operator.pod import APPLIED_SPEC_VERSION, APPLIED_SPEC_VERSION_FILE, applied_spec, build_configmap, build_pod
from orbit_operator.settings import OperatorSettings
from orbit_operator.spec_changes import refused_changes
from orbit_operator.validation import validate_job
from tests.unit.test_operator_manifests import _walk

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
K8S_SCHEMAS = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / "v1.32.0-local-strict"
SCHEMA = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC = SCHEMA["properties"]["spec"]
OFFLINE = jsonschema_of(SCHEMA)
FREE_FORM = {".spec.base.modelConfig", ".spec.rewards[items].kwargs", ".spec.eval.reward.kwargs", ".spec.environment.kwargs",
             ".spec.algorithm.max_mismatch",
             ".status", ".status.progress"}  # fmt: skip




def _fields(node: dict, path: str = ""):
    """Every named field (what `kubectl explain` lists), with its path."""
    for name, child in (node.get("properties") or {}).items():
        if path == "" and name == "metadata":
            continue  # the API server allows only `type` on the root metadata: no description (test below)
        yield f"{path}.{name}", child
        yield from _fields(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _fields(node[key], f"{path}[{key}]")


def _job(**spec) -> dict:
    base = {"base": {"uri": "s3://models/qwen"}, "checkpoint": {"uri": "s3://runs/job"}}
    return {"apiVersion": "orbit.dev/v1alpha1", "kind": "RLTrainingJob", "metadata": {"name": "job"}, "spec": {**base, **spec}}


def _default(node: dict, value):
    """The API server's defaulting (structural defaulting): nulls of non-nullable fields pruned (or defaulted),
    then a property's default set where it is missing, recursively, on what exists."""
    if isinstance(value, dict) and "properties" in node:
        for name, child in node["properties"].items():
            if name in value and value[name] is None and not child.get("nullable"):
                del value[name]
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                value[name] = _default(child, value[name])
    elif isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
        return {k: _default(node["additionalProperties"], v) for k, v in value.items()}
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        return [_default(node["items"], v) for v in value]
    return value


def _server_view(job: dict) -> dict:
    return _default(SCHEMA, copy.deepcopy(job))


# --- descriptions, unknown fields, conditions ---------------------------------------------------


def test_every_field_of_the_crd_has_a_description():
    missing = [path for path, node in _fields(SCHEMA) if not node.get("description")]
    assert missing == [], f"fields without a description (kubectl explain shows none): {missing}"
    assert len(list(_fields(SCHEMA))) > 137  # the spec's fields, the core types' and the status's


def test_unknown_fields_are_kept_only_in_free_form_maps():
    kept = {path for path, node in _walk(SCHEMA) if node.get("x-kubernetes-preserve-unknown-fields")}
    assert kept == FREE_FORM
    job = _job(rollout={"max_token": 32})  # a typo
    with pytest.raises(jsonschema.ValidationError, match="max_token"):
        jsonschema.validate(job, OFFLINE)  # Strict field validation (kubectl apply's default) refuses it, by name
    assert validate_job(job).errors == ["spec.rollout.max_token: Extra inputs are not permitted"]  # and the operator


def test_a_numeric_max_mismatch_passes_the_crd_schema():
    # a union of scalars (a number or "auto") takes any value: it was typed `object`, refusing 0.5
    for value in (0.5, "auto"):
        job = _job(algorithm={"max_mismatch": value})
        jsonschema.validate(job, OFFLINE)
        assert validate_job(job).ok


def test_conditions_are_a_map_list_keyed_by_type():
    conditions = SCHEMA["properties"]["status"]["properties"]["conditions"]
    assert (conditions["x-kubernetes-list-type"], conditions["x-kubernetes-list-map-keys"]) == ("map", ["type"])
    assert "type" in conditions["items"]["required"]  # a map key must be required


def test_the_status_schema_types_what_the_operator_writes():
    status = SCHEMA["properties"]["status"]["properties"]
    written = {"phase", "observedGeneration", "conditions", "progress", "plan", "attempt", "failures", "podName", "restartId",
               "ignoredRestartId", "reapply", "startTime", "activeSince", "completionTime", "nextAttemptAt", "learnerStatusError"}  # fmt: skip
    assert written <= set(status)  # the CEL rules read phase, podName, reapply and restartId: they must be typed


# --- quantities ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cpu", [8, "8", "500m", "1.5", "2e3", "+1"])
def test_quantities_accept_integers_and_kubernetes_strings_in_both(cpu):
    job = _job(resources={"learner": {"cpu": cpu, "memory": 64 * 2**30}})
    jsonschema.validate(job, OFFLINE)
    check = validate_job(job)
    assert check.ok, check.errors
    assert check.spec.resources.learner.cpu == str(cpu) and check.spec.resources.learner.memory == str(64 * 2**30)


@pytest.mark.parametrize("cpu", ["1.2.3", "8 cores", "1Ki2", "", "0x10"])
def test_malformed_quantities_are_refused_by_both(cpu):
    job = _job(resources={"learner": {"cpu": cpu}})
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        jsonschema.validate(job, OFFLINE)
    assert any(e.startswith("spec.resources.learner.cpu:") for e in validate_job(job).errors)


def test_a_fraction_written_as_a_yaml_float_is_refused_by_both_naming_the_string_form():
    job = _job(resources={"learner": {"cpu": 0.5}})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(job, OFFLINE)  # the API server's int-or-string takes integers and strings only
    assert validate_job(job).errors == ["spec.resources.learner.cpu: Value error, 0.5 is not an integer: write a fraction "
                                        "as a string, e.g. '500m'"]  # fmt: skip
    assert validate_job(_job(resources={"learner": {"cpu": 8.0}})).spec.resources.learner.cpu == "8"


def test_the_root_metadata_is_what_a_structural_schema_allows():
    """The API server refuses a CRD whose root metadata says more than its type (a description included)."""
    assert SCHEMA["properties"]["metadata"] == {"type": "object"}


def test_the_operator_refuses_what_a_pod_could_not_take():
    assert validate_job(_job(resources={"learner": {"cpu": True}})).errors[0].startswith("spec.resources.learner.cpu:")
    assert validate_job(_job(resources={"learner": {"cpu": "-1"}})).errors == [
        "spec.resources.learner.cpu: Value error, '-1' is negative"
    ]


def test_integer_quantities_reach_the_pod_and_the_plan_as_kubernetes_prints_them():
    spec = validate_job(
        _job(resources={"rollout": {"gpus": 1, "cpu": 8, "memory": 2**36}, "learner": {"gpus": 1, "cpu": "0.5"}})
    ).spec
    pod = build_pod("job", "default", spec, OperatorSettings())
    kubernetes_validate.validate(pod, "1.32", strict=True)
    resources = {c["name"]: c["resources"]["limits"] for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]}
    assert resources["rollout"] == {"cpu": "8", "memory": str(2**36), "nvidia.com/gpu": "1"}
    assert resources["learner"]["cpu"] == "0.5"
    assert plan_request(spec, OperatorSettings()).roles["rollout"].memory_bytes == 2**36


# --- tolerations and affinity ----------------------------------------------------------------------

TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
AFFINITY = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
    {"weight": 50, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                       "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "orbit"}}}}]}}  # fmt: skip


def test_tolerations_and_affinity_pass_both_and_reach_the_pod_as_written():
    job = _job(tolerations=[TOLERATION], affinity=AFFINITY)
    jsonschema.validate(job, OFFLINE)
    spec = validate_job(job).spec
    pod = build_pod("job", "default", spec, OperatorSettings())
    assert pod["spec"]["tolerations"] == [TOLERATION] and pod["spec"]["affinity"] == AFFINITY
    kubernetes_validate.validate(pod, "1.32", strict=True)
    assert applied_spec(build_configmap("job", "default", spec, OperatorSettings())) == spec


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"tolerations": [{"key": "gpu", "efect": "NoSchedule"}]}, "spec.tolerations.0.efect"),
        ({"tolerations": [{"key": "gpu", "tolerationSeconds": "soon"}]}, "spec.tolerations.0.tolerationSeconds"),
        ({"tolerations": [{"key": "gpu", "operator": "Exist"}]}, "spec.tolerations.0.operator"),
        ({"affinity": {"nodeAfinity": {}}}, "spec.affinity.nodeAfinity"),
        ({"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {}}]}}},
         "spec.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution.0.topologyKey"),
        ({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 500, "preference": {}}]}}}, "spec.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution.0.weight"),
    ],
)  # fmt: skip
def test_a_bad_toleration_or_affinity_is_refused_by_both_naming_the_field(spec, field):
    job = _job(**spec)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(job, OFFLINE)
    errors = validate_job(job).errors
    assert any(e.startswith(field + ":") for e in errors), errors


def _k8s_definition(name: str) -> dict:
    return json.loads((K8S_SCHEMAS / f"{name}.json").read_text())


@pytest.mark.parametrize(
    "model, file",
    [(core_types.Toleration, "toleration-v1"), (core_types.NodeSelectorRequirement, "nodeselectorrequirement-v1"),
     (core_types.NodeSelectorTerm, "nodeselectorterm-v1"), (core_types.NodeSelector, "nodeselector-v1"),
     (core_types.PreferredSchedulingTerm, "preferredschedulingterm-v1"), (core_types.NodeAffinity, "nodeaffinity-v1"),
     (core_types.LabelSelectorRequirement, "labelselectorrequirement-meta-v1"), (core_types.LabelSelector, "labelselector-meta-v1"),
     (core_types.PodAffinityTerm, "podaffinityterm-v1"), (core_types.WeightedPodAffinityTerm, "weightedpodaffinityterm-v1"),
     (core_types.PodAffinity, "podaffinity-v1"), (core_types.PodAntiAffinity, "podantiaffinity-v1"),
     (core_types.Affinity, "affinity-v1")],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)  # fmt: skip
def test_the_core_types_have_the_fields_of_kubernetes_own_schemas(model, file):
    official = _k8s_definition(file)
    ours = model.model_json_schema()
    assert set(ours["properties"]) == set(official["properties"])
    assert set(ours.get("required", [])) == set(official.get("required", []))
    for name, prop in official["properties"].items():
        kinds = {
            t for t in ([prop["type"]] if isinstance(prop.get("type"), str) else prop.get("type", ["object"])) if t != "null"
        }
        ours_prop = ours["properties"][name]
        options = ours_prop.get("anyOf", [ours_prop])
        our_kinds = {o.get("type", "object") for o in options if o.get("type") != "null"}
        assert our_kinds == kinds, f"{model.__name__}.{name}: {our_kinds} != {kinds}"


# --- defaults and nullable --------------------------------------------------------------------------

EXAMPLES = sorted((ROOT / "examples").glob("rljob*.yaml"))


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize(
    "job",
    [*(d for p in EXAMPLES for d in _documents(p)),
     _job(data={"type": "jsonl", "path": "train.jsonl"}, base={"pvc": {"claimName": "models"}}),
     _job(algorithm={"dual_clip": None, "kl_clamp": None}, learner={"micro_batch_tokens": None}, eval={"reward": None},
          checkpoint={"uri": "s3://runs/job", "every_steps": None, "every_minutes": 5}, affinity=None),
     _job(resources={"rollout": {"cpu": 4}}, rewards=[{"function": "exact_match"}], eval={"reward": {"function": "regex"}})],
    ids=lambda j: j["metadata"]["name"],
)  # fmt: skip
def test_the_crds_defaults_give_what_the_operator_defaults(job):
    """The API server fills in the schema's defaults (and prunes nulls where null means unset): the operator
    reads the same spec from the stored object as from what the user wrote."""
    stored = _server_view(job)
    jsonschema.validate(stored, OFFLINE)
    assert validate_job(stored).spec == validate_job(job).spec
    assert validate_job(job).spec is not None


def test_defaults_validate_and_none_sits_in_the_merged_data_union():
    defaults = [(path, node) for path, node in _walk(SCHEMA) if "default" in node]
    assert len(defaults) > 100
    for _path, node in defaults:
        jsonschema.validate(node["default"], jsonschema_of(node))
    assert not [p for p, n in _walk(SPEC["properties"]["data"]) if p and "default" in n]


def test_null_is_nullable_only_where_it_means_something_else_than_unset():
    class Model(BaseModel):
        off_by_null: float | None = Field(3.0, gt=1)  # null disables it
        unset: Literal["a", "b"] | None = None  # null: left out
        tag: Literal["a", "b"] | None = "a"

    schema = Model.model_json_schema()
    out = structural(schema, {})["properties"]
    assert out["off_by_null"].get("nullable") and not out["unset"].get("nullable")
    assert out["tag"] == {"type": "string", "enum": ["a", "b", None], "nullable": True, "default": "a"}


# --- CEL rules -----------------------------------------------------------------------------------------

ENV = celpy.Environment()


def _rule(rule: dict, new: dict, old: dict | None = None) -> bool:
    program = ENV.program(ENV.compile(rule["rule"]))
    activation = {"self": celpy.json_to_cel(new), **({"oldSelf": celpy.json_to_cel(old)} if old is not None else {})}
    return bool(program.evaluate(activation))


def test_every_cel_rule_compiles_and_sits_where_crd_rules_says():
    assert SPEC["properties"]["base"]["x-kubernetes-validations"] == BASE_RULES
    assert SCHEMA["x-kubernetes-validations"] == ROOT_RULES
    for rule in [*BASE_RULES, *ROOT_RULES]:
        ENV.compile(rule["rule"])  # CELParseError otherwise
        assert rule["message"]


@pytest.mark.parametrize(
    "base",
    [{"uri": "s3://m/q"}, {"pvc": {"claimName": "models"}}, {"nodeCache": "qwen", "format": "int4"}, {},
     {"uri": "s3://m/q", "pvc": {"claimName": "models"}}, {"uri": "s3://m/q", "nodeCache": "qwen", "format": "int4"},
     {"nodeCache": "qwen"}, {"nodeCache": "qwen", "format": "hf"}, {"uri": "s3://m/q", "pvc": None}],
)  # fmt: skip
def test_the_base_rules_agree_with_the_operator(base):
    job = _server_view(_job(base=base))
    by_cel = all(_rule(rule, job["spec"]["base"]) for rule in BASE_RULES)
    assert by_cel == validate_job(job).ok == validate_job(_job(base=base)).ok


@pytest.mark.parametrize("length, ok", [(40, True), (41, False)])
def test_the_name_rule_says_what_the_operator_says(length, ok):
    job = _server_view(_job())
    job["metadata"]["name"] = "j" * length
    assert _rule(ROOT_RULES[0], job) is ok is validate_job(job).ok


def _running(job: dict, **status) -> dict:
    old = _server_view(job)
    old["status"] = {"phase": "Running", "podName": "job-0", "restartId": "", "attempt": 0, **status}
    return old


def _edit(old: dict, **spec) -> dict:
    new = copy.deepcopy(old)
    new.pop("status")
    new["spec"].update(spec)
    new = _server_view(new)
    new["status"] = old["status"]  # an update of the resource never changes its status
    return new


def _transition_ok(old: dict, new: dict) -> bool:
    return all(_rule(rule, new, old) for rule in ROOT_RULES[1:])


BIGGER = {"learner": {"gpus": 2, "cpu": "16", "memory": "128Gi"}}


@pytest.mark.parametrize(
    "status, edit, ok",
    [
        ({}, {"resources": BIGGER}, False),
        ({}, {"base": {"uri": "s3://models/other"}}, False),
        ({"phase": "Pending"}, {"base": {"uri": "s3://models/qwen", "groupSize": 64}}, False),
        ({}, {"resources": BIGGER, "restartId": "2"}, True),  # the operator restarts with the new spec
        ({}, {"resources": BIGGER, "suspend": True}, True),  # ... or suspends, and resumes with it
        ({"reapply": True}, {"resources": BIGGER}, True),  # a restart or resume is pending: the next pod takes it
        ({"phase": "Suspended"}, {"resources": BIGGER}, True),
        ({"phase": "Succeeded"}, {"resources": BIGGER}, True),
        ({"podName": None}, {"resources": BIGGER}, True),  # no pod yet
        ({}, {"base": {"uri": "s3://models/qwen", "architecture": "deepseek-v3"}}, True),  # planner-only
        ({}, {"base": {"uri": "s3://models/qwen", "format": "hf", "groupSize": 128}}, True),  # the defaults, written out
        ({}, {"resources": {"rollout": {"gpus": 1, "cpu": "8", "memory": "64Gi"}}}, True),  # ditto
        ({}, {"resources": {"rollout": {"gpus": 1, "cpu": 8, "memory": "64Gi"}}}, True),  # 8 re-applied as "8": no change
        ({"phase": "Queued"}, {"resources": BIGGER}, False),  # evicted by Kueue, its pod name kept: the same pod again
        ({}, {"rollout": {"max_tokens": 32}}, True),  # refused by the operator alone (SpecChangeRefused)
        ({}, {"suspend": False, "backoffLimit": 7}, True),  # lifecycle fields
    ],
)  # fmt: skip
def test_the_running_rules_refuse_only_what_the_operator_refuses(status, edit, ok):
    old = _running(_job(), **status)
    if status.get("podName", "x") is None:
        old["status"].pop("podName")
    new = _edit(old, **edit)
    assert _transition_ok(old, new) is ok
    if not ok:  # never refuse what the operator would take: it refuses the same change while it runs
        applied, spec = validate_job(old).spec, validate_job(new).spec
        assert spec is not None and refused_changes(applied, spec)


def test_a_status_update_passes_the_running_rules():
    old = _running(_job(resources=BIGGER))
    new = copy.deepcopy(old)
    new["status"].update(phase="Succeeded", podName="job-1")
    assert _transition_ok(old, new)


# --- the chart and the applied spec of an older operator -------------------------------------------


def test_the_chart_needs_kubernetes_with_native_sidecars():
    assert helm.Chart.load(ROOT / "charts" / "orbit").metadata["kubeVersion"] == ">=1.29.0-0"


def test_an_older_operators_applied_spec_still_parses():
    """configmap-applied-spec-v0.json: written by the operator at 0980511 (no version key) for the job in
    rljob-applied-spec.yaml; this operator reads the same spec from it."""
    configmap = json.loads((FIXTURES / "configmap-applied-spec-v0.json").read_text())
    assert APPLIED_SPEC_VERSION_FILE not in configmap["data"]
    job = yaml.safe_load((FIXTURES / "rljob-applied-spec.yaml").read_text())
    expected = validate_job(job).spec
    assert expected is not None and applied_spec(configmap) == expected
    assert refused_changes(applied_spec(configmap), expected) == []


def test_the_applied_spec_carries_its_version():
    spec = validate_job(_job()).spec
    configmap = build_configmap("job", "default", spec, OperatorSettings())
    assert configmap["data"][APPLIED_SPEC_VERSION_FILE] == str(APPLIED_SPEC_VERSION) == "1"
    assert applied_spec(configmap) == spec
    newer = {**configmap, "data": {**configmap["data"], APPLIED_SPEC_VERSION_FILE: "99"}}
    assert applied_spec(newer) is None  # a format this operator does not know is not guessed at


def test_every_status_the_planners_tests_produce_is_valid_against_the_status_schema(monkeypatch):
    """A typed status is refused whole (422) when one field is wrong: run the planner's tests with a plan() that
    checks each status it returns against the CRD's status schema (as the API server would, Strict)."""
    import inspect

    from orbit_operator import reconcile
    from tests.unit import test_operator_controller, test_operator_reconcile

    checker = jsonschema_of(SCHEMA["properties"]["status"])
    checked = []

    def checked_plan(observed, settings):
        decided = reconcile.plan(observed, settings)
        jsonschema.validate({k: v for k, v in decided.status.items() if not k.startswith("kopf")}, checker)
        checked.append(decided.status.get("phase"))
        return decided

    for module in (test_operator_reconcile, test_operator_controller):
        monkeypatch.setattr(module, "plan", checked_plan)
        for name, test in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("test_") and test.__module__ == module.__name__ and not inspect.signature(test).parameters:
                test()
    assert len(checked) > 50 and {"Pending", "Running", "Succeeded", "Failed", "Suspended"} <= set(checked)
