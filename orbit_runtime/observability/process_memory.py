"""Memory of a set of processes, shared pages counted once: proportional set size (PSS).

Linux splits each shared page's size between the processes that map it, so the PSS of
all of a run's processes added up counts the colocated base (one memory file mapped by
vLLM and the learner) once, and two private copies twice. Read from
/proc/PID/smaps_rollup (one file per process, cheap enough to read every step).
"""

from __future__ import annotations

import os
from pathlib import Path


def pss_bytes(pid: int) -> int | None:
    """PID's proportional set size, or None if it is gone or unreadable."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def process_tree(pid: int) -> list[int]:
    """PID and all its descendants (vLLM's API server and its engine-core process)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.Error:
        return []


def total_pss_bytes(pids: list[int]) -> int:
    """The PSS of PIDS added up (processes that are gone count 0)."""
    return sum(pss_bytes(pid) or 0 for pid in pids)


def mapping_pss_bytes(pid: int, name: str) -> int:
    """PSS of PID's mappings whose path contains NAME (e.g. 'memfd:orbit-base'): how much of that
    file this process is charged for."""
    total, inside = 0, False
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) == 6 and name in head[5]
        elif inside and line.startswith("Pss:"):
            total += int(line.split()[1]) * 1024
    return total


def servers_pss(servers: list) -> int | None:
    """PSS of this process and the process trees of SERVERS (ManagedServers; None entries skipped):
    a local run's learner, vLLM (API server and engine core) and reference server. None when the
    first (the rollout) is not a local process (a pod's container)."""
    if not servers or servers[0] is None or servers[0].pid is None:
        return None
    pids = [os.getpid()]
    for server in servers:
        if server is not None and server.pid is not None:
            pids += process_tree(server.pid)
    return total_pss_bytes(pids)
