"""The job's Secrets, as the operator uses them: its API key (made here, once, owned by the job; read
to poll the learner's /status) and the values of every Secret the job names, masked in whatever
the operator writes (status conditions, events, its log), whatever the Secret's keys are called.

Reads are cached for CACHE_SECONDS per job (its UID and the Secrets it names: a re-created job or a
changed credentialsSecret reads again): a quiet poll costs no API call, a rotated credential is
masked within a minute. A Secret the operator may not read (403) raises SecretsUnreadable: the
caller writes nothing that could quote it. Thin I/O over job_access.py's pure builders.
"""

from __future__ import annotations

import logging
import threading
import time

from kubernetes.client.exceptions import ApiException

from orbit_operator import job_access
from orbit_operator.kube import Kube
from orbit_operator.pod import object_names, owner_reference
from orbit_operator.pod_health import controlled_by
from orbit_operator.settings import OperatorSettings
from orbit_runtime.api_key import new_api_key
from orbit_runtime.redaction import REDACT_ENV, mask, mask_all, usable_secrets

CACHE_SECONDS = 60.0
_lock = threading.Lock()
# (namespace, job, uid, named Secrets) -> (read at, values to mask, API key)
_cache: dict[tuple, tuple[float, list[str], str | None]] = {}


class SecretsUnreadable(Exception):
    """A Secret the job names cannot be read (not a 404): its values could not be masked."""


def named_secrets(job: dict) -> list[tuple[str, str]]:
    """The Secrets the job's spec names, as (the container that gets it, its name) pairs (read defensively:
    the spec may be invalid)."""
    spec = job.get("spec") if isinstance(job.get("spec"), dict) else {}
    names = []
    for section, field, container in (("checkpoint", "credentialsSecret", "learner"), ("run", "trackingSecret", "learner"),
                                      ("base", "credentialsSecret", "prepare-base")):  # fmt: skip
        value = (spec.get(section) or {}).get(field) if isinstance(spec.get(section), dict) else None
        if isinstance(value, str) and value:
            names.append((container, value))
    return names


def ensure_access(api: Kube, job: dict, settings: OperatorSettings) -> None:
    """The objects the job's pod needs before it exists: its API key Secret and, if configured, its
    NetworkPolicy, both owned by the job. kube.NotOwned if one of those names is taken by someone else."""
    meta = job["metadata"]
    owner = [owner_reference(meta["name"], meta["uid"])]
    secret = job_access.build_api_key_secret(meta["name"], meta["namespace"], new_api_key())
    secret["metadata"]["ownerReferences"] = owner
    api.create_owned_secret(secret)
    forget(meta["namespace"], meta["name"])  # read again: the key the pod will get
    if settings.network_policy:
        policy = job_access.build_network_policy(meta["name"], meta["namespace"], settings)
        policy["metadata"]["ownerReferences"] = owner
        api.create_owned_network_policy(policy)


def add_redact_env(api: Kube, job: dict, pod: dict) -> None:
    """Tell the containers that get a Secret (envFrom) which of their variables it holds (REDACT_ENV: its key
    names), so that they mask the values in their logs and termination messages whatever the keys are called."""
    keys: dict[str, set[str]] = {}
    for container_name, secret_name in named_secrets(job):
        data = (_get(api, job["metadata"]["namespace"], secret_name) or {}).get("data") or {}
        keys.setdefault(container_name, set()).update(data)
    for container in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
        if keys.get(container["name"]):
            container["env"].append({"name": REDACT_ENV, "value": ",".join(sorted(keys[container["name"]]))})


def _get(api: Kube, namespace: str, name: str) -> dict | None:
    try:
        return api.secret(namespace, name)  # None on a 404: nothing to mask
    except ApiException as exc:
        raise SecretsUnreadable(f"cannot read Secret {namespace}/{name} ({exc.status} {exc.reason}): its values "
                                "could not be masked, so nothing that might quote them is written") from None  # fmt: skip


def _read(api: Kube, job: dict) -> tuple[list[str], str | None]:
    meta = job["metadata"]
    names = named_secrets(job)
    key = (meta["namespace"], meta["name"], meta.get("uid"), tuple(sorted({name for _, name in names})))
    with _lock:
        cached = _cache.get(key)
    if cached is not None and cached[2] is not None and time.monotonic() - cached[0] < CACHE_SECONDS:
        return cached[1], cached[2]
    values: list[str] = []
    for name in key[3]:
        values += job_access.secret_values(_get(api, meta["namespace"], name))
    stored = _get(api, meta["namespace"], object_names(meta["name"], 0)["api_key_secret"])
    api_key = job_access.api_key_of(stored) if controlled_by(stored, meta.get("uid")) else None  # never a foreign one
    values = usable_secrets([*values, *([api_key] if api_key else [])])
    with _lock:
        for old in [k for k in _cache if k[:2] == key[:2] and k != key]:  # a re-created job, another Secret named
            del _cache[old]
        _cache[key] = (time.monotonic(), values, api_key)
    return values, api_key


def api_key(api: Kube, job: dict) -> str | None:
    """The job's API key (None before its Secret exists)."""
    return _read(api, job)[1]


def redacted(api: Kube, job: dict, obj):
    """OBJ (a status, event messages) with every value of the job's Secrets masked."""
    values, _ = _read(api, job)
    return mask_all(obj, values)


def forget(namespace: str, name: str) -> None:
    with _lock:
        for key in [k for k in _cache if k[:2] == (namespace, name)]:
            del _cache[key]


def _known_values() -> list[str]:
    with _lock:
        return usable_secrets(v for _, values, _ in _cache.values() for v in values)


class RedactingLogFilter(logging.Filter):
    """Masks the values of the Secrets of the jobs the operator knows in each record it sees, its traceback
    included. Installed on the root logger's handlers and on kopf's per-object logger (whose records kopf
    also posts as Events). Never raises: a record it cannot format is left to logging's own error handling."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            values = _known_values()
            if not values:
                return True
            message = record.getMessage()
            cleaned = mask(message, values)
            if cleaned != message:
                record.msg, record.args = cleaned, None
            if record.exc_info and not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            if record.exc_text:
                record.exc_text = mask(record.exc_text, values)
        except Exception:  # noqa: BLE001 - a filter must never break the logging call
            pass
        return True
