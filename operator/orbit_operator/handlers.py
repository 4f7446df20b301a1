"""kopf handlers: observe, `reconcile.plan`, carry the plan out. Nothing is decided here.

Every event (create, update, resume after an operator restart) and a timer every
`status_poll_seconds` run the same `reconcile`, under one lock per job so the timer and an
update never interleave. A reconcile that raises is retried by kopf with backoff; no input
stops the operator (a malformed job ends up Failed/Invalid, see reconcile.plan).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import UTC, datetime

import httpx
import kopf
from kubernetes.client.exceptions import ApiException

from orbit_operator.crd import GROUP, PLURAL, VERSION
from orbit_operator.kube import Kube
from orbit_operator.pod import object_names, owner_reference
from orbit_operator.reconcile import Observed, plan, pod_rejected
from orbit_operator.settings import OperatorSettings
from orbit_operator.status import learner_final_status
from orbit_runtime.observability import metrics

log = logging.getLogger("orbit_operator")
FAULT_EXIT_AFTER_POD_CREATE = "ORBIT_FAULT_EXIT_AFTER_POD_CREATE"  # tests only: die between creating a pod and recording it
SETTINGS = OperatorSettings.from_env()
_kube: Kube | None = None
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
_phases: dict[str, str] = {}  # namespace/name -> phase, for orbit_operator_jobs


def kube() -> Kube:
    global _kube
    if _kube is None:
        from orbit_operator.kube import load_config

        load_config()
        _kube = Kube()
    return _kube


def _lock(key: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _count_phases() -> None:
    for phase in ("Pending", "Preparing", "Running", "Succeeded", "Failed", "Suspended"):
        metrics.OPERATOR_JOBS.labels(phase).set(sum(1 for p in _phases.values() if p == phase))


def learner_status(pod: dict | None) -> dict | None:
    """The learner's /status at the pod's IP; once the pod has finished, its termination message;
    None when neither is there (not running yet, not answering, or failed)."""
    if pod is not None and (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return learner_final_status(pod)
    if pod is None or (pod.get("status") or {}).get("phase") != "Running":
        return None
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    try:
        host = f"[{ip}]" if ":" in ip else ip  # an IPv6 pod IP
        response = httpx.get(f"http://{host}:{SETTINGS.learner_status_port}/status", timeout=2.0)
        response.raise_for_status()
        return response.json()
    except (httpx.HTTPError, ValueError) as exc:
        metrics.OPERATOR_STATUS_POLL_FAILURES.inc()
        log.info("learner /status of %s not available: %s", pod["metadata"]["name"], exc)
        return None


def reconcile(body: kopf.Body, logger: logging.Logger) -> None:
    """Observe, plan, act, all under the job's lock: the job is read again inside it and its status
    written directly, so the timer and an event handler never plan from each other's stale status."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    key = f"{namespace}/{name}"
    started = time.monotonic()
    outcome = "error"
    try:
        with _lock(key):
            api = kube()
            job = api.job(namespace, name)
            if job is None or job["metadata"].get("deletionTimestamp"):
                outcome = "ok"
                return
            pods = api.job_pods(namespace, name)
            attempt = int((job.get("status") or {}).get("attempt", 0))
            current = next((p for p in pods if p["metadata"]["name"] == object_names(name, attempt)["pod"]), None)
            now = datetime.now(UTC).replace(tzinfo=None)
            observed = Observed(job=job, pods=pods, configmap=api.configmap(namespace, object_names(name, 0)["configmap"]),
                                now=now, learner_status=learner_status(current))  # fmt: skip
            decided = plan(observed, SETTINGS)
            events = list(decided.events)
            owner = owner_reference(name, job["metadata"]["uid"])
            if decided.create_configmap is not None:
                decided.create_configmap["metadata"]["ownerReferences"] = [owner]
                api.apply_configmap(decided.create_configmap)
            for pod_name in decided.delete_pods:
                api.delete_pod(namespace, pod_name)
            if decided.create_pod is not None:
                decided.create_pod["metadata"]["ownerReferences"] = [owner]
                try:
                    created = api.create_pod(decided.create_pod)
                except ApiException as exc:
                    if exc.status is None or not 400 <= exc.status < 500:
                        raise
                    message = f"the API server refused pod {decided.create_pod['metadata']['name']}: {exc.status} {exc.reason}: " \
                              f"{(exc.body or '')[:600]}"  # fmt: skip
                    decided.status = pod_rejected(decided.status, message, now)
                    events = [("Warning", "PodRejected", message[:1000])]
                    created = False
                if created and os.environ.get(FAULT_EXIT_AFTER_POD_CREATE):
                    os._exit(70)  # fault injection for tests: the pod exists, the status does not say so yet
                if created:
                    metrics.OPERATOR_POD_CREATIONS.inc()
                else:  # an earlier reconcile made it, or it was refused
                    events = [e for e in events if e[1] != "PodCreated"]
            for type_, reason, message in events:
                kopf.event(body, type=type_, reason=reason, message=message)
                if reason == "DoesNotFit":  # posted once per verdict: at admission (no pod yet) or from the pod's prepare-base
                    metrics.OPERATOR_DOES_NOT_FIT.labels("prepare_base" if decided.status.get("podName") else "admission").inc()
            old = {k: v for k, v in (job.get("status") or {}).items() if not k.startswith("kopf")}
            new = {k: v for k, v in decided.status.items() if not k.startswith("kopf")}
            if new != old:  # a quiet timer tick writes nothing
                api.patch_job_status(namespace, name, {**{k: None for k in old if k not in new}, **new})
            _phases[key] = new.get("phase", "Pending")
            if decided.delete_job:
                logger.info("ttlSecondsAfterFinished passed: deleting the job")
                api.delete_job(namespace, name)
            outcome = "invalid" if any(c.get("type") == "Invalid" for c in new.get("conditions", [])) else "ok"
    finally:
        metrics.OPERATOR_RECONCILES.labels(outcome).inc()
        metrics.OPERATOR_RECONCILE_DURATION.observe(time.monotonic() - started)
        _count_phases()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    settings.posting.level = logging.INFO
    settings.persistence.finalizer = f"{GROUP}/cleanup"
    settings.watching.server_timeout = 60
    # watching listed namespaces: no cluster-wide scanning of namespaces and CRDs, so the operator needs
    # only a Role in each of them (the CRD must exist when it starts; it is found once, through discovery)
    settings.scanning.disabled = bool(SETTINGS.namespaces)


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
def on_change(body: kopf.Body, logger: logging.Logger, **_) -> None:
    reconcile(body, logger)


@kopf.timer(GROUP, VERSION, PLURAL, interval=SETTINGS.status_poll_seconds, sharp=False)
def on_timer(body: kopf.Body, logger: logging.Logger, **_) -> None:
    reconcile(body, logger)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def on_delete(body: kopf.Body, logger: logging.Logger, **_) -> None:
    """Remove the job's pods and ConfigMap (ownerReferences would too, in a cluster with a garbage collector)."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    with _lock(f"{namespace}/{name}"):
        api = kube()
        for pod in api.job_pods(namespace, name):
            api.delete_pod(namespace, pod["metadata"]["name"])
        api.delete_configmap(namespace, object_names(name, 0)["configmap"])
    _phases.pop(f"{namespace}/{name}", None)
    _count_phases()
    logger.info("deleted the pods and ConfigMap of %s/%s", namespace, name)
