"""The few Kubernetes API calls the operator makes (the `kubernetes` client, synchronous:
kopf runs sync handlers in worker threads). Every call is idempotent: creating what
exists adopts it, deleting what is gone is done."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from orbit_operator.crd import GROUP, PLURAL, VERSION
from orbit_operator.kueue import KUEUE_GROUP, KUEUE_VERSION, WORKLOADS
from orbit_operator.pod import LABEL_JOB
from orbit_operator.pod_health import controlled_by

log = logging.getLogger(__name__)


def load_config() -> None:
    """In a pod: the service account; elsewhere: KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class Kube:
    def __init__(self) -> None:
        self.core = client.CoreV1Api()
        self.custom = client.CustomObjectsApi()

    def job(self, namespace: str, name: str) -> dict | None:
        """The RLTrainingJob as stored now (None once it is gone)."""
        return _unless_missing(lambda: self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))

    def patch_job_status(self, namespace: str, name: str, status: dict) -> None:
        """Merge-patch the status subresource (None values remove keys)."""
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {"status": status})

    def job_pods(self, namespace: str, job: str) -> list[dict]:
        """Pods labelled with JOB (the label is also checked here: not every API server filters)."""
        pods = self.core.list_namespaced_pod(namespace, label_selector=f"{LABEL_JOB}={job}")
        items = [self.core.api_client.sanitize_for_serialization(p) for p in pods.items]
        return [p for p in items if (p.get("metadata", {}).get("labels") or {}).get(LABEL_JOB) == job]

    def configmap(self, namespace: str, name: str) -> dict | None:
        found = _unless_missing(lambda: self.core.read_namespaced_config_map(name, namespace))
        return None if found is None else self.core.api_client.sanitize_for_serialization(found)

    def apply_configmap(self, body: dict) -> None:
        """Create the ConfigMap, or rewrite its data if it exists and is ours (the controller ownerReference BODY
        carries); NotOwned if it belongs to someone else (never overwrite what the operator did not make)."""
        meta = body["metadata"]
        try:
            self.core.create_namespaced_config_map(meta["namespace"], body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            existing = self.configmap(meta["namespace"], meta["name"])
            _check_owner(existing, body, "ConfigMap")
            self.core.patch_namespaced_config_map(meta["name"], meta["namespace"], {"data": body["data"]})

    def secret(self, namespace: str, name: str) -> dict | None:
        found = _unless_missing(lambda: self.core.read_namespaced_secret(name, namespace))
        return None if found is None else self.core.api_client.sanitize_for_serialization(found)

    def create_owned_secret(self, body: dict) -> dict:
        """Create the Secret, or return the existing one if it is ours; NotOwned otherwise. One that exists at the
        create and is gone at the read (a deleted job's, collected in between) is created again."""
        meta = body["metadata"]
        for _ in range(3):
            try:
                self.core.create_namespaced_secret(meta["namespace"], body)
                return body
            except ApiException as exc:
                if exc.status != 409:
                    raise
            existing = self.secret(meta["namespace"], meta["name"])
            if existing is not None:
                _check_owner(existing, body, "Secret")
                return existing
        raise NotOwned(f"Secret {meta['namespace']}/{meta['name']} keeps appearing and vanishing: will try again")

    def create_owned_network_policy(self, body: dict) -> None:
        """Create the NetworkPolicy; an existing one must be ours (NotOwned otherwise)."""
        meta, api = body["metadata"], client.NetworkingV1Api(self.core.api_client)
        try:
            api.create_namespaced_network_policy(meta["namespace"], body)
            return
        except ApiException as exc:
            if exc.status != 409:
                raise
        existing = api.api_client.sanitize_for_serialization(api.read_namespaced_network_policy(meta["name"], meta["namespace"]))
        _check_owner(existing, body, "NetworkPolicy")

    def create_pod(self, body: dict) -> bool:
        """Create the pod; False if a pod of that name exists already (an earlier reconcile made it)."""
        return _unless_exists(lambda: self.core.create_namespaced_pod(body["metadata"]["namespace"], body))

    def delete_pod(self, namespace: str, name: str) -> None:
        _unless_gone(lambda: self.core.delete_namespaced_pod(name, namespace))

    def post_event(self, obj: dict, type_: str, reason: str, message: str) -> None:
        """A core v1 Event about OBJ (a job as read: apiVersion, kind, metadata), as `kubectl describe` shows it.
        Best effort: an event that cannot be posted is logged, never a failed reconcile."""
        meta = obj["metadata"]
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": obj.get("apiVersion", f"{GROUP}/{VERSION}"), "kind": obj.get("kind", "RLTrainingJob"),
                               "name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid")},
            "type": type_, "reason": reason, "message": message[:1024], "count": 1,
            "firstTimestamp": stamp, "lastTimestamp": stamp, "source": {"component": "orbit-operator"},
            "reportingComponent": "orbit-operator",
        }  # fmt: skip
        try:
            self.core.create_namespaced_event(meta["namespace"], body)
        except ApiException as exc:
            log.warning("could not post event %s on %s/%s: %s %s", reason, meta["namespace"], meta["name"], exc.status, exc.reason)

    def workload(self, namespace: str, name: str) -> dict | None:
        """The job's Kueue Workload (kueue.py), None if there is none."""
        return _unless_missing(lambda: self.custom.get_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOADS, name))

    def create_workload(self, body: dict) -> bool:
        """Create the Workload; False if it exists (an earlier reconcile made it)."""
        namespace = body["metadata"]["namespace"]
        return _unless_exists(lambda: self.custom.create_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOADS, body))

    def patch_workload(self, namespace: str, name: str, patch: dict) -> None:
        """Merge-patch the Workload (its spec.active, spec.queueName)."""
        self.custom.patch_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOADS, name, patch)

    def delete_workload(self, namespace: str, name: str) -> None:
        _unless_gone(lambda: self.custom.delete_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOADS, name))

    def priority_class_value(self, name: str) -> int | None:
        """The PriorityClass's value (cluster-scoped), None if there is none of that name."""
        found = _unless_missing(lambda: client.SchedulingV1Api(self.core.api_client).read_priority_class(name))
        return None if found is None else int(found.value)

    def patch_workload_status(self, namespace: str, name: str, patch: dict) -> None:
        """Merge-patch the Workload's status subresource (the patch carries the resourceVersion it was decided at)."""
        self.custom.patch_namespaced_custom_object_status(KUEUE_GROUP, KUEUE_VERSION, namespace, WORKLOADS, name, patch)

    def delete_job(self, namespace: str, name: str) -> None:
        _unless_gone(lambda: self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))


class NotOwned(Exception):
    """An object of the name the operator would use belongs to someone else: the operator never touches it."""


def _check_owner(existing: dict | None, body: dict, kind: str) -> None:
    """EXISTING must be controlled by the owner BODY names (the job's UID), as observe.controlled_by decides."""
    owner = next((r for r in body["metadata"].get("ownerReferences") or [] if r.get("controller")), None)
    if existing is None or owner is None:
        return  # gone since (the next reconcile creates it), or nothing to compare with
    if not controlled_by(existing, owner["uid"]):
        meta = body["metadata"]
        raise NotOwned(f"{kind} {meta['namespace']}/{meta['name']} exists and is not this job's (no controller "
                       f"ownerReference to UID {owner['uid']}): the operator leaves it alone; delete or rename it")  # fmt: skip


def _unless_missing(call):
    """CALL's result, or None where the object is not there (404): a read of what may not exist."""
    try:
        return call()
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _unless_gone(delete) -> None:
    """Run DELETE; an object that is already gone (404) is deleted as far as we care."""
    _unless_missing(delete)


def _unless_exists(create) -> bool:
    """Run CREATE: True, or False if an object of that name exists already (409)."""
    try:
        create()
    except ApiException as exc:
        if exc.status == 409:
            return False
        raise
    return True
