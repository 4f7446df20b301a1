"""Keep credentials out of everything Orbit writes: logs, metrics, status, error messages.

Credentials reach Orbit only through the environment (or files a Secret mounts, which boto3
reads itself). Any text that may embed one - an exception from a storage client, a log line -
passes through `redact` before it is written anywhere.
"""

from __future__ import annotations

import logging
import os
import re

# Variables whose values are secret. Access key ids are not secret in AWS's model, but they
# identify the account and tests treat them as sensitive too.
SECRET_ENV_VARS = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ACCESS_KEY_ID",
)
_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.IGNORECASE)
MASK = "***"


def secret_values() -> list[str]:
    """The secret values currently in the environment (longest first, so overlaps mask fully)."""
    values = {os.environ.get(name, "") for name in SECRET_ENV_VARS}
    return sorted((v for v in values if len(v) >= 8), key=len, reverse=True)  # short values: not real keys, would mask words


def redact(text: str) -> str:
    """TEXT with every secret environment value and every URL's user:password@ masked."""
    for value in secret_values():
        text = text.replace(value, MASK)
    return _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{MASK}@", text)


class RedactingFilter(logging.Filter):
    """A logging filter that redacts the formatted message of every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return True


def environment_without_secrets(env: dict[str, str]) -> dict[str, str]:
    """ENV minus the storage credentials: child roles (vLLM, reference) never need them."""
    return {k: v for k, v in env.items() if k not in SECRET_ENV_VARS and not k.startswith("AWS_")}
