"""The planner behaves like a Kubernetes controller people trust (reconcile.plan on hand-built
observations): ownership by UID, terminal states stay terminal, readiness from the pod's
conditions, disruptions not failures, the deadline not counted while queued, state rebuilt from
owned objects, honest observedGeneration, untrusted learner input, the OnPolicy condition."""

from datetime import timedelta

from orbit_operator.pod import owner_reference
from orbit_operator.reconcile import Observed, plan
from tests.unit.test_operator_reconcile import JOB, RUNNING, SETTINGS, T0, configmap, job, pod

OLD_JOB = owner_reference("quickstart-cpu", "u-0")  # a deleted job of the same name
LEARNER = '{"phase":"running","step":3,"maxSteps":4}'


def conditions(decided) -> dict:
    return {c["type"]: c for c in decided.status["conditions"]}


def reasons(decided) -> list[str]:
    return [e[1] for e in decided.events]


def test_a_recreated_job_never_adopts_the_deleted_job_s_pod_or_configmap():
    """`kubectl delete -f && kubectl apply -f` while the old pod terminates (it had succeeded)."""
    old_pod = pod("quickstart-cpu-0", "Succeeded", owner=OLD_JOB)
    old_pod["metadata"]["deletionTimestamp"] = "2026-11-30T12:00:00Z"
    decided = plan(Observed(job(), [old_pod], configmap(JOB, owner=OLD_JOB), T0), SETTINGS)
    assert decided.status["phase"] == "Pending" and decided.create_pod is None and decided.create_configmap is None
    ready = conditions(decided)["Ready"]
    assert ready["reason"] == "WaitingForOldObjects" and "quickstart-cpu-0" in ready["message"]
    assert "ConfigMap quickstart-cpu-config" in ready["message"]
    assert "progress" not in decided.status and "Complete" not in conditions(decided)
    gone = plan(Observed(job(decided.status), [], None, T0 + timedelta(seconds=3)), SETTINGS)
    assert gone.create_pod["metadata"]["name"] == "quickstart-cpu-0" and gone.create_configmap is not None


def test_an_orphan_pod_with_the_job_s_label_is_not_the_job_s_pod():
    orphan = pod("quickstart-cpu-0", "Running", owner=None)
    decided = plan(Observed(job({}), [orphan], configmap(JOB), T0, {"step": 3, "maxSteps": 4}), SETTINGS)
    assert decided.status["phase"] == "Pending" and "progress" not in decided.status and decided.create_pod is None
    assert conditions(decided)["Ready"]["reason"] == "WaitingForOldObjects"


def test_a_succeeded_job_stays_succeeded_through_a_bad_edit_and_its_fix():
    done = {**RUNNING, "phase": "Succeeded", "completionTime": "2026-11-30T12:30:00Z",
            "conditions": [{"type": "Complete", "status": "True", "reason": "LearnerSucceeded", "message": "", "lastTransitionTime": "x"}]}  # fmt: skip
    typo = job(done, rollout={**JOB["spec"]["rollout"], "temprature": 0.7})
    edited = plan(Observed(typo, [], configmap(JOB), T0), SETTINGS)
    assert edited.status["phase"] == "Succeeded" and conditions(edited)["Complete"]["status"] == "True"
    assert edited.status["completionTime"] == "2026-11-30T12:30:00Z" and edited.create_pod is None
    fixed = plan(Observed(job(edited.status), [], configmap(JOB), T0 + timedelta(seconds=5)), SETTINGS)
    assert fixed.status["phase"] == "Succeeded" and fixed.status["completionTime"] == "2026-11-30T12:30:00Z"
    assert fixed.create_pod is None and "Invalid" not in conditions(fixed)


def test_a_bad_edit_while_running_does_not_freeze_the_lifecycle():
    rollout = {**JOB["spec"]["rollout"], "temprature": 0.7}
    succeeded = plan(
        Observed(job(RUNNING, rollout=rollout), [pod("quickstart-cpu-0", "Succeeded")], configmap(JOB), T0), SETTINGS
    )
    assert succeeded.status["phase"] == "Succeeded"
    failed = plan(Observed(job(RUNNING, rollout=rollout), [pod("quickstart-cpu-0", "Failed")], configmap(JOB), T0), SETTINGS)
    assert failed.status["phase"] == "Pending" and failed.status["failures"] == 1 and failed.status["attempt"] == 1
    retry = plan(Observed(job(failed.status, rollout=rollout), [pod("quickstart-cpu-0", "Failed")], configmap(JOB),
                          T0 + timedelta(seconds=11)), SETTINGS)  # fmt: skip
    assert retry.create_pod["metadata"]["name"] == "quickstart-cpu-1"  # from the applied spec
    suspended = plan(Observed(job(RUNNING, rollout=rollout, suspend=True), [pod("quickstart-cpu-0", "Running")], configmap(JOB), T0),
                     SETTINGS)  # fmt: skip
    assert suspended.status["phase"] == "Suspended" and suspended.delete_pods == ["quickstart-cpu-0"]
    resumed = plan(Observed(job(suspended.status, rollout=rollout), [], configmap(JOB), T0), SETTINGS)
    assert resumed.create_pod is None and conditions(resumed)["Ready"]["reason"] == "InvalidSpec"  # a resume needs a valid spec


def test_readiness_comes_from_the_pod_s_ready_condition():
    def running(**status):
        return plan(Observed(job(RUNNING), [pod("quickstart-cpu-0", "Running", **status)], configmap(JOB), T0), SETTINGS)

    ready = {"conditions": [{"type": "Ready", "status": "True"}]}
    assert conditions(running(**ready))["Ready"]["status"] == "True"
    crashing = running(conditions=[{"type": "Ready", "status": "False"}], containerStatuses=[
        {"name": "rollout", "restartCount": 7, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}])  # fmt: skip
    assert conditions(crashing)["Ready"]["status"] == "False"
    assert (
        conditions(crashing)["Ready"]["reason"] == "ContainerCrashLooping"
        and "rollout" in conditions(crashing)["Ready"]["message"]
    )
    lost = pod("quickstart-cpu-0", "Running", reason="NodeLost", **ready)
    lost["metadata"]["deletionTimestamp"] = "2026-11-30T11:00:00Z"
    decided = plan(Observed(job(RUNNING), [lost], configmap(JOB), T0), SETTINGS)
    assert conditions(decided)["Ready"]["status"] == "False" and conditions(decided)["Ready"]["reason"] == "NodeUnreachable"
    assert decided.create_pod is None  # its learner may still run: no second one
    deleted = pod("quickstart-cpu-0", "Running", **ready)
    deleted["metadata"]["deletionTimestamp"] = "2026-11-30T11:00:00Z"
    assert (
        conditions(plan(Observed(job(RUNNING), [deleted], configmap(JOB), T0), SETTINGS))["Ready"]["reason"] == "PodTerminating"
    )


def test_a_disrupted_pod_is_replaced_without_counting_a_failure():
    evicted = pod("quickstart-cpu-0", "Failed", conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
                                                              "message": "preempted"}])  # fmt: skip
    decided = plan(Observed(job(RUNNING, backoffLimit=0), [evicted], configmap(JOB), T0), SETTINGS)
    assert decided.status["phase"] == "Pending" and decided.status.get("failures", 0) == 0 and decided.status["attempt"] == 1
    assert "PodDisrupted" in reasons(decided) and "nextAttemptAt" not in decided.status
    again = plan(Observed(job(decided.status, backoffLimit=0), [evicted], configmap(JOB), T0), SETTINGS)
    assert again.create_pod["metadata"]["name"] == "quickstart-cpu-1"


def test_the_deadline_does_not_run_while_the_pod_is_queued():
    queued = pod(
        "quickstart-cpu-0", "Pending", conditions=[{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}]
    )
    status = {**RUNNING, "phase": "Pending"}
    waiting = plan(Observed(job(status, activeDeadlineSeconds=60), [queued], configmap(JOB), T0 + timedelta(hours=2)), SETTINGS)
    assert waiting.status["phase"] == "Pending" and "activeSince" not in waiting.status
    started = pod("quickstart-cpu-0", "Running", conditions=[{"type": "PodScheduled", "status": "True"}])
    now = T0 + timedelta(hours=2)
    running = plan(Observed(job(waiting.status, activeDeadlineSeconds=60), [started], configmap(JOB), now), SETTINGS)
    assert running.status["phase"] == "Running" and running.status["activeSince"] == now.strftime("%Y-%m-%dT%H:%M:%SZ")
    late = plan(
        Observed(job(running.status, activeDeadlineSeconds=60), [started], configmap(JOB), now + timedelta(seconds=61)), SETTINGS
    )
    assert late.status["phase"] == "Failed" and conditions(late)["Failed"]["reason"] == "DeadlineExceeded"


def test_a_wiped_status_is_rebuilt_from_the_owned_pods_not_replayed():
    disrupted = [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]
    pods = [pod(f"quickstart-cpu-{n}", "Failed", conditions=disrupted) for n in range(3)] + [pod("quickstart-cpu-3", "Running")]
    decided = plan(Observed(job({}), pods, configmap(JOB), T0, {"step": 3, "maxSteps": 4}), SETTINGS)  # backoffLimit: 2
    assert decided.status["phase"] == "Running" and decided.status["attempt"] == 3 and decided.status["failures"] == 0
    assert decided.status["progress"]["step"] == 3 and "PodFailed" not in reasons(decided) and decided.create_pod is None
    failed = [pod(f"quickstart-cpu-{n}", "Failed") for n in range(2)] + [pod("quickstart-cpu-2", "Running")]
    rebuilt = plan(Observed(job({}), failed, configmap(JOB), T0), SETTINGS)
    assert rebuilt.status["phase"] == "Running" and rebuilt.status["attempt"] == 2 and rebuilt.status["failures"] == 2


def test_observed_generation_moves_only_to_applied_generations():
    changed = job({**RUNNING, "observedGeneration": 1}, rollout={**JOB["spec"]["rollout"], "max_tokens": 64})
    changed["metadata"]["generation"] = 2
    refused = plan(Observed(changed, [pod("quickstart-cpu-0", "Running")], configmap(JOB), T0), SETTINGS)
    assert refused.status["observedGeneration"] == 1  # generation 2 was refused
    assert conditions(refused)["SpecChangeRefused"]["observedGeneration"] == 2
    lifecycle = job(RUNNING, backoffLimit=5)
    lifecycle["metadata"]["generation"] = 3
    assert (
        plan(Observed(lifecycle, [pod("quickstart-cpu-0", "Running")], configmap(JOB), T0), SETTINGS).status["observedGeneration"]
        == 3
    )


def test_resume_says_resumed_and_a_restart_of_a_terminal_job_is_reported_once():
    suspended = plan(Observed(job(RUNNING, suspend=True), [pod("quickstart-cpu-0", "Running")], configmap(JOB), T0), SETTINGS)
    resumed = plan(Observed(job(suspended.status), [], configmap(JOB), T0), SETTINGS)
    assert conditions(resumed)["Suspended"]["status"] == "False" and conditions(resumed)["Suspended"]["reason"] == "Resumed"
    done = {**RUNNING, "phase": "Succeeded", "completionTime": "2026-11-30T12:30:00Z"}
    ignored = plan(Observed(job(done, restartId="again"), [], configmap(JOB), T0), SETTINGS)
    assert ignored.status["phase"] == "Succeeded" and ignored.create_pod is None and "RestartIgnored" in reasons(ignored)
    assert "RestartIgnored" not in reasons(
        plan(Observed(job(ignored.status, restartId="again"), [], configmap(JOB), T0), SETTINGS)
    )


def test_a_learner_status_that_does_not_parse_is_ignored_and_reported_once():
    running = [pod("quickstart-cpu-0", "Running", conditions=[{"type": "Ready", "status": "True"}])]
    status = {**RUNNING, "progress": {"step": 2, "maxSteps": 4, "stepText": "2/4"}}
    bad = {"step": "three", "maxSteps": 4, "reward": 0.5}
    decided = plan(Observed(job(status), running, configmap(JOB), T0, bad), SETTINGS)
    assert decided.status["phase"] == "Running" and decided.status["progress"]["reward"] == 0.5
    assert decided.status["progress"]["step"] == 2 and decided.status["progress"]["stepText"] == "2/4"  # not back to 0
    assert "LearnerStatusInvalid" in reasons(decided) and "step" in decided.status["learnerStatusError"]
    again = plan(Observed(job(decided.status), running, configmap(JOB), T0, {**bad, "step": "four"}), SETTINGS)
    assert "LearnerStatusInvalid" not in reasons(again)  # the same field again, with another bad value: said once
    junk = plan(Observed(job(status), running, configmap(JOB), T0, ["not", "an", "object"]), SETTINGS)
    assert junk.status["progress"] == status["progress"] and "LearnerStatusInvalid" in reasons(junk)


def test_the_on_policy_condition_follows_the_learner_and_an_off_policy_stop_fails_the_job():
    running = [pod("quickstart-cpu-0", "Running", conditions=[{"type": "Ready", "status": "True"}])]

    def learner(state, consecutive=0, last=0.004):
        return {"step": 3, "maxSteps": 10, "signal": {"onPolicy": {"state": state, "bound": 0.05, "lastMismatch": last,
                                                                    "consecutiveSteps": consecutive, "allowedSteps": 3}}}  # fmt: skip

    ok = plan(Observed(job(RUNNING), running, configmap(JOB), T0, learner("ok")), SETTINGS)
    assert conditions(ok)["OnPolicy"]["status"] == "True" and "0.004" in conditions(ok)["OnPolicy"]["message"]
    high = plan(Observed(job(ok.status), running, configmap(JOB), T0, learner("exceeded", 1, 0.2)), SETTINGS)
    assert (
        conditions(high)["OnPolicy"]["status"] == "False"
        and "0.2 above the bound 0.05" in conditions(high)["OnPolicy"]["message"]
    )
    assert "OnPolicy" in reasons(high)
    final = '{"phase":"failed","reason":"OffPolicy","step":5,"maxSteps":10,"signal":{"onPolicy":{"state":"exceeded","bound":0.05,' \
            '"lastMismatch":0.3,"consecutiveSteps":3,"allowedSteps":3}}}'  # fmt: skip
    stopped = pod("quickstart-cpu-0", "Failed", containerStatuses=[
        {"name": "learner", "state": {"terminated": {"exitCode": 1, "reason": "Error", "message": final}}}])  # fmt: skip
    import json

    decided = plan(Observed(job(high.status), [stopped], configmap(JOB), T0, json.loads(final)), SETTINGS)
    assert decided.status["phase"] == "Failed" and conditions(decided)["Failed"]["reason"] == "OffPolicy"
    assert "0.3 above the bound 0.05 for 3 consecutive steps" in conditions(decided)["Failed"]["message"]
    assert decided.create_pod is None and decided.status.get("failures", 0) == 0


def test_no_new_pod_while_an_earlier_attempt_s_pod_still_runs():
    """A restart whose DELETE failed (recorded first: attempt 1): the old pod is deleted again, and
    no pod of attempt 1 starts beside it; the attempt is not bumped twice."""
    status = {**RUNNING, "attempt": 1, "restartId": "again", "reapply": True}
    decided = plan(Observed(job(status, restartId="again"), [pod("quickstart-cpu-0", "Running")], configmap(JOB), T0), SETTINGS)
    assert decided.create_pod is None and decided.delete_pods == ["quickstart-cpu-0"] and decided.status["attempt"] == 1
    suspended = plan(Observed(job({**status, "phase": "Suspended"}, restartId="again", suspend=True), [pod("quickstart-cpu-0", "Running")],
                              configmap(JOB), T0), SETTINGS)  # fmt: skip
    assert suspended.delete_pods == ["quickstart-cpu-0"] and suspended.status["attempt"] == 1


def test_a_pod_deleted_after_it_succeeded_still_ends_the_job_succeeded():
    done = pod("quickstart-cpu-0", "Succeeded")
    done["metadata"]["deletionTimestamp"] = "2026-11-30T12:00:00Z"  # a drain or pod GC before the operator saw it
    decided = plan(Observed(job(RUNNING), [done], configmap(JOB), T0), SETTINGS)
    assert decided.status["phase"] == "Succeeded" and decided.create_pod is None


def test_removing_a_lifecycle_field_takes_effect_and_every_terminal_outcome_honours_the_ttl():
    status = {**RUNNING, "activeSince": "2026-11-30T10:00:00Z"}
    no_deadline = plan(Observed(job(status), [pod("quickstart-cpu-0", "Running")], configmap(dict(JOB, spec={**JOB["spec"],
                       "activeDeadlineSeconds": 60})), T0), SETTINGS)  # fmt: skip
    assert no_deadline.status["phase"] == "Running"  # the applied spec had a deadline; the job as written has none
    failed = pod("quickstart-cpu-0", "Failed")
    over = plan(Observed(job({**RUNNING, "failures": 2}, ttlSecondsAfterFinished=30), [failed], configmap(JOB), T0), SETTINGS)
    assert over.status["phase"] == "Failed" and over.requeue_after == 30  # due at its TTL, not at the resync
    late = plan(Observed(job(status, activeDeadlineSeconds=60, ttlSecondsAfterFinished=0), [pod("quickstart-cpu-0", "Running")],
                         configmap(JOB), T0), SETTINGS)  # fmt: skip
    assert late.status["phase"] == "Failed" and late.delete_job and late.delete_pods == ["quickstart-cpu-0"]


def test_only_a_running_learner_is_polled():
    pending = plan(Observed(job(RUNNING), [pod("quickstart-cpu-0", "Pending")], configmap(JOB), T0), SETTINGS)
    assert pending.requeue_after is None  # its changes arrive as pod events
    running = plan(Observed(job(RUNNING), [pod("quickstart-cpu-0", "Running")], configmap(JOB), T0), SETTINGS)
    assert running.requeue_after == SETTINGS.status_poll_seconds
    done = plan(Observed(job(RUNNING), [pod("quickstart-cpu-0", "Succeeded")], configmap(JOB), T0), SETTINGS)
    assert done.requeue_after is None and not done.delete_job
