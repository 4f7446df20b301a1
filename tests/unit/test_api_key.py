"""The run's API key on Orbit's own servers: the learner's /status (a real HTTP server on loopback)
and the ASGI middleware the reference server and vLLM run (a real Starlette app)."""

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from orbit_runtime.api_key import ApiKeyMiddleware, auth_headers, authorized
from orbit_runtime.observability.server import MetricsServer

KEY = "k3y-for-this-run-only"


@pytest.fixture
def learner_server():
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, status=lambda: {"step": 3}, api_key=KEY).start()
    yield server
    server.stop()


def test_the_learners_status_needs_the_key_but_probes_and_scrapes_do_not(learner_server):
    url = learner_server.url
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        assert httpx.get(f"{url}/status", headers=headers).status_code == 401, headers
    assert httpx.get(f"{url}/status", headers=auth_headers(KEY)).json() == {"step": 3}
    assert httpx.get(f"{url}/metrics").status_code == 200 and httpx.get(f"{url}/healthz").status_code == 200


def test_without_a_key_nothing_is_checked():
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, status=lambda: {"step": 1}).start()
    try:
        assert httpx.get(f"{server.url}/status").json() == {"step": 1}
    finally:
        server.stop()
    assert auth_headers("") == {} and authorized("/v1/anything", None, None)


def test_the_middleware_guards_every_route_but_the_open_ones():
    async def ok(request):
        return PlainTextResponse("ok")

    routes = [Route(path, ok, methods=["GET", "POST"]) for path in ("/health", "/metrics", "/v1/load_lora_adapter", "/invocations", "/")]
    client = TestClient(ApiKeyMiddleware(Starlette(routes=routes), key=KEY))
    for path in ("/v1/load_lora_adapter", "/invocations", "/"):
        assert client.post(path).status_code == 401 and client.post(path, headers={"Authorization": "Bearer x"}).status_code == 401
        assert client.post(path, headers=auth_headers(KEY)).text == "ok"
    assert client.get("/health").text == "ok" and client.get("/metrics").text == "ok"


@pytest.mark.parametrize("path", ["//health", "/health/", "/health/../invocations", "/HEALTH", "/metrics/x", "/healthz%00"])
def test_no_path_trick_reaches_a_guarded_route_without_the_key(path):
    """Raw ASGI scopes (an HTTP client would normalise these paths): only the exact open paths pass."""
    import asyncio

    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "root_path": "", "headers": [], "method": "POST"}
    asyncio.run(ApiKeyMiddleware(app, key=KEY)(scope, None, send))
    assert not reached and sent[0]["status"] == 401
    asyncio.run(ApiKeyMiddleware(app, key=KEY)({**scope, "path": "/v1/x", "root_path": "/health"}, None, send))
    assert not reached  # a root_path never opens a route
