"""A role server that closes a request without an answer (the keep-alive race: the server drops an
idle connection just as the learner sends on it) does not fail the run: the request is sent again
once. A real HTTP server on loopback does the dropping."""

import socketserver
import threading

import httpx
import pytest

from orbit_runtime.observability import metrics
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
