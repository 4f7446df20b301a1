"""The few Kubernetes API calls the operator makes (the `kubernetes` client, synchronous:
kopf runs sync handlers in worker threads). Every call is idempotent: creating what
exists adopts it, deleting what is gone is done."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from orbit_operator.crd import GROUP, PLURAL, VERSION
from orbit_operator.pod import LABEL_JOB

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
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def patch_job_status(self, namespace: str, name: str, status: dict) -> None:
        """Merge-patch the status subresource (None values remove keys)."""
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {"status": status})

    def job_pods(self, namespace: str, job: str) -> list[dict]:
        """Pods labelled with JOB (the label is also checked here: not every API server filters)."""
        pods = self.core.list_namespaced_pod(namespace, label_selector=f"{LABEL_JOB}={job}")
        items = [self.core.api_client.sanitize_for_serialization(p) for p in pods.items]
        return [p for p in items if (p.get("metadata", {}).get("labels") or {}).get(LABEL_JOB) == job]

    def configmap(self, namespace: str, name: str) -> dict | None:
        try:
            found = self.core.read_namespaced_config_map(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return self.core.api_client.sanitize_for_serialization(found)

    def apply_configmap(self, body: dict) -> None:
        """Create the ConfigMap, or rewrite its data if it exists."""
        meta = body["metadata"]
        try:
            self.core.create_namespaced_config_map(meta["namespace"], body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            self.core.patch_namespaced_config_map(meta["name"], meta["namespace"], {"data": body["data"]})

    def create_pod(self, body: dict) -> bool:
        """Create the pod; False if a pod of that name exists already (an earlier reconcile made it)."""
        try:
            self.core.create_namespaced_pod(body["metadata"]["namespace"], body)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

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

    def delete_job(self, namespace: str, name: str) -> None:
        _unless_gone(lambda: self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))


def _unless_gone(delete) -> None:
    """Run DELETE; an object that is already gone (404) is deleted as far as we care."""
    try:
        delete()
    except ApiException as exc:
        if exc.status != 404:
            raise
