"""kopf handlers and the reconcile they drive: observe, `reconcile.plan`, record the status,
carry the plan out. Nothing is decided here.

Reconciles are driven by events: a job's create, update or the operator's start (kopf), and
any change to a pod labelled with a job (a pod watch). Each runs in the requeue scheduler's
workers (requeue.py), never two at once for one job; after it, the job is due again when its
plan says (`requeue_after`: a running learner's next `/status` poll, the end of a backoff, a
TTL), else at the slow resync (`resync_seconds`, a safety net).

A transient API refusal (api_errors.classify: 429, a quota 403, 5xx) is retried after a delay
with a warning event; any other error is logged and retried after the backoff base; no input
stops the operator (a malformed job ends up Failed/Invalid, see reconcile.plan). Deletion is
the garbage collector's: the job owns its pods and ConfigMap (ownerReferences), so no handler
needs a finalizer and deleting a job or its namespace never waits for the operator.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import UTC, datetime

import httpx
import kopf
from kubernetes.client.exceptions import ApiException

from orbit_operator import job_secrets, kueue
from orbit_operator.api_errors import classify
from orbit_operator.crd import GROUP, KIND, PLURAL, VERSION
from orbit_operator.decision import TIME_FORMAT
from orbit_operator.kube import Kube, NotOwned
from orbit_operator.observe import Observed, observe
from orbit_operator.pod import LABEL_JOB, object_names, owner_reference
from orbit_operator.pod_health import terminating
from orbit_operator.reconcile import Plan, plan, pod_rejected
from orbit_operator.requeue import RequeueScheduler
from orbit_operator.settings import OperatorSettings
from orbit_operator.status import backoff_seconds, learner_final_status
from orbit_runtime.api_key import auth_headers
from orbit_runtime.observability import metrics

log = logging.getLogger("orbit_operator")
FAULT_EXIT_AFTER_POD_CREATE = "ORBIT_FAULT_EXIT_AFTER_POD_CREATE"  # tests only: die right after creating a pod
SETTINGS = OperatorSettings.from_env()
_kube: Kube | None = None
_phases: dict[str, str] = {}  # namespace/name -> phase, for orbit_operator_jobs
_refusals: dict[str, tuple[int, str]] = {}  # namespace/name -> (transient pod refusals in a row, the last one)


def kube() -> Kube:
    global _kube
    if _kube is None:
        from orbit_operator.kube import load_config

        load_config()
        _kube = Kube()
    return _kube


def _count_phases() -> None:
    phases = list(_phases.values())  # a snapshot: worker threads and kopf's change the dict
    for phase in ("Queued", "Pending", "Preparing", "Running", "Succeeded", "Failed", "Suspended"):
        metrics.OPERATOR_JOBS.labels(phase).set(sum(1 for p in phases if p == phase))


def learner_status(pod: dict | None, api_key: str | None = None) -> object:
    """The learner's /status at the pod's IP (JSON, untrusted: reconcile.plan parses it); once the pod
    has finished, its termination message; None when neither is there (not running yet, not answering)."""
    if pod is not None and (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return learner_final_status(pod)
    if pod is None or (pod.get("status") or {}).get("phase") != "Running":
        return None
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    try:
        host = f"[{ip}]" if ":" in ip else ip  # an IPv6 pod IP
        response = httpx.get(f"http://{host}:{SETTINGS.learner_status_port}/status", timeout=httpx.Timeout(2.0, connect=0.5),
                             headers=auth_headers(api_key))  # the job's key (job_secrets): /status needs it  # fmt: skip
        response.raise_for_status()
        return response.json()
    except (httpx.HTTPError, ValueError) as exc:
        metrics.OPERATOR_STATUS_POLL_FAILURES.inc()
        log.info("learner /status of %s not available: %s", pod["metadata"]["name"], exc)
        return None


class _Retry(Exception):
    """A transient refusal: reconcile the job again after DELAY seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__(delay)
        self.delay = delay


def reconcile(namespace: str, name: str) -> None:
    """Observe, plan, act and record; then schedule the job's next reconcile. The status is written
    before a pod is deleted, so an operator that dies in between finds the decision (a bumped
    attempt) and never takes the pod it was deleting for the next one; a pod is created before its
    status is recorded (its name is deterministic: a death in between finds it, ours by UID)."""
    key = f"{namespace}/{name}"
    started, outcome, delay = time.monotonic(), "error", SETTINGS.backoff_base_seconds
    try:
        job = kube().job(namespace, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            _forget(namespace, name)
            outcome, delay = "ok", None
            return
        decided = _reconcile(job)
        _phases[key] = decided.status.get("phase", "Pending")
        if decided.delete_job:
            log.info("%s: ttlSecondsAfterFinished passed: deleting the job", key)
            kube().delete_job(namespace, name)
            outcome, delay = "ok", None
            return
        outcome = "invalid" if any(c.get("type") == "Invalid" for c in decided.status.get("conditions", [])) else "ok"
        delay = decided.requeue_after if decided.requeue_after is not None else SETTINGS.resync_seconds
    except _Retry as retry:
        outcome, delay = "retry", retry.delay
    except job_secrets.SecretsUnreadable as exc:  # RBAC or the API server: nothing is written until it can be masked
        log.warning("reconcile of %s: %s; again in %.0fs", key, exc, delay)
    except Exception:  # noqa: BLE001 - an API or network failure: logged, tried again after the backoff base
        log.exception("reconcile of %s failed; again in %.0fs", key, delay)
    finally:
        if delay is not None and SCHEDULER is not None:  # first: nothing below may lose the job's next reconcile
            SCHEDULER.schedule(namespace, name, delay)
        metrics.OPERATOR_RECONCILES.labels(outcome).inc()
        metrics.OPERATOR_RECONCILE_DURATION.observe(time.monotonic() - started)
        _count_phases()


def _reconcile(job: dict) -> Plan:
    api, meta = kube(), job["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    pods = api.job_pods(namespace, name)
    configmap = api.configmap(namespace, object_names(name, 0)["configmap"])
    now = datetime.now(UTC).replace(tzinfo=None)
    workload_name = kueue.workload_name(name, meta["uid"])
    workload = api.workload(namespace, workload_name) if SETTINGS.kueue else None
    view = observe(Observed(job=job, pods=pods, configmap=configmap, now=now, workload=workload))
    current = view.pod(object_names(name, view.attempt)["pod"])
    polled = current is not None and not terminating(current)
    learner = learner_status(current, job_secrets.api_key(api, job) if _running(current) else None) if polled else None
    decided = plan(Observed(job=job, pods=pods, configmap=configmap, now=now, learner_status=learner, workload=workload), SETTINGS)
    old = _ours(job.get("status") or {})
    events = list(decided.events)
    if events or _ours(decided.status) != old:  # about to write: no
        decided.status = job_secrets.redacted(api, job, decided.status)  # value of the job's Secrets goes into it
        events = job_secrets.redacted(api, job, events)
    owner = owner_reference(name, meta["uid"])
    if decided.create_configmap is not None:  # idempotent: the applied spec the status is about to name
        decided.create_configmap["metadata"]["ownerReferences"] = [owner]
        _unless_not_owned(api, job, lambda: api.apply_configmap(decided.create_configmap))
    if decided.delete_workload:  # other pod requests (re-created below), or the queue label removed
        api.delete_workload(namespace, workload_name)
    if decided.create_workload is not None:  # before the status says Queued; its name is deterministic
        decided.create_workload["metadata"]["ownerReferences"] = [owner]
        if (refused := _create_workload(api, job, decided)) is not None:
            events.append(("Warning", "WorkloadRejected", refused))
    if decided.delete_pods:  # record first (the bumped attempt), then delete: a death in between never
        _record(api, namespace, name, old, decided.status)  # takes the pod being deleted for the next one
        old = _ours(decided.status)
        for pod_name in decided.delete_pods:
            api.delete_pod(namespace, pod_name)
    if decided.create_pod is not None:  # create, then record: the name is deterministic, so a death in between
        decided.create_pod["metadata"]["ownerReferences"] = [owner]  # finds the pod (ours, by UID) next time
        _unless_not_owned(api, job, lambda: job_secrets.ensure_access(api, job, SETTINGS))
        job_secrets.add_redact_env(api, job, decided.create_pod)
        created = _create_pod(api, job, decided)
        if created and os.environ.get(FAULT_EXIT_AFTER_POD_CREATE):
            os._exit(70)  # fault injection for tests: the pod exists, the status does not say so yet
        if created is None:  # refused for good: the status says why (the API server's words, masked)
            decided.rejection = job_secrets.redacted(api, job, decided.rejection)
            decided.status = pod_rejected(decided.status, decided.rejection, now, meta.get("generation"))
            events = [("Warning", "PodRejected", decided.rejection[:1000])]
            if view.workload is not None:  # Failed: so is its Workload
                decided.workload_patch = kueue.finished_patch(view.workload, False, decided.rejection, now.strftime(TIME_FORMAT))
        elif created:
            metrics.OPERATOR_POD_CREATIONS.inc()
        if not created:  # an earlier reconcile made it, or it was refused
            events = [e for e in events if e[1] != "PodCreated"]
    _record(api, namespace, name, old, decided.status)
    if decided.workload_active is not None or decided.workload_queue is not None:  # suspend/resume; a changed queue label
        spec_patch = {"active": decided.workload_active, "queueName": decided.workload_queue}
        api.patch_workload(namespace, workload_name, {"spec": {k: v for k, v in spec_patch.items() if v is not None}})
    if decided.workload_patch is not None:
        _patch_workload(api, namespace, workload_name, job_secrets.redacted(api, job, decided.workload_patch))  # its messages too
    for type_, reason, message in events:
        api.post_event(job, type_, reason, message)
        if reason == "Evicted":  # Kueue evicted (preempted) the running job: its pod was deleted
            metrics.OPERATOR_KUEUE_EVICTIONS.inc()
        if reason == "DoesNotFit":  # posted once per verdict: at admission (no pod yet) or from the pod's prepare-base
            metrics.OPERATOR_DOES_NOT_FIT.labels("prepare_base" if decided.status.get("podName") else "admission").inc()
    return decided


def _ours(status: dict) -> dict:
    """STATUS without kopf's own keys (its progress storage): what the operator writes and compares."""
    return {k: v for k, v in status.items() if not k.startswith("kopf")}


def _record(api: Kube, namespace: str, name: str, old: dict, status: dict) -> dict:
    """Write STATUS if it differs from OLD (a quiet poll writes nothing); returns what is stored now."""
    new = _ours(status)
    if new != old:
        api.patch_job_status(namespace, name, {**{k: None for k in old if k not in new}, **new})
    return new


def _patch_workload(api: Kube, namespace: str, name: str, patch: dict) -> None:
    """Write the Workload's status (Finished, or its admission released). A 409 means Kueue wrote it since:
    its watch event reconciles the job again, which decides from what Kueue wrote."""
    try:
        api.patch_workload_status(namespace, name, patch)
    except ApiException as exc:
        if exc.status != 409:
            raise
        metrics.OPERATOR_API_RETRIES.labels("patch_workload_status", "409").inc()
        log.info("%s/%s: the Workload changed since it was read; deciding again on its event", namespace, name)
        return
    types = {c.get("type") for c in patch["status"]["conditions"]}
    what = "released" if "admission" in patch["status"] else "finished" if "Finished" in types else "pods_ready"
    metrics.OPERATOR_KUEUE_WORKLOAD_UPDATES.labels(what).inc()


def _create_workload(api: Kube, job: dict, decided: Plan) -> str | None:
    """Create the plan's Workload, with its PriorityClass's value (Kueue's CEL requires spec.priority with a class).
    A refusal (no such PriorityClass, a 422, a 5xx) becomes the job's Queued condition, tried again after a backoff;
    returns the event to post, once per refusal (None: created, existing, or said before)."""
    body, key = decided.create_workload, f"{job['metadata']['namespace']}/{job['metadata']['name']}"
    try:
        if (name := kueue.priority_class_of(body)) is not None and (value := api.priority_class_value(name)) is None:
            message = f"PriorityClass {name!r} (spec.priorityClassName) does not exist: Kueue needs its value"
        else:
            if name is not None:
                kueue.with_priority(body, value)
            if api.create_workload(body):
                metrics.OPERATOR_KUEUE_WORKLOADS.inc()
            _refusals.pop(key, None)
            return None
    except ApiException as exc:
        message = f"the API server refused Workload {body['metadata']['name']}: {classify(exc, default_delay=1.0).summary}"
    message = job_secrets.redacted(api, job, message)[:1000]
    now = datetime.now(UTC).replace(tzinfo=None)
    decided.status = kueue.workload_refused(decided.status, message, now, job["metadata"].get("generation"))
    decided.requeue_after, new = _refused(key, message)
    return message if new else None


def _running(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running"


def _unless_not_owned(api: Kube, job: dict, write) -> None:
    """WRITE an object of the job's (its ConfigMap, API key Secret, NetworkPolicy), made or found ours. A name
    taken by an object that is not the job's is never touched (kube.NotOwned): the job waits, with one warning
    event, and is reconciled again after a backoff, as for a deleted job's objects awaiting collection."""
    key = f"{job['metadata']['namespace']}/{job['metadata']['name']}"
    try:
        write()
    except NotOwned as exc:
        delay, new = _refused(key, str(exc))
        if new:
            api.post_event(job, "Warning", "NotOwned", str(exc)[:1000])
        raise _Retry(delay) from exc


def _create_pod(api: Kube, job: dict, decided: Plan) -> bool | None:
    """Create the plan's pod: True, False if it exists (an earlier reconcile made it), None if the API
    server refused it for good (decided.rejection says why). A transient refusal (a 429, a quota 403,
    a 5xx) raises _Retry, after a warning event and a metric."""
    pod, key = decided.create_pod, f"{job['metadata']['namespace']}/{job['metadata']['name']}"
    try:
        created = api.create_pod(pod)
    except ApiException as exc:
        kind = classify(exc, default_delay=SETTINGS.backoff_base_seconds)
        message = f"the API server refused pod {pod['metadata']['name']}: {kind.summary}"
        if not kind.transient:
            _refusals.pop(key, None)
            decided.rejection = message
            return None
        backoff, new = _refused(key, kind.summary)
        delay = max(kind.retry_after, backoff)
        metrics.OPERATOR_API_RETRIES.labels("create_pod", str(exc.status or 0)).inc()
        if new:  # one event per kind of refusal, not one per retry
            api.post_event(job, "Warning", "PodCreateRetrying", f"{message}; retrying with backoff (next in {delay:.0f}s)"[:1000])
        raise _Retry(delay) from exc
    _refusals.pop(key, None)
    return created


def _refused(key: str, what: str) -> tuple[float, bool]:
    """Count one more refusal in a row for job KEY: the backoff before the next try, and whether WHAT differs
    from the last refusal (say it once, not once per retry)."""
    tries, last = _refusals.get(key, (0, ""))
    _refusals[key] = (tries + 1, what)
    return backoff_seconds(tries + 1, base=SETTINGS.backoff_base_seconds), what != last


def _forget(namespace: str, name: str) -> None:
    _phases.pop(f"{namespace}/{name}", None)
    _refusals.pop(f"{namespace}/{name}", None)
    job_secrets.forget(namespace, name)
    if SCHEDULER is not None:
        SCHEDULER.forget(namespace, name)


SCHEDULER: RequeueScheduler | None = None


class _QuietEventHandlers(logging.Filter):
    """Drop kopf's "Handler 'on_pod_event' succeeded." lines (one per watch event); keep its failures."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        quiet = ("Handler 'on_pod_event'", "Handler 'on_job_event'", "Handler 'on_workload_event'")
        return not (record.levelno <= logging.INFO and message.startswith(quiet))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    global SCHEDULER
    # kopf posts its own log lines as Events at this level: only its warnings and errors (the operator posts
    # the job's events itself); and a line per pod event would drown the log
    settings.posting.level = logging.WARNING
    logging.getLogger("kopf.objects").addFilter(_QuietEventHandlers())
    # no handler needs a finalizer, so kopf adds none; it keeps this name so that it removes the finalizer
    # earlier Orbit versions put on jobs (their deletion then never waits for the operator)
    settings.persistence.finalizer = f"{GROUP}/cleanup"
    settings.watching.server_timeout = 60
    # watching listed namespaces: no cluster-wide scanning of namespaces and CRDs, so the operator needs
    # only a Role in each of them (the CRD must exist when it starts; it is found once, through discovery)
    settings.scanning.disabled = bool(SETTINGS.namespaces)
    settings.watching.label_selectors["pods"] = LABEL_JOB  # the API server sends only the jobs' pods
    if SETTINGS.kueue:  # and only the jobs' Workloads, not every Workload of the cluster
        settings.watching.label_selectors[kueue.KUEUE_GROUP, kueue.WORKLOADS] = LABEL_JOB
    SCHEDULER = RequeueScheduler(reconcile, workers=SETTINGS.reconcile_workers)
    SCHEDULER.start()


@kopf.on.cleanup()
def stop_scheduler(**_) -> None:
    if SCHEDULER is not None:
        SCHEDULER.stop()


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
def on_change(name: str, namespace: str, **_) -> None:
    """A job was created or edited, or the operator (re)started: reconcile it now."""
    if SCHEDULER is not None:
        SCHEDULER.schedule(namespace, name, 0.0)


@kopf.on.event(GROUP, VERSION, PLURAL)
def on_job_event(event: dict, **_) -> None:
    """A deleted job: forget it. Its pods and ConfigMap are the garbage collector's (ownerReferences)."""
    if event.get("type") == "DELETED":
        meta = (event.get("object") or {}).get("metadata") or {}
        _forget(meta.get("namespace", ""), meta.get("name", ""))
        _count_phases()


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
def on_pod_event(event: dict, **_) -> None:
    """A pod of a job changed (started, failed, finished, went away): reconcile its job now."""
    meta = (event.get("object") or {}).get("metadata") or {}
    job = (meta.get("labels") or {}).get(LABEL_JOB)
    if job and SCHEDULER is not None:
        SCHEDULER.schedule(meta.get("namespace", ""), job, 0.0)


def on_workload_event(event: dict, **_) -> None:
    """A job's Kueue Workload changed (admitted, evicted, ...): reconcile its job now (the Workload's controller
    ownerReference names it). Registered only with Kueue enabled (ORBIT_KUEUE)."""
    meta = (event.get("object") or {}).get("metadata") or {}
    owner = next((r for r in meta.get("ownerReferences") or [] if r.get("controller") and r.get("kind") == KIND
                  and str(r.get("apiVersion", "")).startswith(f"{GROUP}/")), None)  # fmt: skip
    if owner and SCHEDULER is not None:
        SCHEDULER.schedule(meta.get("namespace", ""), owner.get("name", ""), 0.0)


if SETTINGS.kueue:  # clusters without Kueue never watch (nor need RBAC for) Workloads
    kopf.on.event(kueue.KUEUE_GROUP, kueue.KUEUE_VERSION, kueue.WORKLOADS, labels={LABEL_JOB: kopf.PRESENT})(on_workload_event)
