"""The run's API key: what the roles' HTTP servers ask of every caller that could change the run or
sample the model.

The rollout (vLLM, with runtime LoRA loading), the reference server and the learner's `/status`
listen on the pod IP, which every pod on the network can reach. Each run has one random key, in
`ORBIT_API_KEY`: in a cluster from a Secret the operator creates for the job (the serving roles
and the learner get it, prepare-base does not); locally `orbit train` makes one for the run's
child servers. Every request must carry `Authorization: Bearer <key>` except the read-only
routes the kubelet's probes and Prometheus use (`OPEN_PATHS`), which cannot carry a secret.

vLLM's own `--api-key` guards only paths under /v1, /v2, /inference and /cohere: SageMaker's
`/invocations` (generation) and `/scale_elastic_ep` stay open. So Orbit installs its own ASGI
middleware in vLLM (`--middleware`), which guards every path but the open ones.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

API_KEY_ENV = "ORBIT_API_KEY"
OPEN_PATHS = frozenset({"/health", "/healthz", "/metrics"})  # probes and scrapes: read-only, no run data
MIDDLEWARE = "orbit_runtime.api_key.ApiKeyMiddleware"  # vLLM's --middleware import path

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


def api_key() -> str | None:
    """The run's key, or None where none is set (a local role started by hand: nothing is checked)."""
    return os.environ.get(API_KEY_ENV) or None


def new_api_key() -> str:
    """A fresh random key (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def auth_headers(key: str | None = None) -> dict[str, str]:
    """The header a client sends (none without a key)."""
    key = key if key is not None else api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def authorized(path: str, authorization: str | None, key: str | None) -> bool:
    """May a request for PATH with this Authorization header go through? Constant-time comparison."""
    if key is None or path in OPEN_PATHS:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode())


class ApiKeyMiddleware:
    """Pure ASGI middleware: 401 for any HTTP or websocket request without the run's key, except OPEN_PATHS.
    Reads the key from the environment when the app is built (vLLM's `--middleware` passes no arguments)."""

    def __init__(self, app: ASGIApp, key: str | None = None) -> None:
        self.app = app
        self.key = key if key is not None else api_key()

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] in ("http", "websocket"):
            path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            if not authorized(path, headers.get("authorization"), self.key):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = b'{"error": "unauthorized: this route needs the run\'s API key (Authorization: Bearer ...)"}'
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                        (b"www-authenticate", b"Bearer")]})  # fmt: skip
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
