"""A real S3 endpoint for tests (moto's server on loopback) and a proxy that breaks it on demand.

`FaultProxy` sits between Orbit and moto and forwards every HTTP request, unless told to:
  - `fail()`: answer 503 ServiceUnavailable (S3's transient error) to every request;
  - `go_down()` / `come_back()`: stop listening (connections are refused) and listen again
    on the same port;
  - `hold(pattern)` / `release(forward)`: park requests whose path contains PATTERN until
    released (to freeze an upload at a chosen point, e.g. just before the manifest); with
    forward=False the parked requests are dropped, as if the client died mid-request.
Requests are counted per method so tests can see what happened.
"""

from __future__ import annotations

import http.client
import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3

ACCESS_KEY = "AKIAORBITTESTKEY0001"
SECRET_KEY = "orbit-test-secret-do-not-log-4f9a1c"


@dataclass
class S3Endpoint:
    """moto's S3 server; `env(bucket, via)` gives a child process what it needs to reach it."""

    url: str

    def env(self, url: str | None = None) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": url or self.url,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self):
        return boto3.client(
            "s3", endpoint_url=self.url, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY, region_name="us-east-1"
        )

    def new_bucket(self) -> str:
        name = f"orbit-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


_SERVICE_UNAVAILABLE = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code>'
    b"<Message>injected by the test proxy</Message></Error>"
)


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").rstrip("/").partition(":")
        self.upstream = (host, int(port))
        self.counts: Counter[str] = Counter()
        self.failing = False
        self.held_pattern: str | None = None
        self.held = threading.Event()  # set while a request is parked
        self._release = threading.Event()
        self._forward_held = True
        self._server: ThreadingHTTPServer | None = None
        self.port = 0
        self._listen()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            # HTTP/1.1 so that "Expect: 100-continue" (botocore's PUTs) is answered at once;
            # every response closes its connection: one request per connection keeps it simple
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                self.close_connection = True
                proxy.counts[self.command] += 1
                body = self._read_body()
                if proxy.held_pattern and proxy.held_pattern in self.path:
                    proxy.held.set()
                    proxy._release.wait()
                    if not proxy._forward_held:
                        proxy.counts["dropped"] += 1
                        self.close_connection = True
                        return
                if proxy.failing:
                    proxy.counts["failed"] += 1
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(_SERVICE_UNAVAILABLE)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(_SERVICE_UNAVAILABLE)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "connection")}
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body if body or self.command in ("PUT", "POST") else None, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                finally:
                    conn.close()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    # ---- faults --------------------------------------------------------------------------
    def fail(self, on: bool = True) -> None:
        self.failing = on

    def go_down(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def come_back(self) -> None:
        self._listen()

    def hold(self, pattern: str) -> None:
        self._release.clear()
        self.held.clear()
        self.held_pattern = pattern

    def release(self, forward: bool = True) -> None:
        self._forward_held = forward
        self.held_pattern = None
        self._release.set()

    def close(self) -> None:
        self.release()
        self.go_down()
