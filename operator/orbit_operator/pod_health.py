"""What a pod's state means for its job, as pure functions of the pod object: its phase for the
job, whether it is ready (the kubelet's `Ready` condition, not its phase), why not, why it
failed, whether it was disrupted rather than failed, and which attempt it is."""

from __future__ import annotations

from orbit_operator.pod import LABEL_ATTEMPT

# the reasons Kubernetes gives a pod whose node stopped answering (node lifecycle controller, taint eviction)
NODE_LOST_REASONS = ("NodeLost", "NodeNotReady", "NodeUnreachable", "DeletionByTaintManager")


def _statuses(pod: dict) -> list[dict]:
    status = pod.get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def _condition(pod: dict, type_: str) -> dict | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == type_), None)


def controlled_by(obj: dict | None, uid: str | None) -> bool:
    """Is OBJ's controller ownerReference the object with UID (the Job controller's ControllerRef rule)?"""
    refs = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
    return bool(uid) and any(ref.get("controller") and ref.get("uid") == uid for ref in refs)


def attempt_of(pod: dict) -> int | None:
    """The attempt the pod was created for (its label), None if it has none that parses."""
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_ATTEMPT)
    return int(value) if isinstance(value, str) and value.isdigit() else None


def terminating(pod: dict) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def phase_of_pod(pod: dict) -> str:
    """The job phase a pod's state means: Preparing (init containers running), Running, Succeeded, Failed, Pending."""
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    if phase in ("Succeeded", "Failed", "Running"):
        return phase
    init_states = status.get("initContainerStatuses") or []
    if any((s.get("state") or {}).get("running") for s in init_states if s.get("name") == "prepare-base"):
        return "Preparing"
    return "Pending"


def disrupted(pod: dict) -> bool:
    """Did the pod fail because it was preempted, evicted or taken back (a `DisruptionTarget` condition,
    as Jobs' podFailurePolicy reads it), rather than because the learner failed?"""
    condition = _condition(pod, "DisruptionTarget")
    return bool(condition and condition.get("status") == "True")


def disruption_reason(pod: dict) -> str:
    condition = _condition(pod, "DisruptionTarget") or {}
    return f"{condition.get('reason', 'Disrupted')}: {condition.get('message', '')}".rstrip(": ")


def unready(pod: dict) -> tuple[str, str] | None:
    """(reason, message) why a running pod is not ready, None when its `Ready` condition is True and
    no container is crash-looping: PodTerminating, NodeUnreachable, ContainerCrashLooping, NotReady."""
    status = pod.get("status") or {}
    name = (pod.get("metadata") or {}).get("name", "")
    ready = _condition(pod, "Ready") or {}
    if terminating(pod):
        evicted = (_condition(pod, "DisruptionTarget") or {}).get("reason")  # DeletionByTaintManager: the node is unreachable
        if status.get("reason") in NODE_LOST_REASONS or ready.get("reason") in NODE_LOST_REASONS or evicted in NODE_LOST_REASONS:
            return (
                "NodeUnreachable",
                f"pod {name} is terminating: its node does not answer ({status.get('reason') or ready.get('reason')})",
            )
        return "PodTerminating", f"pod {name} is terminating"
    for container in _statuses(pod):
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") == "CrashLoopBackOff":
            return (
                "ContainerCrashLooping",
                f"{container.get('name')}: CrashLoopBackOff ({container.get('restartCount', 0)} restarts)",
            )
    if ready.get("status") != "True":
        return "NotReady", ready.get("message") or f"pod {name} is not ready"
    return None


def pending_reason(pod: dict) -> str:
    """Why a pod has not started: a container waiting reason (ImagePullBackOff, CreateContainerConfigError, ...)
    or the scheduler's message; empty if it is just starting."""
    for container in _statuses(pod):
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
            return f"{container.get('name')}: {waiting['reason']}" + (
                f" ({waiting['message']})" if waiting.get("message") else ""
            )
    scheduled = _condition(pod, "PodScheduled")
    if scheduled and scheduled.get("status") == "False":
        return f"unschedulable: {scheduled.get('message') or scheduled.get('reason', '')}"
    if (pod.get("spec") or {}).get("schedulingGates"):
        return (
            "waiting for admission (scheduling gates: "
            + ", ".join(g.get("name", "") for g in pod["spec"]["schedulingGates"])
            + ")"
        )
    return ""


def scheduled(pod: dict) -> bool:
    """Has the pod left the queue (bound to a node)? activeDeadlineSeconds counts from then."""
    condition = _condition(pod, "PodScheduled")
    return bool((pod.get("spec") or {}).get("nodeName")) or bool(condition and condition.get("status") == "True")


def failure_reason(pod: dict) -> str:
    """The first terminated container's reason and exit code, e.g. 'learner: Error (exit 1)'."""
    status = pod.get("status") or {}
    for container in [*(status.get("containerStatuses") or []), *(status.get("initContainerStatuses") or [])]:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated and terminated.get("exitCode", 0) != 0:
            reason = f"{container.get('name')}: {terminated.get('reason', 'Error')} (exit {terminated.get('exitCode')})"
            last_line = next((line for line in reversed((terminated.get("message") or "").splitlines()) if line.strip()), "")
            # an error exit's message is the end of its log (FallbackToLogsOnError): its last line says why;
            # after a signal (exit > 128) the log just stops, so it is not quoted
            quote = last_line and not last_line.startswith("{") and terminated.get("exitCode", 0) < 128
            return f"{reason}: {last_line.strip()[:300]}" if quote else reason
    return status.get("reason") or status.get("message") or "pod failed"
