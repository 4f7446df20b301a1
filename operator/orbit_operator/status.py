"""The RLTrainingJob's status, as pure functions: the finished containers' termination
messages, conditions (one per type, lastTransitionTime kept while the status does not change)
and the retry backoff. What a pod's state means is in pod_health.py; the learner's `/status`
in learner_report.py."""

from __future__ import annotations

import json
from datetime import UTC, datetime

TERMINAL = ("Succeeded", "Failed")


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _termination_document(pod: dict | None, statuses: str, name: str) -> dict | None:
    """The JSON object container NAME (in the pod status's STATUSES list) left as its termination
    message; None if it wrote none, or the message is the end of its log."""
    for container in ((pod or {}).get("status") or {}).get(statuses) or []:
        message = ((container.get("state") or {}).get("terminated") or {}).get("message", "")
        if container.get("name") == name and message.startswith("{"):
            try:
                document = json.loads(message)
            except ValueError:
                return None
            return document if isinstance(document, dict) else None
    return None


def learner_final_status(pod: dict | None) -> dict | None:
    """A finished learner's last /status: its termination message (JSON), or None (it failed and the
    message is the end of its log, or it wrote none)."""
    document = _termination_document(pod, "containerStatuses", "learner")
    return document if document is not None and "step" in document else None


def prepare_base_report(pod: dict | None) -> dict | None:
    """What prepare-base reported when it ended (its termination message, JSON): {"plan": summary} or
    {"reason": "DoesNotFit", "message": breakdown, "plan": summary}; None if it wrote none."""
    return _termination_document(pod, "initContainerStatuses", "prepare-base")


def set_condition(conditions: list[dict], type_: str, status: bool | None, reason: str, message: str, at: str | None = None,
                  generation: int | None = None) -> list[dict]:  # fmt: skip
    """CONDITIONS with TYPE set (one entry per type; STATUS None: Unknown); lastTransitionTime changes
    only when the status flips; GENERATION: the job generation the condition was decided at."""
    value = "Unknown" if status is None else ("True" if status else "False")
    out, found = [], False
    extra = {"observedGeneration": generation} if generation is not None else {}
    for condition in conditions:
        if condition.get("type") != type_:
            out.append(condition)
            continue
        found = True
        changed = condition.get("status") != value
        out.append({"type": type_, "status": value, "reason": reason, "message": message, **extra,
                    "lastTransitionTime": (at or now_iso()) if changed else condition.get("lastTransitionTime", at or now_iso())})  # fmt: skip
    if not found:
        out.append({"type": type_, "status": value, "reason": reason, "message": message, **extra, "lastTransitionTime": at or now_iso()})
    return out


def backoff_seconds(failures: int, base: float = 10.0, cap: float = 300.0) -> float:
    """Delay before the pod of attempt FAILURES + 1: 10 s, 20 s, 40 s, ... at most 5 minutes (as Jobs do)."""
    return min(cap, base * 2 ** max(0, failures - 1))
