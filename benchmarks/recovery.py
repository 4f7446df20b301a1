"""Recovery time: seconds from a `kill -9` to the first completed RL step after it, on the quickstart.

Three failures, --runs times each, on the quickstart's job (examples/quickstart.yaml, its base
built as `make demo` builds it) with a checkpoint every CHECKPOINT_EVERY steps:
  learner   the pod's layout (`orbit rollout` and `orbit learner`, two processes as two
            containers): the learner is killed alone and started again at once, as the kubelet
            restarts a container (its back-off delay is the cluster's, not Orbit's). The rollout
            keeps running and keeps its base; the new learner loads its own copy of the base,
            restores the checkpoint, reaches the rollout and serves the checkpoint's adapter again.
  rollout   `orbit train`: vLLM is killed alone; the learner restarts it and serves the adapter
            again, inside the step that found it dead.
  whole     `orbit train` is killed (vLLM dies with it) and run again with --resume.
Each kill lands once the step after a checkpoint is done, so a resumed learner redoes that one
step. Phases:
  learner, whole  restart (the kill to the new process's spawn: the benchmark restarts at once, so
                  this is the benchmark's own latency), process start to the trainer (Python
                  imports), base load, checkpoint restore, rollout start (vLLM's start, or
                  reaching the running one), resync (the canary's noise floor measured and the
                  adapter served again), first step; read from the resume record the learner
                  writes to metrics.jsonl (`startup_seconds`).
  rollout         restart and resync, from the learner's Prometheus histogram
                  orbit_learner_role_recovery_seconds, and the rest of the step.
The summary gives, per failure, the median and range over runs of the total and each phase,
and which phase dominates.

    python benchmarks/recovery.py --json benchmarks/results/recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from benchmark_output import emit_json
from quickstart_base import build_quickstart_base

from orbit_runtime.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_EVERY = 2
KILL_AFTER_STEP = 5  # the step after the step-4 checkpoint
STEPS = 7
ORBIT = str(Path(sys.executable).with_name("orbit"))


def write_job(int4: Path, run_root: Path, metrics_port: int | None) -> Path:
    """The quickstart's job, checkpointed every CHECKPOINT_EVERY steps, STEPS long, evaluated only before RL."""
    spec = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    spec["model"]["path"] = str(int4)
    spec["schedule"]["steps"] = STEPS
    spec["checkpoint"] = {"every_steps": CHECKPOINT_EVERY, "keep_last": 2, "uri": f"file://{run_root / 'checkpoints'}"}
    spec["eval"] = {**spec.get("eval", {}), "every_steps": 1000}
    spec["metrics"] = {"port": metrics_port, "host": "127.0.0.1"}
    spec["run"] = {"name": "recovery", "output_dir": str(run_root)}
    run_root.mkdir(parents=True, exist_ok=True)
    path = run_root / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return time.time()
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the process died (exit {proc.returncode}) waiting for {what}")
        time.sleep(0.05)
    raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")


def step_done(run_dir: Path, step: int, after: float = 0.0) -> bool:
    return any(r.get("kind") == "step" and r["step"] == step and r["time"] >= after for r in rows(run_dir))


def rollout_pid(run_dir: Path) -> int:
    return json.loads((run_dir / "processes.json").read_text())["rollout"]["pid"]


def kill_group(pid: int) -> None:
    """SIGKILL PID's process group (vLLM runs in a session of its own: its API server and engine) and wait until it is gone."""
    try:
        group = os.getpgid(pid)
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([ORBIT, *args], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def resume_phases(run_dir: Path, killed_at: float, started_at: float) -> dict:
    record = next(r for r in reversed(rows(run_dir)) if r.get("kind") == "resume")
    phases = {"restart": started_at - killed_at, **record["startup_seconds"],
              "checkpoint_restore": record["restore_seconds"], "first_step": record["first_step_seconds"]}  # fmt: skip
    total = started_at - killed_at + record["seconds_to_first_step"]
    phases["other"] = total - sum(phases.values())  # tokenizer, data, between the phases
    return {"total_s": total, "phases_s": phases, "from_step": record["from_step"]}


def learner_failure(int4: Path, root: Path) -> dict:
    run_root = root / "learner"
    job = write_job(int4, run_root, None)
    env = {**os.environ, "ORBIT_API_KEY": "recovery-benchmark-key"}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rollout = start(["rollout", str(job), "--host", "127.0.0.1", "--port", str(port)], env, run_root / "rollout.log")
    learner_args = ["learner", str(job), "--rollout-url", url, "--host", "127.0.0.1"]
    try:
        wait_for(lambda: _healthy(url), 600, "the rollout", rollout)
        learner = start(learner_args, env, run_root / "learner.log")
        run_dir = run_root / "recovery"
        wait_for(lambda: step_done(run_dir, KILL_AFTER_STEP), 900, f"step {KILL_AFTER_STEP}", learner)
        os.killpg(learner.pid, signal.SIGKILL)
        killed_at = time.time()
        learner.wait()
        learner = start(learner_args, env, run_root / "learner.log")
        started_at = time.time()
        wait_for(lambda: any(r.get("kind") == "resume" for r in rows(run_dir)), 900, "the first step after the restart", learner)
        result = resume_phases(run_dir, killed_at, started_at)
        stop(learner)
        return result
    finally:
        stop(rollout)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def rollout_failure(int4: Path, root: Path) -> dict:
    run_root = root / "rollout"
    metrics_port = free_port()
    job = write_job(int4, run_root, metrics_port)
    run_dir = run_root / "recovery"
    train = start(["train", str(job)], dict(os.environ), run_root / "train.log")
    try:
        wait_for(lambda: step_done(run_dir, KILL_AFTER_STEP - 1), 900, f"step {KILL_AFTER_STEP - 1}", train)
        kill_group(rollout_pid(run_dir))  # vLLM's API server and its engine process: the container dies
        killed_at = time.time()
        done_at = wait_for(lambda: step_done(run_dir, KILL_AFTER_STEP, after=killed_at), 900, "the step after the kill", train)
        recovery = _histogram_sums(f"http://127.0.0.1:{metrics_port}/metrics", "rollout")
        step = next(r for r in rows(run_dir) if r.get("kind") == "step" and r["step"] == KILL_AFTER_STEP)
        total = step["time"] - killed_at
        phases = {"restart": recovery["restart"], "resync": recovery["resync"]}
        phases["rest_of_step"] = total - sum(phases.values())  # the step's work, what it did before it found vLLM dead, and
        # the step-4 checkpoint if the kill landed while it was written
        return {"total_s": total, "phases_s": phases, "reported_at_s": done_at - killed_at, "step_seconds": step["step_seconds"]}
    finally:
        stop(train)


def _histogram_sums(url: str, role: str) -> dict:
    sums = {}
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith("orbit_learner_role_recovery_seconds_sum") and f'role="{role}"' in line:
            phase = line.split('phase="')[1].split('"')[0]
            sums[phase] = float(line.rsplit(" ", 1)[1])
    return sums


def whole_failure(int4: Path, root: Path) -> dict:
    run_root = root / "whole"
    job = write_job(int4, run_root, None)
    run_dir = run_root / "recovery"
    train = start(["train", str(job)], dict(os.environ), run_root / "train.log")
    wait_for(lambda: step_done(run_dir, KILL_AFTER_STEP), 900, f"step {KILL_AFTER_STEP}", train)
    vllm = rollout_pid(run_dir)
    os.killpg(train.pid, signal.SIGKILL)  # the learner and vLLM (its own session) at once: the whole pod dies
    kill_group(vllm)
    killed_at = time.time()
    train.wait()
    again = start(["train", str(job), "--resume"], dict(os.environ), run_root / "train.log")
    started_at = time.time()
    try:
        wait_for(lambda: any(r.get("kind") == "resume" for r in rows(run_dir)), 900, "the first step after the restart", again)
        return resume_phases(run_dir, killed_at, started_at)
    finally:
        stop(again)


FAILURES = {"learner": learner_failure, "rollout": rollout_failure, "whole": whole_failure}


def summarize(runs: list[dict]) -> dict:
    totals = [r["total_s"] for r in runs]
    phases = {p: [r["phases_s"][p] for r in runs] for p in runs[0]["phases_s"]}
    medians = {p: statistics.median(v) for p, v in phases.items()}
    return {
        "total_s": {"median": statistics.median(totals), "min": min(totals), "max": max(totals)},
        "phases_s": {p: {"median": medians[p], "min": min(v), "max": max(v)} for p, v in phases.items()},
        "dominant_phase": max(medians, key=medians.get),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--failures", nargs="+", default=list(FAILURES), choices=list(FAILURES))
    parser.add_argument("--base", type=Path, help="an INT4 quickstart base to reuse (default: built in a scratch directory)")
    args = parser.parse_args()
    result: dict = {"config": "examples/quickstart.yaml", "checkpoint_every_steps": CHECKPOINT_EVERY,
                    "killed_after_step": KILL_AFTER_STEP, "failures": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="orbit-recovery-") as tmp:
        int4 = args.base or build_quickstart_base(Path(tmp))[1]
        for failure in args.failures:
            runs = []
            for i in range(args.runs):
                runs.append(FAILURES[failure](int4, Path(tmp) / f"{failure}-{i}"))
                print(f"{failure} run {i}: {runs[-1]['total_s']:.1f}s", file=sys.stderr, flush=True)
            result["failures"][failure] = {"runs": runs, **summarize(runs)}
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
