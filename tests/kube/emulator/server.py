"""The emulator on a real loopback port (a daemon thread with its own event loop) and the test-side API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import yaml

from .api_semantics import _now
from .handler import EmulatorHandler, Fault
from .resources import _T, ORBIT_CRD, REPO_ROOT

# --- the server thread and the test-side API -------------------------------------------------------------------


class KubeEmulator:
    """The emulator on a real HTTP port, run in a daemon thread with its own event loop.

    Start/stop it (or use it as a context manager), point clients at :attr:`url` via :meth:`write_kubeconfig`,
    and read/write objects over HTTP with the helpers below (``api_path`` is a URL path such as
    ``/apis/orbit.dev/v1alpha1/namespaces/default/rltrainingjobs/x``; :meth:`path` builds one).
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.handler: EmulatorHandler | None = None
        self.kubeconfig: Path | None = None  # the last one written by write_kubeconfig()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None

    # -- lifecycle --

    @property
    def url(self) -> str:
        if self._thread is None:
            raise RuntimeError("the emulator is not started")
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> KubeEmulator:
        if self._thread is not None:
            raise RuntimeError("the emulator is already started")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        ready = threading.Event()
        failure: list[BaseException] = []

        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._stopping = asyncio.Event()
            try:
                async with EmulatorHandler() as handler:
                    self.handler = handler
                    runner = aiohttp.web.ServerRunner(aiohttp.web.Server(handler), shutdown_timeout=0.5)
                    await runner.setup()
                    await aiohttp.web.SockSite(runner, sock).start()
                    ready.set()
                    try:
                        await self._stopping.wait()
                    finally:
                        await runner.cleanup()
            except BaseException as e:  # surfaced by start() if it happens before ready
                failure.append(e)
                raise
            finally:
                ready.set()

        def run() -> None:
            with contextlib.suppress(BaseException):  # a start failure is reported by start()
                asyncio.run(serve())  # also cancels what is left (e.g. idle keep-alive connections)

        self._thread = threading.Thread(target=run, name=f"kube-emulator-{self.port}", daemon=True)
        self._thread.start()
        if not ready.wait(timeout) or failure:
            raise RuntimeError(f"the emulator did not start: {failure[0] if failure else 'timeout'}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stopping is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> KubeEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- client configuration --

    def write_kubeconfig(self, path: str | os.PathLike[str], namespace: str = "default", token: str = "emulator",
                         default: bool = True) -> Path:  # fmt: skip
        """Write a kubeconfig (context ``emulator``, bearer TOKEN: calls are recorded per token, see
        :meth:`api_calls`) for kubectl, kopf and the kubernetes client; DEFAULT: the one :meth:`env` uses."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "preferences": {},
            "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": token}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace}}],
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        if default:
            self.kubeconfig = path
        return path

    def api_calls(self, token: str) -> set[tuple[str, str, str, str, str]]:
        """(verb, group, resource, subresource, scope) of every object request made with TOKEN so far."""
        assert self.handler is not None
        return {call[1:] for call in list(self.handler.calls) if call[0] == token}

    def request_count(self, token: str) -> int:
        """How many object requests (each list, get, patch, watch, ...) were made with TOKEN so far."""
        assert self.handler is not None
        return self.handler.request_counts[token]

    def env(self, kubeconfig: str | os.PathLike[str] | None = None) -> dict[str, str]:
        """``os.environ`` plus what a subprocess needs to reach the emulator (KUBECONFIG, no proxy, a cache dir)."""
        kubeconfig = Path(kubeconfig) if kubeconfig is not None else self._require_kubeconfig()
        no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), "127.0.0.1", "localhost"]))
        return {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
            "KUBECACHEDIR": str(kubeconfig.parent / ".kube-cache"),
        }

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 60.0, kubeconfig: str | os.PathLike[str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``kubectl --kubeconfig <file> <args>`` (cwd: the repo root); raise with its output if it fails."""
        env = self.env(kubeconfig)
        cmd = ["kubectl", "--kubeconfig", env["KUBECONFIG"], "--cache-dir", env["KUBECACHEDIR"], *args]
        proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def _require_kubeconfig(self) -> Path:
        if self.kubeconfig is None:
            raise RuntimeError("call write_kubeconfig() first")
        return self.kubeconfig

    # -- resources --

    def load_crd(self, crd: str | os.PathLike[str] | Mapping[str, Any] = ORBIT_CRD) -> dict[str, Any]:
        """Create a CRD (a YAML file or a dict): its resource becomes discoverable for kubectl and kopf."""
        if not isinstance(crd, Mapping):
            crd = yaml.safe_load(Path(crd).read_text())
        return self.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)

    @staticmethod
    def path(resource: str, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        """The URL path of a collection or an object: ``path("v1/pods", "default", "p")``,
        ``path("orbit.dev/v1alpha1/rltrainingjobs", "default")``, ``path("v1/namespaces", name="x")``."""
        *group_version, plural = resource.strip("/").split("/")
        prefix = "/api/v1" if group_version == ["v1"] else "/apis/" + "/".join(group_version)
        parts = [prefix] + (["namespaces", namespace] if namespace else []) + [plural]
        parts += [name] if name else []
        parts += [subresource] if subresource else []
        return "/".join(parts)

    # -- HTTP access --

    def request(
        self,
        method: str,
        api_path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
        timeout: float = 10.0,
    ) -> tuple[int, Any]:
        """One HTTP request; returns (status, parsed JSON body or text). Never raises on HTTP errors."""
        url = self.url + api_path + ("?" + urllib.parse.urlencode(params) if params else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            url, data=data, method=method.upper(), headers={"Content-Type": content_type, "Accept": "application/json"}
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def _ok(self, method: str, api_path: str, body: Any = None, **kwargs: Any) -> Any:
        status, payload = self.request(method, api_path, body, **kwargs)
        if status >= 300:
            message = payload.get("message") if isinstance(payload, dict) else payload
            raise KubeApiError(status, f"{method} {api_path} -> {status}: {message}", payload)
        return payload

    def get(self, api_path: str) -> dict[str, Any] | None:
        """The object at ``api_path``, or None if absent (404)."""
        status, payload = self.request("GET", api_path)
        if status == 404:
            return None
        if status >= 300:
            raise KubeApiError(status, f"GET {api_path} -> {status}: {payload}", payload)
        return payload

    def list(
        self, api_path: str, *, label_selector: str | None = None, field_selector: str | None = None
    ) -> list[dict[str, Any]]:
        """The items of a collection (``path(resource, namespace)``; no namespace: all namespaces)."""
        params = {k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v}
        return self._ok("GET", api_path, params=params)["items"]

    def create(self, api_path: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        """POST ``obj`` to a collection path; returns the stored object (uid, resourceVersion, ... filled in)."""
        return self._ok("POST", api_path, dict(obj))

    def patch(self, api_path: str, patch: Any, *, subresource: str | None = None, patch_type: str = "merge") -> dict[str, Any]:
        """PATCH an object; ``patch_type``: "merge" (a dict) or "json" (a list of ops)."""
        content_type = {
            "merge": "application/merge-patch+json",
            "json": "application/json-patch+json",
            "strategic": "application/strategic-merge-patch+json",
        }[patch_type]
        full_path = api_path + (f"/{subresource}" if subresource else "")
        return self._ok("PATCH", full_path, patch, content_type=content_type)

    def patch_status(self, api_path: str, status: Mapping[str, Any]) -> dict[str, Any]:
        """Merge-patch ``.status`` through the status subresource (as a controller would)."""
        return self.patch(api_path, {"status": dict(status)}, subresource="status")

    def delete(self, api_path: str) -> dict[str, Any] | None:
        """DELETE an object; returns it (with deletionTimestamp if finalizers hold it), None if it was absent."""
        status, payload = self.request("DELETE", api_path, {"propagationPolicy": "Background"})
        if status == 404:
            return None
        if status >= 300:
            raise KubeApiError(status, f"DELETE {api_path} -> {status}: {payload}", payload)
        return payload

    def inject_error(self, verb: str, resource: str, status: int, reason: str, message: str, times: int = 1) -> Fault:
        """Answer the next TIMES requests VERB (create, get, list, patch, delete, watch) on RESOURCE (a plural, e.g.
        "pods") with this Status error: a 429 TooManyRequests, a 403 "exceeded quota", a 500, ..."""
        assert self.handler is not None, "the emulator is not started"
        fault = Fault(verb=verb, resource=resource, status=status, reason=reason, message=message, times=times)
        self.handler.faults.append(fault)
        return fault

    def bind_pod(self, namespace: str, name: str, node: str = "node-1") -> dict[str, Any]:
        """Play the scheduler: bind the pod to NODE (``spec.nodeName``), so its deletion is graceful: it keeps a
        ``deletionTimestamp`` until :meth:`finish_pod_deletion` (the kubelet's last DELETE)."""
        return self.patch(self.path("v1/pods", namespace, name), {"spec": {"nodeName": node}})

    def finish_pod_deletion(self, namespace: str, name: str) -> None:
        """Play the kubelet once a terminating pod's processes are gone: DELETE with gracePeriodSeconds=0."""
        self.request("DELETE", self.path("v1/pods", namespace, name), {"gracePeriodSeconds": 0})

    def list_pods(self, namespace: str | None = "default", *, label_selector: str | None = None) -> list[dict[str, Any]]:
        return self.list(self.path("v1/pods", namespace), label_selector=label_selector)

    def events(self, namespace: str | None = "default", *, involved_name: str | None = None) -> list[dict[str, Any]]:
        """Core v1 Events (e.g. kopf's), optionally only those about the object ``involved_name``."""
        events = self.list(self.path("v1/events", namespace))
        return [e for e in events if involved_name is None or e.get("involvedObject", {}).get("name") == involved_name]

    def set_pod_status(
        self,
        namespace: str,
        name: str,
        phase: str = "Running",
        *,
        pod_ip: str | None = None,
        exit_code: int | None = None,
        reason: str | None = None,
        message: str | None = None,
        restart_count: int = 0,
        ready: bool | None = None,
        container_statuses: list[dict[str, Any]] | None = None,
        conditions: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Play the kubelet: set a pod's phase, conditions, podIP and per-container statuses.

        ``phase``: Pending (containers waiting, ContainerCreating), Running (running, ready unless
        ``ready=False``), Succeeded (terminated, exit 0, Completed) or Failed (terminated, ``exit_code`` or 1,
        ``reason`` or "Error"). ``container_statuses`` replaces the generated ones verbatim. ``pod_ip``
        defaults to 10.244.0.<n> once the pod runs. ``conditions`` are added to the generated ones (e.g. a
        ``DisruptionTarget`` condition, as preemption or eviction sets). Returns the updated pod.
        """
        pod_path = self.path("v1/pods", namespace, name)
        pod = self.get(pod_path)
        if pod is None:
            raise KubeApiError(404, f"pod {namespace}/{name} not found", None)
        now = _now()
        is_ready = (phase == "Running") if ready is None else ready
        if container_statuses is None:
            container_statuses = []
            for container in pod.get("spec", {}).get("containers", []):
                if phase == "Pending":
                    state: dict[str, Any] = {"waiting": {"reason": reason or "ContainerCreating"}}
                elif phase == "Running":
                    state = {"running": {"startedAt": now}}
                else:
                    code = exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
                    state = {
                        "terminated": {
                            "exitCode": code,
                            "reason": reason or ("Completed" if code == 0 else "Error"),
                            "startedAt": pod["metadata"]["creationTimestamp"],
                            "finishedAt": now,
                            **({"message": message} if message else {}),
                        }
                    }
                container_statuses.append(
                    {
                        "name": container["name"],
                        "image": container.get("image", ""),
                        "imageID": "",
                        "ready": is_ready,
                        "started": phase == "Running",
                        "restartCount": restart_count,
                        "state": state,
                    }
                )
        if pod_ip is None and phase != "Pending":
            pod_ip = (pod.get("status") or {}).get("podIP") or f"10.244.0.{int(pod['metadata']['resourceVersion']) % 250 + 2}"
        conditions = [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": str(is_ready), "lastTransitionTime": now},
            {"type": "Ready", "status": str(is_ready), "lastTransitionTime": now},
            *(conditions or []),
        ]
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": conditions,
            "containerStatuses": container_statuses,
            "hostIP": "10.0.0.1",
            "startTime": pod["metadata"]["creationTimestamp"],
        }
        if pod_ip:
            status.update(podIP=pod_ip, podIPs=[{"ip": pod_ip}])
        if reason and phase != "Pending":
            status["reason"] = reason
        if message:
            status["message"] = message
        return self.patch_status(pod_path, status)

    @staticmethod
    def wait_for(predicate: Callable[[], _T], timeout: float = 30.0, interval: float = 0.2, message: str = "condition") -> _T:
        """Poll ``predicate`` until it returns something truthy (returned); AssertionError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(KubeApiError):
                value = predicate()
                if value:
                    return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {message}")
            time.sleep(interval)


class KubeApiError(Exception):
    def __init__(self, status: int, message: str, payload: Any) -> None:
        super().__init__(message)
        self.status = status
        self.payload = payload
