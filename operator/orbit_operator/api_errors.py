"""Which API errors are worth retrying: the taxonomy the handlers use instead of ad-hoc status
codes (as the Job controller does: a quota or rate-limit refusal is retried, an invalid pod is not).

Transient: 429 (API priority and fairness), 403 "exceeded quota" (ResourceQuota: capacity may
free up), 409 Conflict (a write raced another), 5xx and no status at all (the connection broke).
Permanent: the other 4xx — 422 (a malformed pod), 403 by Pod Security admission, 400, 404.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes.client.exceptions import ApiException

MAX_RETRY_SECONDS = 120.0


@dataclass(frozen=True)
class ApiErrorKind:
    transient: bool
    retry_after: float  # seconds (transient only): the server's Retry-After, else the caller's default
    summary: str  # "429 TooManyRequests: ..." for events and conditions


def classify(exc: ApiException, default_delay: float = 10.0, body_limit: int = 600) -> ApiErrorKind:
    """Is EXC transient (retry after `retry_after`: the server's Retry-After, else DEFAULT_DELAY) or
    permanent (report and stop)?"""
    status, body = exc.status, (exc.body or "") if isinstance(exc.body, str) else str(exc.body or "")
    summary = f"{status} {exc.reason}: {body[:body_limit]}"
    quota = status == 403 and "exceeded quota" in body
    transient = status is None or status == 0 or status in (409, 429) or status >= 500 or quota
    return ApiErrorKind(transient=transient, retry_after=_retry_after(exc, default_delay), summary=summary)


def _retry_after(exc: ApiException, default: float) -> float:
    headers = exc.headers or {}
    raw = headers.get("Retry-After") or headers.get("retry-after")
    try:
        return min(MAX_RETRY_SECONDS, max(1.0, float(raw))) if raw is not None else default
    except (TypeError, ValueError):
        return default
