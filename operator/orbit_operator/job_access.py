"""Who may reach a job's pod: its API key Secret and, where the operator is configured so, its
NetworkPolicy. Pure functions: no API calls (handlers.py creates them, owned by the job).

- The API key (`<job>-api-key`, key `api-key`): random per job, made once by the operator. The
  rollout, the reference server and the learner get it as ORBIT_API_KEY (orbit_runtime.api_key:
  every route but the probes' and Prometheus' needs it); prepare-base does not. The operator reads
  it to poll the learner's /status.
- The NetworkPolicy (`<job>-ingress`, ORBIT_NETWORK_POLICY): ingress to the job's pod only from
  the pod itself (its roles call each other at the pod IP), the operator's pods (the learner's
  /status port) and the monitoring namespace (the roles' metrics ports). Egress is left open:
  object storage and a base's source are wherever the job says. Whether traffic from the node
  (the kubelet's probes) is subject to a policy depends on the network plugin; the common ones
  allow it.
"""

from __future__ import annotations

import base64

from orbit_operator.pod import API_KEY_FIELD, LABEL_JOB, PORTS, job_labels, object_names
from orbit_operator.settings import OperatorSettings


def build_api_key_secret(job_name: str, namespace: str, key: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": object_names(job_name, 0)["api_key_secret"], "namespace": namespace, "labels": job_labels(job_name)},
        "data": {API_KEY_FIELD: base64.b64encode(key.encode()).decode()},
    }


def secret_values(secret: dict | None) -> list[str]:
    """Every value of a Secret as read (its `data`, base64; `stringData` is write-only), decoded."""
    values = []
    for raw in ((secret or {}).get("data") or {}).values():
        try:
            values.append(base64.b64decode(raw).decode())
        except (ValueError, UnicodeDecodeError):
            continue  # binary: it cannot appear in a text message as is
    return values


def api_key_of(secret: dict | None) -> str | None:
    raw = ((secret or {}).get("data") or {}).get(API_KEY_FIELD)
    try:
        return base64.b64decode(raw).decode() if raw else None
    except (ValueError, UnicodeDecodeError):
        return None


def build_network_policy(job_name: str, namespace: str, settings: OperatorSettings) -> dict:
    """Ingress to the job's pod from itself, the operator and the monitoring namespace, on the ports each needs."""
    pod = {"matchLabels": {LABEL_JOB: job_name}}
    metrics_ports = [{"protocol": "TCP", "port": port} for port in (*PORTS.values(), settings.learner_status_port)]
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": settings.operator_namespace}}}
    if settings.operator_pod_labels:
        operator["podSelector"] = {"matchLabels": dict(settings.operator_pod_labels)}
    ingress = [
        {"from": [{"podSelector": pod}]},  # its own roles, at the pod IP
        {"from": [operator], "ports": [{"protocol": "TCP", "port": settings.learner_status_port}]},
    ]
    if settings.monitoring_namespace:
        monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": settings.monitoring_namespace}}}
        ingress.append({"from": [monitoring], "ports": metrics_ports})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": object_names(job_name, 0)["network_policy"], "namespace": namespace, "labels": job_labels(job_name)},
        "spec": {"podSelector": pod, "policyTypes": ["Ingress"], "ingress": ingress},
    }
