"""A test node: runs the emulator's pods as sandboxed processes on this machine (a small kubelet).
This module claims pods and hands each to a thread (tests/e2e/pod_runner.py); the containers'
sandboxes are built from tests/e2e/sandbox.py.

The operator creates pods in the API (tests/kube/emulator/); :class:`ProcessNode` plays the
kubelet of one node, so a job really runs: its containers' commands run here, each in a
`bwrap` (bubblewrap) sandbox that reproduces what the pod asks for.

What it does, as a kubelet would:

* **Claims** every unfinished pod that no node runs (sets ``spec.nodeName``: there is no
  scheduler) and gives it its own **pod IP**, a loopback address ``127.0.0.<n>``, written to
  ``status.podIP`` before any container starts. All containers of a pod share it; two pods
  never do, so their roles can use the same ports (the roles bind to the pod IP).
* **Volumes**: emptyDir (a directory per pod), hostPath (the host path; ``DirectoryOrCreate``
  creates it), configMap and secret (their keys written as files, always read-only), with
  ``subPath`` (created when missing, as the kubelet does) and ``readOnly`` (a read-only bind:
  writes fail with EROFS in the sandbox).
* **Sandbox** per container: its own user (``runAsUser``/``runAsGroup`` in a user namespace),
  PID (the command is PID 1, as in a container: SIGTERM only reaches it if it handles it),
  IPC and UTS namespaces; a root made of the host's directories bound read-only, on a tmpfs
  that is itself remounted read-only when ``readOnlyRootFilesystem`` is true; the pod's
  mounts at their mount paths; ``/dev``, ``/proc``; the environment (``value`` with ``$(VAR)``
  expansion, ``fieldRef``, ``secretKeyRef``, ``configMapKeyRef``, ``envFrom``); ``workingDir``;
  ``command`` + ``args`` expanded the same way.
* **Order**: init containers one after another (each to completion; a failure fails the pod
  under ``restartPolicy: Never``); native sidecars (init containers with ``restartPolicy:
  Always``) started in order, the next one waiting until the sidecar's ``startupProbe``
  passes, restarted whenever they exit (``restartCount``), stopped after the main containers
  in reverse order; then the main containers. The pod is Succeeded when every main container
  exited 0, else Failed (``restartPolicy: Never``; ``OnFailure``/``Always`` restart them).
* **Probes**: ``startupProbe`` (a container that misses its deadline is killed and restarted)
  and ``readinessProbe`` (the ``ready`` flags and conditions), ``httpGet`` at the pod IP. They
  are polled every :attr:`ProcessNode.probe_interval` seconds rather than ``periodSeconds``;
  the startup deadline is ``initialDelaySeconds + periodSeconds * failureThreshold``.
* **Status**: phase, conditions, podIP(s), hostIP, ``initContainerStatuses`` and
  ``containerStatuses`` with waiting/running/terminated states, exit codes (128+N for a signal,
  137 for SIGKILL), ``lastState`` and ``restartCount``, written through the status subresource.
* **Deletion**: a pod marked for deletion (the emulator's graceful deletion) gets SIGTERM in
  its main containers, then its sidecars in reverse order, SIGKILL after
  ``deletionGracePeriodSeconds``; the node then removes the pod (DELETE with grace 0).

Not emulated: images (the host's files and this Python environment stand in for every image:
the host root is visible read-only, and the repository, the venv and the interpreter are bound
again where a pod volume hides them), resource requests and limits, scheduling (nodeSelector,
affinity, taints), livenessProbe, network isolation (the pods share the host's network
namespace: only the distinct pod IPs separate them), persistentVolumeClaim volumes (such a pod
fails with reason ``Unsupported``), image pulls, and container logs through the API (they are
files: :meth:`ProcessNode.log`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

from tests.e2e.pod_runner import PodRunner
from tests.e2e.sandbox import BWRAP
from tests.kube.emulator import REPO_ROOT, KubeApiError, KubeEmulator

log = logging.getLogger(__name__)


class ProcessNode:
    """The node: claims the emulator's pods and runs each in a :class:`PodRunner` thread.

    ``root``: where pod directories (emptyDirs, ConfigMap files) and container logs go.
    """

    probe_interval = 0.5
    host_ip = "127.0.0.1"

    def __init__(self, kube: KubeEmulator, root: Path, name: str = "test-node") -> None:
        self.kube, self.root, self.name = kube, Path(root), name
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        venv_bin = str(Path(sys.executable).parent)
        self.image_path_env = f"{venv_bin}:/usr/local/bin:/usr/bin:/bin"
        # the "image": this repository (an editable install), its venv and the interpreter
        self.image_paths = sorted({str(REPO_ROOT), sys.prefix, sys.base_prefix} - {"/", "/usr"})
        self.http = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.runners: dict[str, PodRunner] = {}  # pod uid -> runner
        self._free_ips = [f"127.0.0.{n}" for n in range(10, 251)]
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="test-node", daemon=True)

    def start(self) -> ProcessNode:
        try:  # bwrap with a user namespace: what every container needs
            probe = subprocess.run([BWRAP, "--unshare-user", "--ro-bind", "/", "/", "true"], capture_output=True, text=True)
        except FileNotFoundError:
            raise RuntimeError("bubblewrap (bwrap) is required for the end-to-end tests: `make test` installs it "
                               "(apt-get install bubblewrap)") from None  # fmt: skip
        if probe.returncode != 0:
            raise RuntimeError(f"bwrap cannot create a user namespace here: {probe.stderr.strip()}")
        self._thread.start()
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Stop watching and end every pod's processes (SIGTERM, SIGKILL after GRACE seconds)."""
        self._stopping.set()
        self._thread.join(10)
        for runner in list(self.runners.values()):
            runner.grace_seconds = grace
            runner.delete_requested.set()
        for runner in list(self.runners.values()):
            runner.join(grace + 10)

    def __enter__(self) -> ProcessNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- for tests --

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        return self.root / "logs" / f"{namespace}_{pod}_{container}.log"

    def log(self, namespace: str, pod: str, container: str) -> str:
        path = self.log_path(namespace, pod, container)
        return path.read_text(errors="replace") if path.exists() else ""

    def runner(self, namespace: str, pod: str) -> PodRunner:
        found = [r for r in list(self.runners.values()) if (r.namespace, r.pod_name) == (namespace, pod)]
        if not found:
            raise KeyError(f"pod {namespace}/{pod} is not running on this node")
        return found[-1]

    def environ(self, namespace: str, pod: str, container: str) -> dict[str, str]:
        """The environment the container's command runs with (from /proc, as `cat /proc/PID/environ` on the node)."""
        pid = next(c for c in self.runner(namespace, pod).containers if c.name == container).main_pid()
        if pid is None:
            raise RuntimeError(f"{namespace}/{pod}/{container} is not running")
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)

    def kill(self, namespace: str, pod: str, container: str, sig: int = signal.SIGKILL) -> None:
        """Send SIG to the container's command (its PID 1), as `kill` on the node would."""
        found = next(c for c in self.runner(namespace, pod).containers if c.name == container)
        pid = found.main_pid()
        if pid is None:
            raise RuntimeError(f"{namespace}/{pod}/{container} is not running")
        os.kill(pid, sig)

    # -- the kubelet loop --

    def release(self, runner: PodRunner) -> None:
        with self._lock:
            self.runners.pop(runner.pod["metadata"]["uid"], None)
            self._free_ips.append(runner.ip)  # reused last: a pod IP is not handed out again soon

    def _watch(self) -> None:
        while not self._stopping.is_set():
            try:
                self._sync(self.kube.list_pods(None))
            except (KubeApiError, OSError) as exc:
                log.warning("test node: listing pods failed: %s", exc)
            self._stopping.wait(0.3)

    def _sync(self, pods: list[dict[str, Any]]) -> None:
        seen = {p["metadata"]["uid"]: p for p in pods}
        for uid, runner in list(self.runners.items()):
            pod = seen.get(uid)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                if pod is not None:
                    runner.grace_seconds = float(pod["metadata"].get("deletionGracePeriodSeconds", runner.grace_seconds))
                runner.delete_requested.set()
        for uid, pod in seen.items():
            spec, phase = pod.get("spec") or {}, (pod.get("status") or {}).get("phase")
            if uid in self.runners or spec.get("nodeName") or phase in ("Succeeded", "Failed"):
                continue
            if pod["metadata"].get("deletionTimestamp") or not self._free_ips:
                continue  # being deleted, or no pod IP left (it waits, Pending)
            with contextlib.suppress(KubeApiError):  # gone meanwhile: nothing to run
                claimed = self.kube.patch(self.kube.path("v1/pods", pod["metadata"]["namespace"], pod["metadata"]["name"]),
                                          {"spec": {"nodeName": self.name}})  # fmt: skip
                with self._lock:
                    runner = PodRunner(self, claimed, self._free_ips.pop(0))
                    self.runners[uid] = runner
                runner.start()
