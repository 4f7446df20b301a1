"""`/metrics` (Prometheus text format), `/healthz` and, for the learner, `/status` (JSON
progress the operator copies into the job's status), on a background thread. With an API key,
every route but /metrics and /healthz needs it (orbit_runtime.api_key).

The learner runs this server; the reference server adds the same two routes to its FastAPI
app (see reference.server), and vLLM serves its own `/metrics`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from orbit_runtime.api_key import authorized


class MetricsServer:
    """Serves REGISTRY on HOST:PORT (port 0: any free port) until stop()."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, healthy: Callable[[], bool] = lambda: True,
                 status: Callable[[], dict] | None = None, api_key: str | None = None) -> None:  # fmt: skip
        self.healthy = healthy
        self.status = status
        self.api_key = api_key
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # scrapes every few seconds: keep the console quiet
                pass

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if not authorized(path, self.headers.get("Authorization"), owner.api_key):
                    body, status, ctype = b"unauthorized: /status needs the run's API key (Authorization: Bearer ...)\n", 401, "text/plain"
                elif path == "/metrics":
                    body, status, ctype = generate_latest(registry), 200, CONTENT_TYPE_LATEST
                elif path == "/healthz":
                    ok = owner.healthy()
                    body, status, ctype = (b"ok\n" if ok else b"unhealthy\n"), (200 if ok else 503), "text/plain"
                elif path == "/status" and owner.status is not None:
                    body, status, ctype = json.dumps(owner.status()).encode(), 200, "application/json"
                else:
                    body, status, ctype = b"not found: try /metrics, /healthz or /status\n", 404, "text/plain"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
