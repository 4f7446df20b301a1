"""The operator's decisions (reconcile.plan) for every lifecycle situation, without a cluster."""

import copy
from datetime import datetime, timedelta
from pathlib import Path

import yaml

from orbit_operator.pod import build_configmap, owner_reference
from orbit_operator.reconcile import Observed, plan
from orbit_operator.settings import OperatorSettings
from orbit_operator.status import learner_final_status
from orbit_operator.validation import validate_job

ROOT = Path(__file__).resolve().parents[2]
JOB = yaml.safe_load((ROOT / "examples" / "rljob-cpu.yaml").read_text())
JOB["metadata"].update(namespace="default", uid="u-1", generation=1)
SETTINGS = OperatorSettings()
T0 = datetime(2026, 11, 30, 12, 0, 0)


def job(status=None, **spec):
    out = copy.deepcopy(JOB)
    out["spec"].update(spec)
    if status is not None:
        out["status"] = status
    return out


OWNER = owner_reference("quickstart-cpu", "u-1")  # what the handlers put on every object of the job


def pod(name, phase, owner=OWNER, **status):
    """A pod of the job (its controller: the job of uid u-1), as the kubelet reports it."""
    labels = {"orbit.dev/job": "quickstart-cpu", "orbit.dev/attempt": name.rsplit("-", 1)[1]}
    return {"metadata": {"name": name, "labels": labels, "ownerReferences": [owner] if owner else []},
            "status": {"phase": phase, **status}}  # fmt: skip


def configmap(of_job, owner=OWNER):
    made = build_configmap("quickstart-cpu", "default", validate_job(of_job).spec, SETTINGS)
    made["metadata"]["ownerReferences"] = [owner] if owner else []
    return made


def test_a_new_job_gets_its_configmap_and_first_pod():
    decided = plan(Observed(job(), [], None, T0), SETTINGS)
    assert decided.create_pod["metadata"]["name"] == "quickstart-cpu-0"
    assert decided.create_configmap["metadata"]["name"] == "quickstart-cpu-config"
    assert decided.status["phase"] == "Pending" and decided.status["observedGeneration"] == 1
    assert ("Normal", "PodCreated", "created pod quickstart-cpu-0 (attempt 0)") in decided.events


def test_an_invalid_job_fails_naming_the_field_and_creates_nothing():
    bad = job(rollout={"group_size": 0})
    decided = plan(Observed(bad, [], None, T0), SETTINGS)
    assert decided.create_pod is None and decided.status["phase"] == "Failed"
    invalid = [c for c in decided.status["conditions"] if c["type"] == "Invalid"][0]
    assert invalid["status"] == "True" and "spec.rollout.group_size" in invalid["message"]
    assert any(e[0] == "Warning" and e[1] == "Invalid" for e in decided.events)
    assert plan(Observed(job(status=decided.status, rollout={"group_size": 0}), [], None, T0), SETTINGS).create_pod is None
    fixed = job(status=decided.status)  # the user corrects the spec (a new generation): the job starts
    fixed["metadata"]["generation"] = 2
    again = plan(Observed(fixed, [], None, T0), SETTINGS)
    assert again.create_pod is not None and not any(c["type"] == "Invalid" for c in again.status["conditions"])


def test_running_pod_progress_comes_from_the_learner_status():
    learner = {"phase": "running", "step": 3, "maxSteps": 4, "reward": 0.5, "heldoutAccuracy": 0.25, "adapterVersion": 3,
               "lastCheckpoint": {"uri": "s3://orbit-test/quickstart-cpu/step-00000002", "step": 2}, "restarts": {"rollout": 1}}
    status = {"phase": "Pending", "attempt": 0, "podName": "quickstart-cpu-0", "startTime": "2026-11-30T12:00:00Z"}
    decided = plan(Observed(job(status), [pod("quickstart-cpu-0", "Running", podIP="127.0.0.5")], configmap(JOB), T0, learner),
                   SETTINGS)  # fmt: skip
    progress = decided.status["progress"]
    assert decided.status["phase"] == "Running" and progress["stepText"] == "3/4" and progress["reward"] == 0.5
    assert progress["lastCheckpoint"]["step"] == 2 and progress["roleRestarts"] == {"rollout": 1}
    assert decided.create_pod is None and not decided.delete_pods


def test_a_finished_learner_s_termination_message_is_its_final_progress():
    """The learner exits between two polls: its last /status reaches the job through the pod status."""
    final = '{"phase":"succeeded","step":4,"maxSteps":4,"adapterVersion":4,"lastCheckpoint":{"uri":"s3://b/j/step-00000004","step":4}}'
    learner = {"name": "learner", "state": {"terminated": {"exitCode": 0, "reason": "Completed", "message": final}}}
    finished = pod("quickstart-cpu-0", "Succeeded", containerStatuses=[learner])
    assert learner_final_status(finished)["step"] == 4
    status = {"phase": "Running", "attempt": 0, "podName": "quickstart-cpu-0", "startTime": "2026-11-30T12:00:00Z",
              "progress": {"step": 3, "maxSteps": 4, "stepText": "3/4"}}  # fmt: skip
    decided = plan(Observed(job(status), [finished], configmap(JOB), T0, learner_final_status(finished)), SETTINGS)
    assert decided.status["phase"] == "Succeeded" and decided.status["progress"]["stepText"] == "4/4"
    assert decided.status["progress"]["lastCheckpoint"]["step"] == 4
    # a failed learner's message is the end of its log (FallbackToLogsOnError): no progress, but the failure's reason
    crashed = {"name": "learner", "state": {"terminated": {"exitCode": 1, "reason": "Error",
                                                           "message": "step 3\norbit: error: s3://b/j: access denied\n"}}}  # fmt: skip
    failed = pod("quickstart-cpu-0", "Failed", containerStatuses=[crashed])
    assert learner_final_status(failed) is None
    decided = plan(Observed(job({**status, "failures": 0}), [failed], configmap(JOB), T0), SETTINGS)
    reason = [e for e in decided.events if e[1] == "PodFailed"][0][2]
    assert "learner: Error (exit 1): orbit: error: s3://b/j: access denied" in reason


def test_a_failed_pod_is_replaced_after_backoff_until_the_limit():
    status = {"phase": "Running", "attempt": 0, "failures": 0, "startTime": "2026-11-30T12:00:00Z"}
    failed = pod("quickstart-cpu-0", "Failed", containerStatuses=[{"name": "learner", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}])
    first = plan(Observed(job(status), [failed], configmap(JOB), T0), SETTINGS)
    assert first.status["failures"] == 1 and first.status["attempt"] == 1 and first.create_pod is None
    assert "learner: Error (exit 1)" in [e for e in first.events if e[1] == "PodFailed"][0][2]
    waiting = plan(Observed(job(first.status), [failed], configmap(JOB), T0 + timedelta(seconds=5)), SETTINGS)
    assert waiting.create_pod is None  # still backing off (10 s)
    retry = plan(Observed(job(first.status), [failed], configmap(JOB), T0 + timedelta(seconds=11)), SETTINGS)
    assert retry.create_pod["metadata"]["name"] == "quickstart-cpu-1"
    status = {**retry.status, "failures": 2, "attempt": 2}  # backoffLimit is 2
    last = plan(Observed(job(status), [pod("quickstart-cpu-2", "Failed")], configmap(JOB), T0), SETTINGS)
    assert last.status["phase"] == "Failed" and last.status["failures"] == 3
    assert any(c["type"] == "Failed" and c["reason"] == "BackoffLimitExceeded" for c in last.status["conditions"])


def test_suspend_deletes_the_pod_keeps_status_and_resume_starts_a_new_one():
    status = {"phase": "Running", "attempt": 0, "progress": {"step": 2}, "startTime": "2026-11-30T12:00:00Z"}
    suspended = plan(Observed(job(status, suspend=True), [pod("quickstart-cpu-0", "Running")], configmap(JOB), T0), SETTINGS)
    assert suspended.delete_pods == ["quickstart-cpu-0"] and suspended.status["phase"] == "Suspended"
    assert suspended.status["progress"] == {"step": 2}
    resumed = plan(Observed(job(suspended.status, suspend=False), [], configmap(JOB), T0), SETTINGS)
    assert resumed.create_pod["metadata"]["name"] == "quickstart-cpu-1" and resumed.status["phase"] == "Pending"


def test_restart_id_deadline_ttl_and_success():
    status = {"phase": "Running", "attempt": 0, "restartId": "", "podName": "quickstart-cpu-0", "startTime": "2026-11-30T12:00:00Z"}
    running = [pod("quickstart-cpu-0", "Running")]
    restarted = plan(Observed(job(status, restartId="again"), running, configmap(JOB), T0), SETTINGS)
    assert restarted.delete_pods == ["quickstart-cpu-0"] and restarted.status["attempt"] == 1
    scheduled = {**status, "activeSince": "2026-11-30T12:00:00Z"}  # its pod left the queue then
    late = plan(Observed(job(scheduled, activeDeadlineSeconds=60), running, configmap(JOB), T0 + timedelta(minutes=2)), SETTINGS)
    assert late.status["phase"] == "Failed" and late.delete_pods == ["quickstart-cpu-0"]
    done = plan(Observed(job(status, ttlSecondsAfterFinished=30), [pod("quickstart-cpu-0", "Succeeded")], configmap(JOB), T0),
                SETTINGS)  # fmt: skip
    assert done.status["phase"] == "Succeeded" and done.status["completionTime"] == "2026-11-30T12:00:00Z"
    kept = plan(Observed(job(done.status, ttlSecondsAfterFinished=30), [], None, T0 + timedelta(seconds=10)), SETTINGS)
    assert not kept.delete_job
    gone = plan(Observed(job(done.status, ttlSecondsAfterFinished=30), [], None, T0 + timedelta(seconds=31)), SETTINGS)
    assert gone.delete_job


def test_a_spec_change_the_running_pod_cannot_take_is_refused_naming_the_field():
    status = {"phase": "Running", "attempt": 0, "startTime": "2026-11-30T12:00:00Z"}
    changed = job(status, rollout={**JOB["spec"]["rollout"], "max_tokens": 64})
    decided = plan(Observed(changed, [pod("quickstart-cpu-0", "Running")], configmap(JOB), T0), SETTINGS)
    refused = [c for c in decided.status["conditions"] if c["type"] == "SpecChangeRefused"]
    assert refused and "rollout.max_tokens: 12 (running) -> 64 (spec)" in refused[0]["message"]
    assert decided.create_pod is None and not decided.delete_pods  # the pod keeps running the old spec
    lifecycle_only = job(status, backoffLimit=5)
    assert not any(c["type"] == "SpecChangeRefused" for c in plan(Observed(lifecycle_only, [pod("quickstart-cpu-0", "Running")],
                                                                          configmap(JOB), T0), SETTINGS).status["conditions"])


RUNNING = {"phase": "Running", "attempt": 0, "podName": "quickstart-cpu-0", "startTime": "2026-11-30T12:00:00Z"}


def test_an_invalid_edit_while_running_keeps_the_pod_and_warns_once():
    bad = job(RUNNING, rollout={**JOB["spec"]["rollout"], "temprature": 0.7})  # a typo in kubectl edit
    decided = plan(Observed(bad, [pod("quickstart-cpu-0", "Running")], configmap(JOB), T0), SETTINGS)
    assert not decided.delete_pods and decided.status["phase"] == "Running"
    invalid = [c for c in decided.status["conditions"] if c["type"] == "Invalid"][0]
    assert "spec.rollout.temprature" in invalid["message"]
    assert [e[1] for e in decided.events] == ["Invalid"]
    again = plan(Observed(job(decided.status, rollout=bad["spec"]["rollout"]), [pod("quickstart-cpu-0", "Running")], configmap(JOB),
                          T0 + timedelta(seconds=10)), SETTINGS)  # fmt: skip
    assert again.events == []  # the next timer tick posts nothing new


def test_a_replacement_pod_uses_the_applied_spec_not_a_refused_change():
    changed = job(RUNNING, rollout={**JOB["spec"]["rollout"], "max_tokens": 64})
    failed = [pod("quickstart-cpu-0", "Failed")]
    first = plan(Observed(changed, failed, configmap(JOB), T0), SETTINGS)
    assert any(c["type"] == "SpecChangeRefused" for c in first.status["conditions"])
    retry = plan(Observed(job(first.status, rollout=changed["spec"]["rollout"]), failed, configmap(JOB), T0 + timedelta(seconds=11)),
                 SETTINGS)  # fmt: skip
    assert retry.create_pod is not None and retry.create_configmap is None  # the ConfigMap (applied spec) stays
    restarted = plan(Observed(job(RUNNING, rollout=changed["spec"]["rollout"], restartId="apply"), [pod("quickstart-cpu-0", "Running")],
                              configmap(JOB), T0), SETTINGS)  # fmt: skip
    assert restarted.delete_pods == ["quickstart-cpu-0"] and restarted.status["reapply"] is True
    applied = plan(Observed(job(restarted.status, rollout=changed["spec"]["rollout"], restartId="apply"), [], configmap(JOB), T0),
                   SETTINGS)  # fmt: skip
    new_config = yaml.safe_load(applied.create_configmap["data"]["job.yaml"])
    assert new_config["rollout"]["max_tokens"] == 64 and not any(c["type"] == "SpecChangeRefused" for c in applied.status["conditions"])


def test_no_new_pod_while_the_old_one_terminates():
    terminating = pod("quickstart-cpu-0", "Running")
    terminating["metadata"]["deletionTimestamp"] = "2026-11-30T12:00:00Z"
    status = {**RUNNING, "attempt": 1, "reapply": True}
    decided = plan(Observed(job(status), [terminating], configmap(JOB), T0), SETTINGS)
    assert decided.create_pod is None
    assert plan(Observed(job(status), [], configmap(JOB), T0), SETTINGS).create_pod["metadata"]["name"] == "quickstart-cpu-1"


def test_resume_restarts_the_deadline_clock_and_waiting_reasons_surface():
    suspended = {**RUNNING, "phase": "Suspended", "attempt": 1, "reapply": True, "startTime": "2026-11-30T10:00:00Z"}
    resumed = plan(Observed(job(suspended, activeDeadlineSeconds=3600), [], configmap(JOB), T0), SETTINGS)
    assert resumed.create_pod is not None and resumed.status["startTime"] == "2026-11-30T12:00:00Z"
    stuck = pod("quickstart-cpu-1", "Pending", containerStatuses=[
        {"name": "learner", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}])  # fmt: skip
    waiting = plan(Observed(job(resumed.status), [stuck], configmap(JOB), T0), SETTINGS)
    ready = [c for c in waiting.status["conditions"] if c["type"] == "Ready"][0]
    assert ready["reason"] == "PodWaiting" and "learner: ImagePullBackOff (no such image)" in ready["message"]


def test_an_invalid_failed_job_is_deleted_after_its_ttl():
    bad = job(rollout={"group_size": 0}, ttlSecondsAfterFinished=60)
    failed = plan(Observed(bad, [], None, T0), SETTINGS)
    assert failed.status["phase"] == "Failed" and not failed.delete_job
    later = plan(Observed(job(failed.status, rollout={"group_size": 0}, ttlSecondsAfterFinished=60), [], None,
                          T0 + timedelta(seconds=61)), SETTINGS)  # fmt: skip
    assert later.delete_job


def test_the_operator_never_imports_the_ml_stack():
    """The operator image ships without torch, vLLM, transformers and peft: importing every operator module must not load them."""
    import subprocess
    import sys

    code = ("import sys, pkgutil, importlib, orbit_operator\n"
            "for m in pkgutil.iter_modules(orbit_operator.__path__): importlib.import_module('orbit_operator.' + m.name)\n"
            "import orbit_runtime.cli\n"
            "print(sorted(m for m in ('torch', 'vllm', 'transformers', 'peft', 'safetensors') if m in sys.modules))")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
