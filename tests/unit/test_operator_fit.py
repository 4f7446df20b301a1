"""The operator's fit decisions (reconcile.plan with orbit_operator.fit), without a cluster: refused at
admission with DoesNotFit, the plan's summary in status, prepare-base's verdict, and never a
refusal once the job has started."""

from __future__ import annotations

import copy
import json
from datetime import datetime

from orbit_operator.fit import node_spec, plan_request
from orbit_operator.reconcile import Observed, plan
from orbit_operator.settings import OperatorSettings
from orbit_operator.validation import validate_job
from tests.unit.test_operator_reconcile import JOB, configmap, pod

T0 = datetime(2026, 12, 1, 12, 0, 0)
SETTINGS = OperatorSettings()


def gpu_job(architecture: str = "deepseek-v3", product: str | None = "NVIDIA-H200", gpus: int = 4, status=None, **spec) -> dict:
    """A GPU job naming its architecture: rollout and learner 4 GPUs each, 2,048-token sequences."""
    out = copy.deepcopy(JOB)
    out["spec"].update({
        "base": {"format": "int4", "nodeCache": "big", "architecture": architecture},
        "model": {"dtype": "bf16"}, "learner": {"device": "cuda"},
        "rollout": {"group_size": 8, "prompts_per_step": 16, "max_tokens": 1024, "max_model_len": 2048, "tensor_parallel_size": gpus},
        "resources": {"rollout": {"gpus": gpus, "cpu": "8", "memory": "1500Gi"}, "learner": {"gpus": gpus, "cpu": "8", "memory": "1500Gi"}},
        **({"nodeSelector": {"nvidia.com/gpu.product": product}} if product else {}), **spec,
    })  # fmt: skip
    if status is not None:
        out["status"] = status
    return out


def condition(status: dict, type_: str) -> dict:
    return next(c for c in status.get("conditions", []) if c["type"] == type_)


def prepare_base_command(decided) -> list[str]:
    return decided.create_pod["spec"]["initContainers"][0]["command"]


def test_a_job_that_cannot_fit_is_refused_before_any_pod_naming_what_binds():
    decided = plan(Observed(gpu_job(), [], None, T0), SETTINGS)
    assert decided.create_pod is None and decided.create_configmap is None
    assert decided.status["phase"] == "Failed" and decided.status["completionTime"]
    failed = condition(decided.status, "Failed")
    assert failed["reason"] == "DoesNotFit"
    # today's learner: the whole INT4 base (321.3 GiB) on one H200 (133.4 GiB usable), with its activations and logits
    assert "learner on 1 x H200 needs 353.8 GiB of 133.4 GiB (base_int4 321.3, activations 25.7, base_16bit 3.7, logits 1.5" in failed["message"]
    assert ("Warning", "DoesNotFit", failed["message"]) in decided.events
    assert decided.status["plan"].startswith("does not fit: rollout 4xH200")
    # the next reconcile (no edit: not planned again): still refused, no event posted again
    again = plan(Observed(gpu_job(status=decided.status), [], None, T0), SETTINGS)
    assert again.create_pod is None and again.status["phase"] == "Failed" and not again.events
    # an edit that still does not fit: planned again, refused again, announced once more only if the verdict changed
    edited = gpu_job(status=decided.status, adapter={"rank": 16, "alpha": 32})
    edited["metadata"]["generation"] = 2
    still = plan(Observed(edited, [], None, T0), SETTINGS)
    assert still.status["phase"] == "Failed" and not [e for e in still.events if e[1] == "Failed"]  # no "New -> Failed"
    assert [e[1] for e in still.events] == ["DoesNotFit"]  # the breakdown changed (another adapter)


def test_fixing_a_refused_job_starts_it_with_the_plan_in_status():
    refused = plan(Observed(gpu_job(), [], None, T0), SETTINGS)
    edited = gpu_job("qwen3-8b", gpus=1, status=refused.status)
    edited["metadata"]["generation"] = 2  # the API server counts the spec change
    fixed = plan(Observed(edited, [], None, T0), SETTINGS)
    assert fixed.create_pod is not None and fixed.status["phase"] == "Pending"
    assert not [c for c in fixed.status["conditions"] if c["type"] == "Failed"] and "completionTime" not in fixed.status
    assert fixed.status["plan"].startswith("fits: rollout 1xH200")


def test_the_first_pod_plans_again_with_the_base_and_later_pods_never_refuse():
    job = gpu_job("qwen3-8b", gpus=1)
    first = plan(Observed(job, [], None, T0), SETTINGS)
    assert "--enforce-fit" in prepare_base_command(first)
    assert prepare_base_command(first)[prepare_base_command(first).index("--plan") + 1] == "/etc/orbit/plan.json"
    spec = validate_job(job).spec
    assert json.loads(first.create_configmap["data"]["plan.json"]) == json.loads(plan_request(spec, SETTINGS).model_dump_json())
    # the pod failed after prepare-base passed (the learner crashed): the replacement never refuses the job
    crashed = pod("quickstart-cpu-0", "Failed", containerStatuses=[
        {"name": "learner", "state": {"terminated": {"exitCode": 1, "reason": "Error", "message": "boom"}}}])  # fmt: skip
    running = {**first.status, "phase": "Running"}
    retry = plan(Observed(gpu_job("qwen3-8b", gpus=1, status=running), [crashed], configmap(job), T0), SETTINGS)
    assert retry.status["phase"] == "Pending" and retry.status["failures"] == 1
    later = plan(Observed(gpu_job("qwen3-8b", gpus=1, status=retry.status), [crashed], configmap(job), T0.replace(hour=13)), SETTINGS)
    assert later.create_pod is not None and "--enforce-fit" not in prepare_base_command(later)


def test_prepare_base_does_not_fit_ends_the_job_without_retries():
    job = gpu_job("qwen3-8b", gpus=1)
    first = plan(Observed(job, [], None, T0), SETTINGS)
    report = {"reason": "DoesNotFit", "message": "learner container (host memory to load the base) needs 9 GiB of 4 GiB",
              "plan": "does not fit: learner host 9.0/4.0 GiB"}  # fmt: skip
    refused = pod("quickstart-cpu-0", "Failed", initContainerStatuses=[
        {"name": "prepare-base", "state": {"terminated": {"exitCode": 3, "reason": "Error", "message": json.dumps(report)}}}])  # fmt: skip
    decided = plan(Observed(gpu_job("qwen3-8b", gpus=1, status=first.status), [refused], configmap(job), T0), SETTINGS)
    assert decided.status["phase"] == "Failed" and decided.create_pod is None and decided.status.get("failures", 0) == 0
    failed = condition(decided.status, "Failed")
    assert failed["reason"] == "DoesNotFit" and failed["message"] == report["message"]
    assert decided.status["plan"] == report["plan"] and ("Warning", "DoesNotFit", report["message"]) in decided.events
    again = plan(Observed(gpu_job("qwen3-8b", gpus=1, status=decided.status), [refused], configmap(job), T0), SETTINGS)
    assert again.status["phase"] == "Failed" and again.create_pod is None and not again.events  # no edit: it stays refused
    # the learner never ran: an edit (more memory) starts it, with a new pod built from the edited spec that plans again
    edited = gpu_job("qwen3-8b", gpus=1, status=decided.status,
                     resources={"rollout": {"gpus": 1, "memory": "1500Gi"}, "learner": {"gpus": 1, "memory": "1600Gi"}})  # fmt: skip
    edited["metadata"]["generation"] = 2
    fixed = plan(Observed(edited, [refused], configmap(job), T0), SETTINGS)
    assert fixed.create_pod["metadata"]["name"] == "quickstart-cpu-1" and "--enforce-fit" in prepare_base_command(fixed)
    learner = fixed.create_pod["spec"]["containers"][0]
    assert learner["resources"]["limits"]["memory"] == "1600Gi"  # the edit, not the spec the refused pod was built from
    assert json.loads(fixed.create_configmap["data"]["plan.json"])["roles"]["learner"]["memory_bytes"] == 1600 * 2**30
    assert not [c for c in fixed.status["conditions"] if c["type"] == "Failed"] and fixed.status["phase"] == "Pending"


def test_a_running_job_is_never_refused_by_a_stricter_plan():
    """An operator upgrade (or a new setting) that plans the job as too big must not fail it once it runs."""
    job = gpu_job("qwen3-8b", gpus=1)
    first = plan(Observed(job, [], None, T0), SETTINGS)
    status = {**first.status, "phase": "Running"}
    report = {"plan": "fits: rollout 1xH200 29.0/133.4 GiB"}
    running = pod("quickstart-cpu-0", "Running", podIP="10.0.0.7", initContainerStatuses=[
        {"name": "prepare-base", "state": {"terminated": {"exitCode": 0, "reason": "Completed", "message": json.dumps(report)}}}])  # fmt: skip
    stricter = gpu_job("deepseek-v3", gpus=1, status=status)  # now names a model that cannot fit, while it runs
    decided = plan(Observed(stricter, [running], configmap(job), T0), SETTINGS)
    assert decided.status["phase"] == "Running" and not [c for c in decided.status["conditions"] if c["type"] == "Failed"]
    # the architecture only feeds the plan: changing it while the job runs is no refused spec change
    assert not [c for c in decided.status["conditions"] if c["type"] == "SpecChangeRefused"]
    assert decided.status["plan"] == report["plan"]  # what prepare-base found with the real base


def test_the_node_gpu_comes_from_the_node_selector_or_the_operator_and_is_never_guessed():
    spec = validate_job(gpu_job(product=None)).spec
    assert node_spec(spec, SETTINGS).gpu is None and node_spec(spec, SETTINGS).gpu_memory_bytes is None
    assert node_spec(spec, OperatorSettings(node_gpu="B200")).gpu == "B200"
    assert node_spec(spec, OperatorSettings(node_gpu_memory_gib=96)).gpu_memory_bytes == 96 * 2**30
    assert node_spec(validate_job(gpu_job()).spec, OperatorSettings(node_gpu="B200")).gpu == "H200"  # the job's selector wins
    mig = validate_job(gpu_job(product="NVIDIA-A100-SXM4-80GB-MIG-1g.10gb")).spec
    assert node_spec(mig, SETTINGS).gpu is None  # a MIG slice is no whole GPU of the table
    # GPU memory unknown: only the containers' host memory is judged (the learner loads the base through it)
    unknown = plan(Observed(gpu_job(product=None, resources={"rollout": {"gpus": 4, "memory": "1500Gi"},
                                                             "learner": {"gpus": 4, "memory": "64Gi"}}), [], None, T0), SETTINGS)  # fmt: skip
    assert unknown.status["phase"] == "Failed"
    assert "learner container (host memory to load the base) needs 327.9 GiB of 64.0 GiB" in condition(unknown.status, "Failed")["message"]
    fits_host = plan(Observed(gpu_job(product=None), [], None, T0), SETTINGS)
    assert fits_host.create_pod is not None and "GPU memory unknown for rollout, learner" in fits_host.status["plan"]
    judged = plan(Observed(gpu_job(product=None), [], None, T0), OperatorSettings(node_gpu="H200"))
    assert judged.create_pod is None and condition(judged.status, "Failed")["reason"] == "DoesNotFit"


def test_a_job_naming_no_architecture_is_planned_by_its_prepare_base_only():
    decided = plan(Observed(copy.deepcopy(JOB), [], None, T0), SETTINGS)
    assert decided.create_pod is not None and "plan" not in decided.status
    assert "--enforce-fit" in prepare_base_command(decided) and "plan.json" in decided.create_configmap["data"]


def test_quantities_are_read_as_the_kubernetes_client_reads_them():
    from kubernetes.utils import parse_quantity as kubernetes_parse

    from orbit_operator.quantity import parse_quantity

    for text in ("64Gi", "500M", "1.5e9", "250m", "8", "1.5Gi", "0.5Ki", "12E", "3e-3", "+4k", ".5G", "7Ti", "2E3"):
        assert parse_quantity(text) == kubernetes_parse(text), text
    for bad in ("1Q", "Gi", "1..2", ""):
        try:
            parse_quantity(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")


def test_memory_under_one_mebibyte_is_refused_naming_the_field():
    bad = copy.deepcopy(JOB)
    bad["spec"]["resources"]["learner"]["memory"] = "500m"
    check = validate_job(bad)
    assert not check.ok and any("spec.resources.learner.memory" in e and "less than 1Mi" in e for e in check.errors), check.errors


def test_the_configmap_never_fails_because_of_the_planner():
    """A setting the planner cannot take (a node of 2,000 GPUs) leaves plan.json out: prepare-base then warns."""
    from orbit_operator.pod import build_configmap

    spec = validate_job(gpu_job("qwen3-8b", gpus=1)).spec
    data = build_configmap("j", "default", spec, OperatorSettings(max_gpus_per_node=2000))["data"]
    assert "plan.json" not in data and "job.yaml" in data
    assert "plan.json" in build_configmap("j", "default", spec, SETTINGS)["data"]

