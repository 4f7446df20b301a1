"""Hand a sealed arena from one process to another over a Unix socket (SCM_RIGHTS).

The receiving side (the learner) listens on a socket in a private directory and asks the
rollout engine, over its authenticated HTTP API, to connect and send. What crosses the
socket is the memory file's descriptor and a JSON table of contents; no tensor bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import tempfile
from pathlib import Path

from orbit_runtime.shared_base.arena import Arena, ArenaEntry

_LENGTH = struct.Struct("!Q")  # the header's length, sent with the descriptor


class TransportError(RuntimeError):
    """The arena did not arrive (nobody connected, or the message was cut short)."""


def send_arena(socket_path: str, arena: Arena, meta: dict) -> None:
    """Connect to SOCKET_PATH and send ARENA's descriptor, table and META."""
    header = json.dumps({"size": arena.size, "entries": arena.table(), "meta": meta}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60.0)
        sock.connect(socket_path)
        socket.send_fds(sock, [_LENGTH.pack(len(header))], [arena.fd])
        sock.sendall(header)


class ArenaReceiver:
    """A listening socket in a fresh 0700 directory under DIRECTORY (default: the temp dir).

    Unix socket paths are limited to ~107 bytes, so the directory is short-named."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="orbit-base-", dir=directory))
        self.path = str(self.directory / "s")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(1)

    def receive(self, timeout_s: float) -> tuple[Arena, dict]:
        """Accept one sender and read its arena (the caller owns the descriptor)."""
        self._sock.settimeout(timeout_s)
        try:
            conn, _ = self._sock.accept()
        except TimeoutError:
            raise TransportError(f"no process sent the shared base to {self.path} within {timeout_s:.0f}s") from None
        with conn:
            conn.settimeout(timeout_s)
            data, fds, _, _ = socket.recv_fds(conn, _LENGTH.size, 1)
            if len(fds) != 1 or len(data) != _LENGTH.size:
                for fd in fds:
                    os.close(fd)
                raise TransportError(f"{self.path}: the sender sent no memory file")
            (length,) = _LENGTH.unpack(data)
            chunks, got = [], 0
            while got < length:
                chunk = conn.recv(min(1 << 20, length - got))
                if not chunk:
                    os.close(fds[0])
                    raise TransportError(f"{self.path}: the table of contents was cut short ({got} of {length} bytes)")
                chunks.append(chunk)
                got += len(chunk)
        header = json.loads(b"".join(chunks))
        entries = [ArenaEntry(e["name"], e["offset"], e["dtype"], tuple(e["shape"])) for e in header["entries"]]
        return Arena(fds[0], header["size"], entries), header["meta"]

    def close(self) -> None:
        self._sock.close()
        shutil.rmtree(self.directory, ignore_errors=True)
