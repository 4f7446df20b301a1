"""A role server that closes a request without an answer (the keep-alive race: the server drops an
idle connection just as the learner sends on it) does not fail the run: the request is sent again
once. A real HTTP server on loopback does the dropping."""

import socketserver
import threading
import time

import httpx
import pytest

from orbit_runtime.observability import metrics
from orbit_runtime.processes import free_port
from orbit_runtime.trainer.roles import SupervisedRole


class _DropFirst(socketserver.BaseRequestHandler):
    dropped = 0
    drops = 1

    def handle(self) -> None:
        self.request.recv(65536)
        if _DropFirst.dropped < _DropFirst.drops:
            _DropFirst.dropped += 1
            return  # closed without a response
        body = b'{"ok": true}'
        self.request.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )


class _External(SupervisedRole):
    role = "rollout"

    def healthy(self) -> bool:
        return True  # it answers its health check: not dead, just a dropped request


@pytest.fixture
def server():
    _DropFirst.dropped = 0
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _DropFirst) as srv:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{srv.server_address[1]}"
        srv.shutdown()


def test_a_request_closed_without_an_answer_is_sent_again_once(server):
    role = _External(max_restarts=0, restarts_metric=metrics.ROLLOUT_RESTARTS, url=server)
    before = metrics.ROLE_REQUESTS_RESENT.labels("rollout")._value.get()
    with httpx.Client() as client:
        assert role.supervised(lambda: client.get(server + "/v1/completions").json()) == {"ok": True}
    assert metrics.ROLE_REQUESTS_RESENT.labels("rollout")._value.get() == before + 1
    _DropFirst.dropped, _DropFirst.drops = 0, 2  # dropped twice: a real problem, raised (not resent forever)
    try:
        with httpx.Client() as client, pytest.raises(httpx.RemoteProtocolError):
            role.supervised(lambda: client.get(server + "/v1/completions").json())
    finally:
        _DropFirst.drops = 1


def _answers_health(url: str) -> bool:
    """Does the server at URL answer its health check with 200 right now?"""
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class _Ok(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.recv(65536)
        body = b'{"ok": true}'
        self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


class _Returning(SupervisedRole):
    """An external role (the pod's reference container) reached over loopback; restoring its state takes a while."""

    role = "reference"

    def __init__(self, url: str) -> None:
        super().__init__(max_restarts=1, restarts_metric=metrics.REFERENCE_RESTARTS, url=url, wait_s=30.0)
        self.resynced = False

    def healthy(self) -> bool:
        return _answers_health(self.url)

    def start(self) -> None:
        self.wait_until_up()

    def stop(self) -> None:
        pass

    def _after_restart(self) -> None:
        time.sleep(0.2)
        self.resynced = True


def test_a_role_recovery_is_timed_by_phase():
    """orbit_learner_role_recovery_seconds{role, phase}: how long the server took to come back, and the resync after.
    The server is down when the request is made and starts listening on its port 1.2 s later."""

    def observed(phase: str) -> tuple[float, float]:
        samples = {s.name: s.value for s in metrics.ROLE_RECOVERY_DURATION.collect()[0].samples
                   if s.labels.get("phase") == phase and s.labels.get("role") == "reference"}  # fmt: skip
        return samples.get("orbit_learner_role_recovery_seconds_count", 0.0), samples.get("orbit_learner_role_recovery_seconds_sum", 0.0)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    servers: list[socketserver.ThreadingTCPServer] = []

    def come_back() -> None:
        time.sleep(1.2)
        srv = socketserver.ThreadingTCPServer(("127.0.0.1", port), _Ok)
        servers.append(srv)
        srv.serve_forever()

    (restarts, restart_s), (resyncs, resync_s) = observed("restart"), observed("resync")
    role = _Returning(url)
    threading.Thread(target=come_back, daemon=True).start()
    try:
        with httpx.Client() as client:
            assert role.supervised(lambda: client.get(url + "/v1/completions").json()) == {"ok": True}
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
    assert role.resynced and role.restarts == 1
    (restarts2, restart_s2), (resyncs2, resync_s2) = observed("restart"), observed("resync")
    assert (restarts2, resyncs2) == (restarts + 1, resyncs + 1)
    assert restart_s2 - restart_s >= 1.0  # waited for the server to answer again (~1.2 s, polled each second)
    assert 0.2 <= resync_s2 - resync_s < 1.0


# A child server that, like vLLM shutting down after its engine died, resets the connection of the
# request in flight and then keeps running for a while without answering its health check. The
# second instance (the restart) answers.
SHUTTING_DOWN_SERVER = """
import http.server, json, os, socket, struct, sys, time
port, marker = int(sys.argv[1]), sys.argv[2]
first = not os.path.exists(marker)
open(marker, "a").close()
state = {"dying": False}

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer(503 if state["dying"] else 200, {"health": not state["dying"]})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if first:
            state["dying"] = True
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()  # RST: the client reads "connection reset by peer"
            return
        self._answer(200, {"ok": True, "pid": os.getpid()})

http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


class _Managed(SupervisedRole):
    """A role whose server is a child process Orbit started (`orbit train`'s local roles)."""

    role = "rollout"

    def __init__(self, tmp_path) -> None:
        super().__init__(max_restarts=1, restarts_metric=metrics.ROLLOUT_RESTARTS)
        self.tmp_path = tmp_path
        (tmp_path / "server.py").write_text(SHUTTING_DOWN_SERVER)

    def start(self) -> None:
        import sys

        from orbit_runtime.processes import ManagedServer

        port = free_port()
        command = [sys.executable, str(self.tmp_path / "server.py"), str(port), str(self.tmp_path / "started-once")]
        self.server = ManagedServer(command, port=port, host="127.0.0.1", env={}, log_path=self.tmp_path / "server.log")
        self.server.start(timeout_s=30)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace_s=2.0)

    def healthy(self) -> bool:
        return _answers_health(self.server.base_url)


def test_a_child_server_that_resets_its_requests_and_stops_answering_is_restarted(tmp_path):
    """Seen in a long run: vLLM's server shut down (its process still exiting) and the learner got
    `ReadError: connection reset by peer`. A child that still runs but fails its health check is as
    good as dead: it is restarted and the request retried, not raised (which ended the run)."""
    role = _Managed(tmp_path)
    role.start()
    first_pid = role.server.pid
    try:
        answer = role.supervised(lambda: httpx.post(role.server.base_url + "/v1/completions", json={}, timeout=10).json())
    finally:
        role.stop()
    assert answer["ok"] and answer["pid"] != first_pid  # answered by the restarted server
    assert role.restarts == 1
