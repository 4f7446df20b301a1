"""Keep credentials out of everything Orbit writes: logs, metrics, status, error messages.

Credentials reach Orbit only through the environment (or files a Secret mounts, which boto3
reads itself). Any text that may embed one - an exception from a storage client, a log line -
passes through `redact` before it is written anywhere.
"""

from __future__ import annotations

import logging
import os
import re

from orbit_runtime.api_key import API_KEY_ENV

# Variables whose values are secret. Access key ids are not secret in AWS's model, but they
# identify the account and tests treat them as sensitive too.
SECRET_ENV_VARS = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ACCESS_KEY_ID",
)
# Set by the operator on the learner: the names of every variable its Secrets put into the environment
# (envFrom), whatever they are called, so that their values are masked too.
REDACT_ENV = "ORBIT_REDACT_ENV"
_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)
MASK = "***"
MIN_SECRET_LENGTH = 8


def secret_env_names(env: dict[str, str] | None = None) -> set[str]:
    """The variables whose values are secret: the storage ones, the run's API key, and those REDACT_ENV names."""
    env = os.environ if env is None else env
    named = {n.strip() for n in env.get(REDACT_ENV, "").split(",") if n.strip()}
    return {*SECRET_ENV_VARS, API_KEY_ENV, *named}


def secret_values() -> list[str]:
    """The secret values currently in the environment (longest first, so overlaps mask fully)."""
    return usable_secrets(os.environ.get(name, "") for name in secret_env_names())


def usable_secrets(values) -> list[str]:
    """VALUES worth masking, longest first (so overlaps mask fully), and each line of a multi-line one (a PEM
    key, a JSON credential: a log may quote one line). Values under 8 characters are not masked: they are not
    real keys, and masking them would mask ordinary words."""
    out = set()
    for value in values:
        out.update(part.strip() for part in [value, *value.splitlines()])
    return sorted((v for v in out if len(v) >= MIN_SECRET_LENGTH), key=len, reverse=True)


def mask(text: str, values: list[str]) -> str:
    """TEXT with each of VALUES (usable_secrets) and every URL's user:password@ masked."""
    for value in values:
        text = text.replace(value, MASK)
    return _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{MASK}@", text)


def mask_all(obj, values: list[str]):
    """OBJ (JSON-like: dicts, lists, strings) with every string masked (mask)."""
    if isinstance(obj, str):
        return mask(obj, values)
    if isinstance(obj, dict):
        return {k: mask_all(v, values) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(mask_all(v, values) for v in obj)
    return obj


def redact(text: str) -> str:
    """TEXT with every secret environment value and every URL's user:password@ masked."""
    return mask(text, secret_values())


class RedactingFilter(logging.Filter):
    """A logging filter that redacts the formatted message of every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


def environment_without_secrets(env: dict[str, str]) -> dict[str, str]:
    """ENV minus the storage credentials and whatever else a Secret put there (REDACT_ENV): child roles (vLLM,
    reference) never need them. The run's API key stays: the child servers check it."""
    secret = secret_env_names(env) - {API_KEY_ENV}
    return {k: v for k, v in env.items() if k not in secret and not k.startswith("AWS_")}
