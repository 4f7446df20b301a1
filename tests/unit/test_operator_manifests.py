"""What the operator builds and accepts, without a cluster: the CRD generated from the job
spec (and not drifted from the checked-in file), the pod and ConfigMap (valid Kubernetes,
strict), the examples, and the rejection of malformed or hostile manifests by the same
check `orbit validate` and the operator use."""

import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from orbit_operator.crd import PRINTER_COLUMNS, crd_manifest, crd_yaml, jsonschema_of
from orbit_operator.job_spec import RLTrainingJobSpec
from orbit_operator.pod import BASE_MOUNT, build_configmap, build_pod
from orbit_operator.settings import OperatorSettings
from orbit_operator.validation import ManifestError, read_documents, validate_job
from orbit_runtime.cli import app
from orbit_runtime.role_commands import http_url

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "charts" / "orbit" / "crds" / "rltrainingjob.yaml"
JOB_EXAMPLES = sorted((ROOT / "examples").glob("rljob*.yaml"))
K8S_VERSION = "1.32"  # the kubectl client here; the sidecar restartPolicy is stable since 1.29


def _example(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


def test_checked_in_crd_is_generated_from_the_spec():
    assert CRD_FILE.read_text() == crd_yaml(), "the CRD drifted from RLTrainingJobSpec: run `orbit crd --out " + str(
        CRD_FILE.relative_to(ROOT)
    ) + "`"


def test_crd_names_scope_status_and_printer_columns():
    crd = crd_manifest()
    # the CRD object itself (not the structural-schema rules, which need a real API server)
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
    assert crd["metadata"]["name"] == "rltrainingjobs.orbit.dev"
    version = crd["spec"]["versions"][0]
    assert (crd["spec"]["scope"], version["name"], crd["spec"]["names"]["shortNames"]) == ("Namespaced", "v1alpha1", ["rljob"])
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Phase", "Step", "Reward", "Held-out", "Age"]


def _structural_problems(node: dict, path: str = "spec") -> list[str]:
    """The apiextensions/v1 structural-schema rules a real API server enforces (no server runs here)."""
    problems = []
    for banned in ("$ref", "anyOf", "oneOf", "allOf", "not", "definitions", "$defs", "title"):
        if banned in node:
            problems.append(f"{path}: {banned}")
    if "type" not in node and not node.get("x-kubernetes-preserve-unknown-fields") and not node.get("x-kubernetes-int-or-string"):
        problems.append(f"{path}: no type")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: properties and additionalProperties together")
    if node.get("type") not in (None, "object", "array", "string", "integer", "number", "boolean"):
        problems.append(f"{path}: type {node.get('type')!r}")
    if "enum" in node and None in node["enum"] and not node.get("nullable"):
        problems.append(f"{path}: null in enum without nullable")
    for name, child in (node.get("properties") or {}).items():
        problems += _structural_problems(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            problems += _structural_problems(node[key], f"{path}[{key}]")
    return problems


def test_the_spec_schema_is_structural():
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _structural_problems(schema, "root") == []
    # (none today: a null default is not nullable, see test_operator_crd.py's nullable cases)
    assert all(None in n["enum"] for _, n in _walk(schema) if n.get("nullable") and "enum" in n)


def _walk(node: dict, path: str = ""):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _walk(node[key], f"{path}[{key}]")


def _json_path(document: dict, path: str):
    value = document
    for part in path.strip(".").split("."):
        value = value[part]
    return value


def test_printer_columns_resolve_on_a_real_status():
    from orbit_operator.learner_report import parse_learner_report
    from orbit_runtime.trainer.recorder import RunState, status_document

    state = RunState(step=7, adapter_version=7, rows=[{"kind": "step", "step": 7, "reward_mean": 0.5},
                                                       {"kind": "eval", "step": 5, "accuracy": 0.25, "accuracy_stderr": 0.08,
                                                        "examples": 30}])  # fmt: skip
    learner = status_document(state, phase="running", max_steps=20, checkpoint_uri="s3://b/p", last_checkpoint_step=5,
                              restarts={"rollout": 0, "reference": 0})  # fmt: skip
    job = {"metadata": {"creationTimestamp": "2026-11-30T00:00:00Z"},
           "status": {"phase": "Running", "progress": parse_learner_report(learner)[0].progress()}}  # fmt: skip
    values = {c["name"]: _json_path(job, c["jsonPath"]) for c in PRINTER_COLUMNS}
    assert values == {"Phase": "Running", "Step": "7/20", "Reward": 0.5, "Held-out": 0.25, "Age": "2026-11-30T00:00:00Z"}
    assert job["status"]["progress"]["heldoutStderr"] == 0.08 and job["status"]["progress"]["heldoutPrompts"] == 30
    assert parse_learner_report(learner)[1] is None  # the learner's own document parses whole
    status_schema = jsonschema_of(crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"])
    jsonschema.validate(job["status"], status_schema)


@pytest.mark.parametrize("path", JOB_EXAMPLES, ids=lambda p: p.name)
def test_example_jobs_validate_against_the_crd_schema_and_the_operator(path):
    schema = jsonschema_of(crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    for document in read_documents(path.read_text(), str(path)):
        jsonschema.validate(document, schema)
        check = validate_job(document, str(path))
        assert check.ok, check.errors


def test_the_crd_schema_catches_what_it_can_express():
    schema = jsonschema_of(crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    job = _example("rljob-cpu.yaml")
    job["spec"]["rollout"]["max_tokens"] = 0
    with pytest.raises(jsonschema.ValidationError, match="minimum"):
        jsonschema.validate(job, schema)


@pytest.mark.parametrize("example", ["rljob.yaml", "rljob-cpu.yaml"])
def test_pod_and_configmap_are_strictly_valid_kubernetes(example):
    spec = validate_job(_example(example)).spec
    settings = OperatorSettings()
    for manifest in (build_pod("job", "default", spec, settings, attempt=2), build_configmap("job", "default", spec, settings)):
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_pod_layout_mounts_security_and_resources():
    spec = validate_job(_example("rljob.yaml")).spec
    settings = OperatorSettings(cache_root="/mnt/orbit-cache")
    pod = build_pod("qwen", "ml", spec, settings, attempt=1)
    assert pod["metadata"]["name"] == "qwen-1" and pod["metadata"]["labels"]["team"] == "rl"  # spec.podLabels
    body = pod["spec"]
    init, rollout, reference = body["initContainers"]
    (learner,) = body["containers"]
    assert [c["name"] for c in (init, rollout, reference, learner)] == ["prepare-base", "rollout", "reference", "learner"]
    assert init["command"][:2] == ["orbit", "prepare-base"] and "restartPolicy" not in init
    assert rollout["restartPolicy"] == reference["restartPolicy"] == "Always"  # native sidecars
    assert body["restartPolicy"] == "Never"  # a failed learner fails the pod; the operator resumes in a new one
    assert [learner["command"][1], rollout["command"][1], reference["command"][1]] == ["learner", "rollout", "reference"]
    assert reference["command"][-2:] == ["--device", "cuda"]  # its own GPU (resources.reference.gpus: 1)
    assert learner["command"][-4:-2] == ["--wait-seconds", "2100"]  # longer than a role's startup probe
    assert learner["command"][-2:] == ["--termination-log", learner["terminationMessagePath"]]  # the final /status ...
    assert learner["terminationMessagePolicy"] == "FallbackToLogsOnError"  # ... or, on failure, the end of its log
    for container in (rollout, reference, learner):  # every role binds to the pod IP, and finds the others there
        assert container["command"][3:5] == ["--host", "$(ORBIT_POD_IP)"]
        assert container["env"][0] == {"name": "ORBIT_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        assert not [e for e in container["env"] if e["name"].endswith("_URL")]  # the learner derives them from --host
    assert http_url("10.1.2.3", 8000) == "http://10.1.2.3:8000" and http_url("fd00::5", 8001) == "http://[fd00::5]:8001"
    shared = build_pod("cpu", "ml", validate_job(_example("rljob-cpu.yaml")).spec, settings)
    assert [c["name"] for c in shared["spec"]["initContainers"]] == ["prepare-base", "rollout"]  # shared reference: no container
    host = {v["name"]: v for v in body["volumes"]}["base-cache"]["hostPath"]
    assert host["path"] == "/mnt/orbit-cache"  # the operator's root, never the job's
    for container in (rollout, reference, learner):
        base = [m for m in container["volumeMounts"] if m["mountPath"] == BASE_MOUNT]
        assert base and base[0]["readOnly"] is True and re.fullmatch(r"base-[0-9a-f]{20}/model", base[0]["subPath"])
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["startupProbe"]["httpGet"]["path"] == ("/health" if container["name"] == "rollout" else "/healthz")
        assert container["ports"][0]["name"] == container["name"]
    cache = [m for m in init["volumeMounts"] if m["name"] == "base-cache"]
    assert cache and not cache[0].get("readOnly")  # only prepare-base writes the cache ...
    assert cache[0]["subPath"] + "/model" == base[0]["subPath"]  # ... and only this job's directory of it
    data = [m for m in learner["volumeMounts"] if m["name"] == "base-source"]
    assert data == [{"name": "base-source", "mountPath": "/data", "readOnly": True}]  # file data, read-only
    adapters = {c["name"]: m for c in (rollout, learner) for m in c["volumeMounts"] if m["name"] == "adapters"}
    assert adapters["rollout"]["readOnly"] is True and not adapters["learner"].get("readOnly")
    assert learner["envFrom"] == [{"secretRef": {"name": "orbit-s3"}}]
    assert all("envFrom" not in c for c in (init, rollout, reference))  # credentials reach the learner only
    assert rollout["resources"]["limits"]["nvidia.com/gpu"] == "4" and learner["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert body["securityContext"]["runAsNonRoot"] is True and body["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert body["automountServiceAccountToken"] is False
    assert body["tolerations"][0]["key"] == "nvidia.com/gpu" and body["priorityClassName"] == "rl-training"


def test_image_overrides_need_the_operators_permission():
    job = _example("rljob-cpu.yaml")
    job["spec"]["resources"]["learner"]["image"] = "evil/exfiltrate:latest"
    check = validate_job(job)
    assert not check.ok and "spec.resources.learner.image: image overrides are disabled" in check.errors[0]
    assert validate_job(job, allow_image_override=True).ok


def test_configmap_holds_the_runtime_config_the_learner_reads():
    spec = validate_job(_example("rljob-cpu.yaml")).spec
    config = yaml.safe_load(build_configmap("quickstart-cpu", "default", spec, OperatorSettings())["data"]["job.yaml"])
    from orbit_runtime.config import parse_job_spec

    runtime = parse_job_spec(config)
    assert runtime.model.path == BASE_MOUNT and runtime.checkpoint.uri == "s3://orbit-test/quickstart-cpu"
    assert "credentialsSecret" not in config["checkpoint"] and runtime.metrics.port == 9400


def test_the_base_cache_directory_is_derived_never_taken_from_the_job():
    a = RLTrainingJobSpec.model_validate({"base": {"uri": "s3://models/a"}})
    b = RLTrainingJobSpec.model_validate({"base": {"uri": "s3://models/b"}})
    from orbit_operator.pod import base_cache_dir

    assert base_cache_dir(a, "team-a") != base_cache_dir(b, "team-a") and base_cache_dir(a, "team-a") == base_cache_dir(a.model_copy(), "team-a")
    assert base_cache_dir(a, "team-a") != base_cache_dir(a, "team-b")  # another namespace never shares a copy
    assert re.fullmatch(r"base-[0-9a-f]{20}", base_cache_dir(a, "team-a"))
    named = RLTrainingJobSpec.model_validate({"base": {"format": "int4", "nodeCache": "demo"}})
    assert base_cache_dir(named, "team-a") == "named/demo"


GOOD = _example("rljob-cpu.yaml")


def _job(**spec_changes) -> dict:
    import copy

    job = copy.deepcopy(GOOD)
    for dotted, value in spec_changes.items():
        node = job["spec"]
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    return job


DELETE = object()

# (manifest, the field the message must name)
BAD_JOBS = {
    "wrong type: max_tokens": (_job(rollout__max_tokens="many"), "spec.rollout.max_tokens"),
    "zero group": (_job(rollout__group_size=0), "spec.rollout.group_size"),
    "negative lr": (_job(schedule__learning_rate=-1.0), "spec.schedule.learning_rate"),
    "huge steps type": (_job(schedule__steps=10**30 * 1.5), "spec.schedule.steps"),
    "unknown top-level field": (_job(replicas=3), "spec.replicas"),
    "unknown nested field": (_job(rollout__temprature=0.7), "spec.rollout.temprature"),
    "missing base": (_job(base=DELETE), "spec.base"),
    "two base sources": (_job(base={"format": "int4", "nodeCache": "demo", "uri": "s3://m/x"}), "spec.base"),
    "nodeCache as a path": (_job(base={"format": "int4", "nodeCache": "../../etc"}), "spec.base.nodeCache"),
    "nodeCache absolute": (_job(base={"format": "int4", "nodeCache": "/var/lib"}), "spec.base.nodeCache"),
    "pvc subPath escape": (_job(base={"pvc": {"claimName": "models", "subPath": "../../../etc"}}), "spec.base.pvc.subPath"),
    "pvc subPath absolute": (_job(base={"pvc": {"claimName": "models", "subPath": "/etc/shadow"}}), "spec.base.pvc.subPath"),
    "pvc name not a name": (_job(base={"pvc": {"claimName": "Models/x"}}), "spec.base.pvc.claimName"),
    "base uri file": (_job(base={"uri": "file:///etc"}), "spec.base.uri"),
    "base uri http": (_job(base={"uri": "http://example.com/model"}), "spec.base.uri"),
    "bad group size": (_job(base={"uri": "s3://m/x", "groupSize": 100}), "spec.base.groupSize"),
    "checkpoint on local disk": (_job(checkpoint__uri="file:///tmp/ckpt"), "spec.checkpoint.uri"),
    "checkpoint bad uri": (_job(checkpoint__uri="s3://"), "spec.checkpoint.uri"),
    "data path escape": (_job(data={"type": "jsonl", "path": "../../etc/passwd"}, base={"pvc": {"claimName": "m"}}),
                         "spec.data.path"),  # fmt: skip
    "data path absolute": (_job(data={"type": "jsonl", "path": "/etc/passwd"}, base={"pvc": {"claimName": "m"}}), "spec.data.path"),
    "output dir set": (_job(run__output_dir="/host/etc"), "spec.run.output_dir"),
    "gpus over the node": (_job(resources={"rollout": {"gpus": 6}, "learner": {"gpus": 4}}), "resources"),
    "gpus negative": (_job(resources={"learner": {"gpus": -1}}), "spec.resources.learner.gpus"),
    "gpus huge": (_job(resources={"learner": {"gpus": 10**6}}), "spec.resources.learner.gpus"),
    "memory not a quantity": (_job(resources={"learner": {"memory": "lots"}}), "spec.resources.learner.memory"),
    "tensor parallel over gpus": (_job(rollout__tensor_parallel_size=4), "rollout.tensor_parallel_size"),
    "backoff negative": (_job(backoffLimit=-1), "spec.backoffLimit"),
    "deadline zero": (_job(activeDeadlineSeconds=0), "spec.activeDeadlineSeconds"),
    "label key invalid": (_job(podLabels={"bad key!": "x"}), "spec.podLabels"),
    "label value invalid": (_job(podLabels={"team": "a" * 64}), "spec.podLabels"),
    "spec is a list": ({**GOOD, "spec": [1, 2]}, "spec"),
    "wrong kind": ({**GOOD, "kind": "Pod"}, "kind"),
    "wrong apiVersion": ({**GOOD, "apiVersion": "orbit.dev/v9"}, "apiVersion"),
    "name with slash": ({**GOOD, "metadata": {"name": "a/b"}}, "metadata.name"),
    "name too long": ({**GOOD, "metadata": {"name": "x" * 64}}, "metadata.name"),
    "no metadata": ({k: v for k, v in GOOD.items() if k != "metadata"}, "metadata"),
    "top_p truncation": (_job(rollout__top_p=0.9), "spec.rollout.top_p"),
    "minibatches over samples": (_job(algorithm={"minibatches": 1000}), "algorithm.minibatches"),
    "canary not a format": (_job(sync={"canary_completion": "{oops"}), "spec.sync.canary_completion"),
    "model path given": (_job(model={"path": "/host/models"}), "spec.model.path"),
}


@pytest.mark.parametrize("case", sorted(BAD_JOBS))
def test_malformed_jobs_are_rejected_naming_the_field(case):
    manifest, field = BAD_JOBS[case]
    check = validate_job(manifest, "test")
    assert not check.ok
    assert any(field in error for error in check.errors), check.errors


def test_there_are_at_least_thirty_bad_jobs():
    assert len(BAD_JOBS) >= 30


HOSTILE_FILES = {
    "alias bomb": ("a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n", "aliases"),
    "python tag": ("!!python/object/apply:os.system ['true']\n", "not valid YAML"),
    "deep nesting": ("spec: " + "[" * 200 + "]" * 200 + "\n", "nested deeper"),
    "huge file": ("# " + "x" * (2 << 20) + "\n", "more than"),
    "not yaml": ("spec: [unclosed\n", "not valid YAML"),
    "binary": (b"\xff\xfe\x00bad", "not UTF-8"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_FILES))
def test_hostile_yaml_is_refused_before_validation(case):
    text, message = HOSTILE_FILES[case]
    with pytest.raises(ManifestError, match=message):
        read_documents(text, "hostile.yaml")


def test_orbit_validate_checks_every_document_and_exits_1_naming_fields(tmp_path):
    good = yaml.safe_dump(GOOD)
    bad = yaml.safe_dump(BAD_JOBS["pvc subPath escape"][0])
    path = tmp_path / "jobs.yaml"
    path.write_text(good + "---\n" + bad)
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 1
    assert "document 1 (RLTrainingJob quickstart-cpu): valid" in result.output
    assert "document 2" in result.output and "spec.base.pvc.subPath" in result.output
    assert "Traceback" not in result.output
    for case, (text, _) in HOSTILE_FILES.items():
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        result = CliRunner().invoke(app, ["validate", str(path)])
        assert result.exit_code == 1, (case, result.output)
        assert "Traceback" not in result.output and "error:" in result.output, case
    path.write_text(good)
    assert CliRunner().invoke(app, ["validate", str(path)]).exit_code == 0


def test_the_trackers_credentials_reach_the_learner_only_and_never_the_configmap():
    """run.trackingSecret (W&B / MLflow credentials): an envFrom of the learner beside the S3 Secret; the
    runtime config keeps the trackers and their URI, not the Secret's name."""
    job = _example("rljob-cpu.yaml")
    job["spec"]["run"] = {**job["spec"].get("run", {}), "report_to": ["mlflow", "wandb"], "trackingSecret": "trackers",
                          "tracking": {"mlflow_tracking_uri": "http://mlflow.ml:5000"}}  # fmt: skip
    check = validate_job(job)
    assert check.ok, check.errors
    pod = build_pod("job", "default", check.spec, OperatorSettings(), attempt=1)
    containers = {c["name"]: c for c in pod["spec"]["initContainers"] + pod["spec"]["containers"]}
    assert [e["secretRef"]["name"] for e in containers["learner"]["envFrom"]] == [job["spec"]["checkpoint"]["credentialsSecret"], "trackers"]
    assert all("trackers" not in str(c.get("envFrom")) for name, c in containers.items() if name != "learner")
    config = yaml.safe_load(build_configmap("job", "default", check.spec, OperatorSettings())["data"]["job.yaml"])
    assert config["run"]["report_to"] == ["mlflow", "wandb"] and "trackingSecret" not in config["run"]
    assert config["run"]["tracking"]["mlflow_tracking_uri"] == "http://mlflow.ml:5000"
    job["spec"]["run"]["trackingSecret"] = "Not_A_Name"
    assert not validate_job(job).ok
