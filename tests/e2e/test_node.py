"""The test node itself (tests/e2e/node.py): what a pod's processes see and how the node reports
them, with small Python commands instead of Orbit's roles (no vLLM; seconds)."""

from __future__ import annotations

import base64
import json
import textwrap
import urllib.request
from pathlib import Path

from tests.e2e.node import ProcessNode
from tests.kube.emulator import KubeEmulator

# A container: reports what it can see and write, then serves /healthz on the pod IP until SIGTERM.
PROBE_SCRIPT = textwrap.dedent('''
    import http.server, json, os, signal, sys
    def attempt(path):
        try:
            with open(path, "w") as f:
                f.write("x")
            return "ok"
        except OSError as exc:
            return exc.strerror
    report = {"uid": os.getuid(), "pid": os.getpid(), "ip": os.environ["POD_IP"], "url": os.environ["SELF_URL"],
              "token": os.environ["TOKEN"], "config": open("/etc/app/settings.txt").read(),
              "secret_file": open("/etc/creds/token", "rb").read().hex(), "secret_write": attempt("/etc/creds/token"),
              "scratch": attempt("/scratch/file"), "shared_ro": attempt("/shared/file"),
              "root": attempt("/new-file"), "etc": attempt("/etc/orbit-test"), "tmp": attempt("/tmp/file")}
    open(f"/out/{os.environ['POD_NAME']}.json", "w").write(json.dumps(report))
    def stop(*_):
        open(f"/out/{os.environ['POD_NAME']}.terminated", "w").write("SIGTERM")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(os.environ["POD_NAME"].encode())
    http.server.HTTPServer((os.environ["POD_IP"], 8080), Health).serve_forever()
''')


def _pod(name: str, tmp: Path, **spec) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"runAsUser": 1000, "runAsGroup": 1000},
            "terminationGracePeriodSeconds": 20,
            "containers": [{
                "name": "app", "image": "test", "command": ["python", "/app/probe.py"],
                "securityContext": {"readOnlyRootFilesystem": True},
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "SELF_URL", "value": "http://$(POD_IP):8080/$$literal"},
                        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}}],
                "ports": [{"name": "http", "containerPort": 8080}],
                "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}},
                "volumeMounts": [{"name": "app", "mountPath": "/app", "readOnly": True},
                                 {"name": "shared", "mountPath": "/shared", "readOnly": True},
                                 {"name": "out", "mountPath": "/out"},
                                 {"name": "scratch", "mountPath": "/scratch"},
                                 {"name": "settings", "mountPath": "/etc/app"},
                                 {"name": "creds", "mountPath": "/etc/creds"}],
            }],
            "volumes": [{"name": "app", "hostPath": {"path": str(tmp / "app"), "type": "Directory"}},
                        {"name": "shared", "hostPath": {"path": str(tmp / "shared"), "type": "DirectoryOrCreate"}},
                        {"name": "out", "hostPath": {"path": str(tmp / "out"), "type": "DirectoryOrCreate"}},
                        {"name": "scratch", "emptyDir": {}},
                        {"name": "settings", "configMap": {"name": "settings"}},
                        {"name": "creds", "secret": {"secretName": "creds"}}],
            **spec,
        },
    }  # fmt: skip


def _status(kube: KubeEmulator, name: str) -> dict:
    return (kube.get(kube.path("v1/pods", "default", name)) or {}).get("status") or {}


def test_two_pods_get_their_own_ip_mounts_identity_and_a_graceful_stop(kube: KubeEmulator, node: ProcessNode, tmp_path):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "probe.py").write_text(PROBE_SCRIPT)
    kube.create(kube.path("v1/configmaps", "default"), {"metadata": {"name": "settings"}, "data": {"settings.txt": "lr=0.1"}})
    kube.create(kube.path("v1/secrets", "default"), {"metadata": {"name": "creds"}, "data": {"token": base64.b64encode(b"s3cret").decode(),
                                                                                         "raw": base64.b64encode(b"\xff\x00").decode()}})  # fmt: skip
    for name in ("one", "two"):
        kube.create(kube.path("v1/pods", "default"), _pod(name, tmp_path))
    statuses = {name: kube.wait_for(lambda n=name: (s := _status(kube, n)).get("conditions") and
                                    {c["type"]: c["status"] for c in s["conditions"]}["Ready"] == "True" and s, 60,
                                    message=f"pod {name} ready\n{node.log('default', name, 'app')}")
                for name in ("one", "two")}  # fmt: skip
    ips = {name: s["podIP"] for name, s in statuses.items()}
    assert len(set(ips.values())) == 2 and all(ip.startswith("127.0.0.") and ip != "127.0.0.1" for ip in ips.values())
    for name, ip in ips.items():  # both bind port 8080, each on its own IP
        assert urllib.request.urlopen(f"http://{ip}:8080/healthz", timeout=5).read().decode() == name
        report = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        assert report["uid"] == 1000 and report["pid"] == 1  # the pod's user; PID 1 in its own PID namespace
        assert report["ip"] == ip and report["url"] == f"http://{ip}:8080/$literal"  # $(VAR) expansion, $$ escape
        assert report["token"] == "s3cret" and report["config"] == "lr=0.1"  # secretKeyRef, a ConfigMap file
        assert report["secret_file"] == b"s3cret".hex() and report["secret_write"] == "Read-only file system"  # a Secret file
        assert b"s3cret" not in Path(f"/proc/{node.runner('default', name).containers[0].proc.pid}/cmdline").read_bytes()
        assert report["scratch"] == "ok"  # an emptyDir is writable
        assert report["shared_ro"] == "Read-only file system"  # readOnly: true is a read-only bind
        assert report["root"] == report["etc"] == report["tmp"] == "Read-only file system"  # readOnlyRootFilesystem
        state = statuses[name]["containerStatuses"][0]
        assert state["ready"] and "running" in state["state"] and statuses[name]["phase"] == "Running"
    assert not list((tmp_path / "shared").iterdir())

    kube.delete(kube.path("v1/pods", "default", "one"))
    kube.wait_for(lambda: kube.get(kube.path("v1/pods", "default", "one")) is None, 30, message="pod one removed by its node")
    assert (tmp_path / "out" / "one.terminated").read_text() == "SIGTERM"  # a graceful stop, not a kill
    assert _status(kube, "two")["phase"] == "Running"  # the other pod is untouched


def test_restart_policies_exit_codes_and_sidecars(kube: KubeEmulator, node: ProcessNode):
    def pod(name: str, main: str, init: list[dict] | None = None) -> dict:
        return {"metadata": {"name": name}, "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 5,
                "initContainers": init or [], "containers": [{"name": "main", "image": "t", "command": ["sh", "-c", main],
                                                              "terminationMessagePolicy": "FallbackToLogsOnError"}]}}  # fmt: skip

    sidecar = {"name": "side", "image": "t", "restartPolicy": "Always", "command": ["sh", "-c", "sleep 1; exit 7"]}
    prep = {"name": "prep", "image": "t", "command": ["sh", "-c", "exit 0"]}
    kube.create(kube.path("v1/pods", "default"), pod("ok", "sleep 7; echo all-done > /dev/termination-log", [prep, sidecar]))
    kube.create(kube.path("v1/pods", "default"), pod("fails", "echo working; echo it broke >&2; exit 3"))
    kube.create(kube.path("v1/pods", "default"), pod("bad-init", "exit 0", [{**prep, "command": ["sh", "-c", "exit 2"]}]))
    kube.create(kube.path("v1/pods", "default"), pod("killed", "sleep 60"))
    kube.wait_for(lambda: _status(kube, "killed").get("phase") == "Running", 30)
    node.kill("default", "killed", "main")  # SIGKILL: exit 137, as a container runtime reports it

    done = {n: kube.wait_for(lambda n=n: _status(kube, n).get("phase") in ("Succeeded", "Failed") and _status(kube, n), 60,
                             message=f"{n} to finish")  # fmt: skip
            for n in ("ok", "fails", "bad-init", "killed")}
    assert done["ok"]["phase"] == "Succeeded"
    init = {c["name"]: c for c in done["ok"]["initContainerStatuses"]}
    assert init["prep"]["state"]["terminated"]["exitCode"] == 0
    assert init["side"]["restartCount"] >= 2  # restarted (after a back-off) each time it exited, while the main container ran
    # its own exit, or killed after the grace period (sh as PID 1 ignores SIGTERM) when the main container ended
    assert init["side"]["lastState"]["terminated"]["exitCode"] in (7, 137)
    assert done["fails"]["phase"] == "Failed"
    assert done["ok"]["containerStatuses"][0]["state"]["terminated"]["message"] == "all-done\n"  # terminationMessagePath
    failed = done["fails"]["containerStatuses"][0]["state"]["terminated"]
    assert (failed["exitCode"], failed["reason"], failed["message"]) == (3, "Error", "working\nit broke")  # the log's end
    assert done["bad-init"]["phase"] == "Failed" and "init container prep failed (exit 2)" in done["bad-init"]["message"]
    assert "running" not in done["bad-init"]["containerStatuses"][0]["state"]  # the main container never started
    assert done["killed"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137
