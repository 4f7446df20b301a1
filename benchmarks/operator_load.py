"""API load of the operator: requests per second per job with many jobs, this operator against an
earlier one (a git revision), side by side on the same emulated API server.

For each operator: a fresh API emulator (tests/kube/emulator/) with --jobs RLTrainingJobs (the
examples/rljob-cpu.yaml job under numbered names); once every job has its pod, the "kubelet"
reports --running-fraction of them Running (their learners do not answer: the pod IPs are
unreachable, as a learner that is still loading) and the rest Succeeded; once every status
says so, the operator's requests (its own bearer token) are counted over --seconds, --repeats
times. Both operators run with their production defaults (statusPollSeconds 10; the current
one's resyncSeconds 300). Prints and writes JSON: requests/s in all and per job, per window.

    python benchmarks/operator_load.py --json benchmarks/results/operator_load.json
"""

from __future__ import annotations

import argparse
import copy
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from benchmark_output import emit_json

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.kube.emulator import ORBIT_CRD, RLJOBS, KubeEmulator  # noqa: E402  (the emulated API server)

TOKEN = "orbit-operator"
BASELINE = "f87695c"  # the operator before event-driven reconciles (a kopf timer per job, every 10 s)


def _operator(kube: KubeEmulator, tree: Path, log: Path) -> subprocess.Popen:
    kubeconfig = kube.write_kubeconfig(log.parent / "operator-kubeconfig", token=TOKEN, default=False)
    env = {**kube.env(kubeconfig), "PYTHONPATH": f"{tree / 'operator'}:{tree}", "ORBIT_BIND_ADDRESS": "127.0.0.1",
           "ORBIT_LIVENESS_PORT": "0", "ORBIT_METRICS_PORT": "0", "ORBIT_LOG_LEVEL": "WARNING"}  # fmt: skip
    return subprocess.Popen([sys.executable, "-m", "orbit_operator"], env=env, cwd=tree, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def measure(tree: Path, jobs: int, running_fraction: float, seconds: float, repeats: int, work: Path) -> dict:
    manifest = yaml.safe_load((ROOT / "examples" / "rljob-cpu.yaml").read_text())
    names = [f"job-{i:03d}" for i in range(jobs)]
    running = set(names[: round(jobs * running_fraction)])
    with KubeEmulator() as kube:
        kube.load_crd(ORBIT_CRD)
        kube.write_kubeconfig(work / "kubeconfig")
        for name in names:
            job = copy.deepcopy(manifest)
            job["metadata"] = {"name": name, "namespace": "default"}
            kube.create(KubeEmulator.path(RLJOBS, "default"), job)
        proc = _operator(kube, tree, work / "operator.log")
        try:
            started = time.monotonic()
            kube.wait_for(lambda: len(kube.list_pods("default")) >= jobs, timeout=600, interval=2, message="a pod per job")
            for i, name in enumerate(names):
                kube.set_pod_status("default", f"{name}-0", "Running" if name in running else "Succeeded", pod_ip=f"10.255.{i // 250}.{i % 250 + 1}")

            def settled() -> bool:
                phases = {j["metadata"]["name"]: (j.get("status") or {}).get("phase") for j in kube.list(KubeEmulator.path(RLJOBS, "default"))}
                return all(phases.get(n) == ("Running" if n in running else "Succeeded") for n in names)

            kube.wait_for(settled, timeout=600, interval=2, message="every job's phase")
            settle_s = time.monotonic() - started
            time.sleep(5)  # let the reconciles the transitions queued drain
            windows = []
            for _ in range(repeats):
                before, t0 = kube.request_count(TOKEN), time.monotonic()
                time.sleep(seconds)
                windows.append((kube.request_count(TOKEN) - before) / (time.monotonic() - t0))
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    rate = statistics.median(windows)
    return {"requests_per_second": round(rate, 2), "requests_per_second_per_job": round(rate / jobs, 4),
            "windows_requests_per_second": [round(w, 2) for w in windows], "seconds_to_settle": round(settle_s, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--running-fraction", type=float, default=0.1)
    parser.add_argument("--seconds", type=float, default=30.0, help="one counting window")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the operator to compare with")
    args = parser.parse_args()
    result = {"jobs": args.jobs, "running_jobs": round(args.jobs * args.running_fraction), "window_seconds": args.seconds,
              "baseline_revision": args.baseline}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="orbit-operator-load-") as tmp:
        work = Path(tmp)
        baseline = work / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(baseline), args.baseline], cwd=ROOT, check=True, capture_output=True)
        try:
            for label, tree in (("baseline", baseline), ("current", ROOT)):
                (work / f"run-{label}").mkdir()
                result[label] = measure(tree, args.jobs, args.running_fraction, args.seconds, args.repeats, work / f"run-{label}")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=ROOT, capture_output=True)
    result["ratio_baseline_to_current"] = round(result["baseline"]["requests_per_second"] / max(result["current"]["requests_per_second"], 1e-9), 1)
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
