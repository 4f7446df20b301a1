"""One pod on the test node, from claim to end: a thread per pod (see tests/e2e/node.py for what
it emulates and what not)."""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tests.e2e.sandbox import BWRAP, Container, PodError, expand, identity_files, mirror_host_root
from tests.kube.emulator import KubeApiError
from tests.kube.emulator.api_semantics import _now

if TYPE_CHECKING:
    from tests.e2e.node import ProcessNode

log = logging.getLogger(__name__)


class PodRunner(threading.Thread):
    """Runs one pod from claim to end (a thread per pod)."""

    def __init__(self, node: ProcessNode, pod: dict, ip: str) -> None:
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}-{meta['name']}", daemon=True)
        self.node, self.pod, self.ip = node, pod, ip  # the pod as claimed (its spec does not change)
        self.namespace, self.pod_name = meta["namespace"], meta["name"]
        self.dir = node.root / "pods" / f"{self.namespace}_{self.pod_name}_{meta['uid'][:8]}"
        spec = pod["spec"]
        self.containers = [Container(c, "sidecar" if c.get("restartPolicy") == "Always" else "init")
                           for c in spec.get("initContainers", [])]  # fmt: skip
        self.containers += [Container(c, "main") for c in spec.get("containers", [])]
        self.phase, self.reason, self.message = "Pending", None, None
        self.initialized = False
        self.delete_requested = threading.Event()
        self.grace_seconds = float(spec.get("terminationGracePeriodSeconds", 30))
        self.volumes: dict[str, tuple[Path, bool]] = {}  # name -> (host path, always read-only)
        self._reported: dict | None = None
        self._next_probe = 0.0

    # -- the pod's life --

    def run(self) -> None:
        try:
            self._run()
        except PodError as exc:
            self.phase, self.reason, self.message = "Failed", exc.reason, str(exc)
        except Exception as exc:  # a bug here must not leave a pod Running forever
            log.exception("pod %s/%s", self.namespace, self.pod_name)
            self.phase, self.reason, self.message = "Failed", "NodeError", f"{type(exc).__name__}: {exc}"
        finally:
            try:
                self._terminate_all(self.grace_seconds)
                self._report()
                if self.delete_requested.is_set():
                    self._remove_pod()
            finally:
                self.node.release(self)

    def _remove_pod(self) -> None:
        """The kubelet's last word on a deleted pod: remove it from the API (retried on a transient error)."""
        for attempt in range(5):
            try:
                self.node.kube.request("DELETE", self._path(), {"gracePeriodSeconds": 0})
                return
            except OSError as exc:
                log.warning("removing pod %s/%s: %s", self.namespace, self.pod_name, exc)
                time.sleep(0.5 * (attempt + 1))

    def _run(self) -> None:
        self._report()
        self._prepare_volumes()
        for container in (c for c in self.containers if c.kind != "main"):
            if container.kind == "init" and not self._run_to_completion(container):
                return
            if container.kind == "sidecar" and not self._start_sidecar(container):
                return
        self.initialized = True
        for container in self.containers:
            if container.kind == "main":
                self._start(container)
        self.phase = "Running"
        self._report()
        mains = [c for c in self.containers if c.kind == "main"]
        while not self.delete_requested.is_set():
            self._tend()
            if all("terminated" in c.state for c in mains):
                failed = [c for c in mains if c.state["terminated"]["exitCode"] != 0]
                self.phase = "Failed" if failed else "Succeeded"
                return
            self._report()
            time.sleep(0.2)

    def _tend(self) -> None:
        """One kubelet pass over the started sidecars and main containers: record exits, restart what
        the restart policy restarts (after a back-off: 1 s, doubling, at most 10 s; the kubelet's is
        10 s to 5 min), kill a container that misses its startup deadline, probe."""
        now = time.monotonic()
        for container in self.containers:
            if container.kind == "init" or container.proc is None:
                continue
            if not container.running and "running" in container.state:
                self._exited(container)
                if self._restarts(container):
                    container.next_start = now + min(10.0, 2.0 ** container.restarts)
                    message = f"back-off restarting the failed container {container.name}"
                    container.state = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}
            elif "waiting" in container.state and now >= container.next_start:
                self._start(container)
            elif container.running and not container.started and now > container.startup_deadline:
                self._signal(container, signal.SIGKILL)  # the startup probe never passed: killed, then restarted
        self._probe_readiness()

    def _restarts(self, container: Container) -> bool:
        if container.kind == "sidecar":
            return True
        policy = self.pod["spec"].get("restartPolicy", "Always")
        return policy == "Always" or (policy == "OnFailure" and container.state["terminated"]["exitCode"] != 0)

    def _run_to_completion(self, container: Container) -> bool:
        """An init container: run until it exits 0 (restarted on failure unless restartPolicy is Never)."""
        while True:
            self._start(container)
            self._report()
            while container.running and not self.delete_requested.is_set():
                time.sleep(0.2)
            if self.delete_requested.is_set():
                return False
            self._exited(container)
            if container.state["terminated"]["exitCode"] == 0:
                return True
            if self.pod["spec"].get("restartPolicy", "Always") == "Never":
                self.phase, self.reason = "Failed", None
                self.message = f"init container {container.name} failed (exit {container.state['terminated']['exitCode']})"
                return False
            time.sleep(min(10, 2**container.restarts))

    def _start_sidecar(self, container: Container) -> bool:
        """A native sidecar: start it; the next container waits until its startup probe passes (the
        sidecars started before it are tended meanwhile: restarted when they exit)."""
        self._start(container)
        while not self.delete_requested.is_set():
            self._tend()
            if container.running and container.started:
                self._report()
                return True
            self._report()
            time.sleep(0.2)
        return False

    def _probe_readiness(self) -> None:
        if time.monotonic() < self._next_probe:
            return
        self._next_probe = time.monotonic() + self.node.probe_interval
        for container in self.containers:
            if not container.running or container.kind == "init":
                container.ready = False
                continue
            startup, readiness = container.spec.get("startupProbe"), container.spec.get("readinessProbe")
            if not container.started:
                container.started = startup is None or self._probe(container, startup)
            container.ready = container.started and (readiness is None or self._probe(container, readiness))

    def _probe(self, container: Container, probe: dict) -> bool:
        get = probe.get("httpGet")
        if get is None:
            return True  # exec/tcp probes are not emulated: treated as passing
        port = get["port"]
        if isinstance(port, str):
            port = next(p["containerPort"] for p in container.spec.get("ports", []) if p.get("name") == port)
        url = f"http://{self.ip}:{port}{get.get('path', '/')}"
        try:
            with self.node.http.open(url, timeout=2) as response:
                return 200 <= response.status < 400
        except OSError:
            return False

    # -- processes --

    def _start(self, container: Container) -> None:
        if container.proc is not None:
            container.restarts += 1
        env = self._env(container)
        command = [expand(a, env) for a in container.spec.get("command", []) + container.spec.get("args", [])]
        log_path = self.node.log_path(self.namespace, self.pod_name, container.name)
        with open(log_path, "ab") as out:
            out.write(f"--- {_now()} start #{container.restarts}: {' '.join(command)}\n".encode())
            out.flush()
            container.log_offset = out.tell()
            # the environment goes through bwrap's own (not its argv, which any user could read in ps)
            container.proc = subprocess.Popen(self._sandbox(container) + ["--", *command], env=env, stdout=out,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
        container.state = {"running": {"startedAt": _now()}}
        probe = container.spec.get("startupProbe")
        container.started = container.kind != "init" and probe is None
        container.startup_deadline = float("inf") if probe is None else time.monotonic() + (
            probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3))  # fmt: skip

    def _exited(self, container: Container) -> None:
        code = container.proc.wait()
        code = 128 - code if code < 0 else code  # killed by a signal (bwrap itself reports 128+N)
        started = container.state.get("running", {}).get("startedAt", _now())
        container.state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                          "startedAt": started, "finishedAt": _now()}}  # fmt: skip
        message = self._termination_message(container, code)
        if message:
            container.state["terminated"]["message"] = message
        container.last_state = {"terminated": container.state["terminated"]}
        container.ready = container.started = False

    def _signal(self, container: Container, sig: int) -> None:
        """SIG to the container's command; SIGKILL to bwrap too if the command never started."""
        pid = container.main_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        elif container.running and sig == signal.SIGKILL:
            container.proc.kill()

    def _terminate_all(self, grace: float) -> None:
        """SIGTERM the main containers, then the sidecars in reverse order; SIGKILL what outlives GRACE."""
        deadline = time.monotonic() + grace
        mains = [c for c in self.containers if c.kind == "main"]
        others = [c for c in reversed(self.containers) if c.kind != "main"]
        for group in (mains, others):
            for container in group:
                self._signal(container, signal.SIGTERM)
            for container in group:
                while container.running and time.monotonic() < deadline:
                    time.sleep(0.1)
                if container.running:
                    self._signal(container, signal.SIGKILL)
                    container.proc.kill()  # bwrap too, if it never started the command
                if container.proc is not None and "running" in container.state:
                    self._exited(container)

    # -- what a container sees --

    def _env(self, container: Container) -> dict[str, str]:
        env = {"PATH": self.node.image_path_env, "HOSTNAME": self.pod_name}
        for source in container.spec.get("envFrom", []):
            prefix = source.get("prefix", "")
            for kind in ("secretRef", "configMapRef"):
                if kind in source:
                    data = self._data("secrets" if kind == "secretRef" else "configmaps", source[kind]["name"])
                    env.update({prefix + k: v for k, v in data.items()})
        for item in container.spec.get("env", []):
            if "value" in item:
                env[item["name"]] = expand(item["value"], env)
            else:
                env[item["name"]] = self._value_from(item["valueFrom"])
        return env

    def _value_from(self, source: dict) -> str:
        if "fieldRef" in source:
            fields = {"status.podIP": self.ip, "status.hostIP": self.node.host_ip, "metadata.name": self.pod_name,
                      "metadata.namespace": self.namespace, "spec.nodeName": self.node.name,
                      "metadata.uid": self.pod["metadata"]["uid"]}  # fmt: skip
            return fields[source["fieldRef"]["fieldPath"]]
        for kind, resource in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
            if kind in source:
                return self._data(resource, source[kind]["name"])[source[kind]["key"]]
        raise PodError("Unsupported", f"env valueFrom {sorted(source)} is not emulated")

    def _data(self, resource: str, name: str) -> dict[str, str]:
        return {k: v.decode(errors="replace") for k, v in self._raw_data(resource, name).items()}

    def _raw_data(self, resource: str, name: str) -> dict[str, bytes]:
        """A Secret's or ConfigMap's data (a missing one fails the pod; the kubelet would keep it waiting)."""
        obj = self.node.kube.get(self.node.kube.path(f"v1/{resource}", self.namespace, name))
        if obj is None:
            raise PodError("CreateContainerConfigError", f'{resource[:-1]} "{name}" not found')
        if resource == "secrets":
            return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        return {k: v.encode() for k, v in (obj.get("data") or {}).items()}

    def _prepare_volumes(self) -> None:
        for volume in self.pod["spec"].get("volumes", []):
            name = volume["name"]
            if "emptyDir" in volume:
                path = self.dir / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
                self.volumes[name] = (path, False)
            elif "hostPath" in volume:
                path, kind = Path(volume["hostPath"]["path"]), volume["hostPath"].get("type", "")
                if kind == "DirectoryOrCreate":
                    path.mkdir(parents=True, exist_ok=True)
                elif kind == "Directory" and not path.is_dir():
                    raise PodError("FailedMount", f"hostPath {path} is not a directory")
                self.volumes[name] = (path, False)
            elif "configMap" in volume or "secret" in volume:
                kind = "configMap" if "configMap" in volume else "secret"
                ref = volume[kind].get("name") or volume[kind].get("secretName")
                data = self._raw_data("configmaps" if kind == "configMap" else "secrets", ref)
                path = self.dir / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
                for key, value in data.items():
                    (path / key).write_bytes(value)
                self.volumes[name] = (path, True)
            else:
                raise PodError("Unsupported", f"volume {name}: {sorted(set(volume) - {'name'})} is not emulated by the test node")

    def _sandbox(self, container: Container) -> list[str]:
        security = {**(self.pod["spec"].get("securityContext") or {}), **(container.spec.get("securityContext") or {})}
        uid, gid = int(security.get("runAsUser", 0)), int(security.get("runAsGroup", security.get("runAsUser", 0)))
        binds: list[tuple[str, str, bool]] = []  # (host source, sandbox path, read-only)
        for mount in container.spec.get("volumeMounts", []):
            if mount["name"] not in self.volumes:
                raise PodError("FailedMount", f"container {container.name}: no volume {mount['name']!r}")
            source, always_ro = self.volumes[mount["name"]]
            if mount.get("subPath"):
                source = source / mount["subPath"]
                if not always_ro:
                    source.mkdir(parents=True, exist_ok=True)
            binds.append((str(source), os.path.realpath(mount["mountPath"]), always_ro or bool(mount.get("readOnly"))))
        if uid:
            binds += identity_files(self.dir / "etc", uid, gid)
        message = self._termination_file(container)
        message.write_bytes(b"")  # a fresh one per start, as the kubelet's
        binds.append((str(message), container.spec.get("terminationMessagePath", "/dev/termination-log"), False))
        hidden = [b[1] for b in binds]
        binds += [(p, p, True) for p in self.node.image_paths if any(p.startswith(h + "/") for h in hidden)]
        args = [BWRAP, "--die-with-parent", "--unshare-user", "--uid", str(uid), "--gid", str(gid), "--unshare-pid",
                "--as-pid-1", "--unshare-ipc", "--unshare-uts", "--hostname", self.pod_name[:63]]  # fmt: skip
        args += mirror_host_root("/", {b[1] for b in binds})
        args += ["--dev", "/dev", "--proc", "/proc"]
        for source, target, read_only in sorted(binds, key=lambda b: b[1].count("/")):  # parents first
            args += ["--ro-bind" if read_only else "--bind", source, target]
        if security.get("readOnlyRootFilesystem"):
            args += ["--remount-ro", "/"]
        args += ["--chdir", container.spec.get("workingDir", "/")]
        return args

    def _termination_file(self, container: Container) -> Path:
        path = self.dir / "termination" / container.name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _termination_message(self, container: Container, exit_code: int) -> str:
        """What the container wrote to its terminationMessagePath (4 KiB at most); with
        FallbackToLogsOnError and nothing written, the end of this run's log after a failure."""
        written = self._termination_file(container).read_bytes()[:4096].decode(errors="replace")
        if written or exit_code == 0 or container.spec.get("terminationMessagePolicy") != "FallbackToLogsOnError":
            return written
        with open(self.node.log_path(self.namespace, self.pod_name, container.name), "rb") as f:
            f.seek(container.log_offset)
            output = f.read().decode(errors="replace")
        return "\n".join(output.splitlines()[-80:])[-2048:]

    # -- status --

    def _path(self) -> str:
        return self.node.kube.path("v1/pods", self.namespace, self.pod_name)

    def _report(self) -> None:
        """Write the pod's status (only when it changed)."""
        statuses = {kind: [c.status() for c in self.containers if (c.kind == "main") == (kind == "main")]
                    for kind in ("init", "main")}  # fmt: skip
        ready = self.phase == "Running" and all(c.ready for c in self.containers if c.kind != "init")
        conditions = [{"type": t, "status": str(value)} for t, value in
                      (("PodScheduled", True), ("Initialized", self.initialized), ("ContainersReady", ready), ("Ready", ready))]  # fmt: skip
        status = {"phase": self.phase, "podIP": self.ip, "podIPs": [{"ip": self.ip}], "hostIP": self.node.host_ip,
                  "startTime": self.pod["metadata"]["creationTimestamp"], "conditions": conditions,
                  "initContainerStatuses": statuses["init"], "containerStatuses": statuses["main"]}  # fmt: skip
        for key in ("reason", "message"):
            if getattr(self, key):
                status[key] = getattr(self, key)
        if status != self._reported:
            try:
                self.node.kube.patch_status(self._path(), status)
            except (KubeApiError, OSError) as exc:  # gone (404), or a transient error: retried on the next pass
                if getattr(exc, "status", None) != 404:
                    log.warning("status of pod %s/%s not written: %s", self.namespace, self.pod_name, exc)
                    return
            self._reported = status
