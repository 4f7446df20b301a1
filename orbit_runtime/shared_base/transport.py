"""Hand a sealed arena from one process to another over a Unix socket (SCM_RIGHTS).

The learner always listens, on a socket in a private 0700 directory, and asks the rollout
engine over its authenticated HTTP API to connect: to send its base (`ArenaReceiver`), or
to fetch an adapter version (`ArenaOffer`). What crosses the socket is a memory file's
descriptor and a JSON table of contents; no tensor bytes.
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


def _send_on(sock: socket.socket, arena: Arena, meta: dict) -> None:
    header = json.dumps({"size": arena.size, "entries": arena.table(), "meta": meta}).encode()
    socket.send_fds(sock, [_LENGTH.pack(len(header))], [arena.fd])
    sock.sendall(header)


def _receive_on(sock: socket.socket, where: str) -> tuple[Arena, dict]:
    data, fds, _, _ = socket.recv_fds(sock, _LENGTH.size, 1)
    if len(fds) != 1 or len(data) != _LENGTH.size:
        for fd in fds:
            os.close(fd)
        raise TransportError(f"{where}: the sender sent no memory file")
    (length,) = _LENGTH.unpack(data)
    try:
        chunks, got = [], 0
        while got < length:
            chunk = sock.recv(min(1 << 20, length - got))
            if not chunk:
                raise TransportError(f"{where}: the table of contents was cut short ({got} of {length} bytes)")
            chunks.append(chunk)
            got += len(chunk)
        header = json.loads(b"".join(chunks))
        entries = [ArenaEntry(e["name"], e["offset"], e["dtype"], tuple(e["shape"])) for e in header["entries"]]
        size = int(header["size"])
        if size > os.fstat(fds[0]).st_size or any(e.offset + e.nbytes > size for e in entries):
            raise TransportError(f"{where}: the table of contents does not fit the memory file sent")
    except BaseException:
        os.close(fds[0])
        raise
    return Arena(fds[0], size, entries), header["meta"]


def _connect(socket_path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60.0)
    try:
        sock.connect(socket_path)
    except OSError:
        sock.close()
        raise
    return sock


def send_arena(socket_path: str, arena: Arena, meta: dict) -> None:
    """Connect to SOCKET_PATH (an ArenaReceiver) and send ARENA's descriptor, table and META."""
    with _connect(socket_path) as sock:
        _send_on(sock, arena, meta)


def fetch_arena(socket_path: str) -> tuple[Arena, dict]:
    """Connect to SOCKET_PATH (an ArenaOffer) and receive its arena (the caller owns the descriptor)."""
    with _connect(socket_path) as sock:
        return _receive_on(sock, socket_path)


SHARE_DIR_ENV = "ORBIT_SHARE_DIR"  # where the sockets go; in a pod a volume the rollout container mounts at the same path


class _Listener:
    """A listening socket in a fresh 0700 directory under DIRECTORY (default: $ORBIT_SHARE_DIR, else the
    temp dir). Unix socket paths are limited to ~107 bytes, so the directory is short-named."""

    def __init__(self, directory: Path | None = None) -> None:
        directory = directory or os.environ.get(SHARE_DIR_ENV) or None
        self.directory = Path(tempfile.mkdtemp(prefix="orbit-", dir=directory))
        self.path = str(self.directory / "s")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(1)

    def _accept(self, timeout_s: float, what: str) -> socket.socket:
        self._sock.settimeout(timeout_s)
        try:
            conn, _ = self._sock.accept()
        except TimeoutError:
            raise TransportError(f"no process {what} {self.path} within {timeout_s:.0f}s") from None
        except OSError as exc:  # closed while waiting
            raise TransportError(f"stopped waiting at {self.path}: {exc}") from None
        conn.settimeout(timeout_s)
        return conn

    def close(self) -> None:
        """Stop listening (a thread blocked in accept wakes with an error) and remove the directory."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class ArenaReceiver(_Listener):
    """Waits for one process to connect and send an arena."""

    def receive(self, timeout_s: float) -> tuple[Arena, dict]:
        """Accept one sender and read its arena (the caller owns the descriptor)."""
        with self._accept(timeout_s, "sent the shared base to") as conn:
            return _receive_on(conn, self.path)


class ArenaOffer(_Listener):
    """Waits for one process to connect and fetch an arena."""

    def send(self, arena: Arena, meta: dict, timeout_s: float) -> None:
        with self._accept(timeout_s, "fetched the arena offered at") as conn:
            _send_on(conn, arena, meta)
