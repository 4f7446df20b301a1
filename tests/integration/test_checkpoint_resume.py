"""Checkpoints to a real S3 endpoint (moto's server on loopback) and exact resume, end to end:
real `orbit train` processes, real vLLM, faults injected from outside (kill -9, a proxy that
fails or refuses storage connections)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.integration.test_train import _alive, _steps, _wait_for
from tests.integration.test_train import _orbit as run_orbit
from tests.s3_endpoint import ACCESS_KEY, SECRET_KEY, FaultProxy

pytestmark = pytest.mark.vllm

STEPS = 4
# vLLM on CPU gives a request's log-probs that depend on which other requests share its engine
# step (measured: the same prompt and seed alone or beside three others, up to 5e-4 nats apart),
# and that is timing: each prompt is its own HTTP request. The update reads those log-probs
# (TIS) and the samples come from them, so CI once saw a resumed run's step 4 differ. These jobs
# run the engine one sequence at a time (rollout.max_num_seqs 1): its numbers are then the same
# whatever the timing (alone vs beside others: 0.0 apart, on the quickstart's model, where
# batching moved them by 1e-6), which is what an exact resume must be checked against.
EXACT = {"max_num_seqs": 1}
# A dense reward a random model earns in varying amounts (it favours "B"), so every group has
# variance and the adapter moves at every step.
SHARE_OF_B = "def share_of_b(completions, **kwargs):\n    return [c.count('B') / max(len(c), 1) for c in completions]\n"


def _job(tmp_path: Path, int4_dir: Path, name: str, **overrides) -> Path:
    """A deterministic little job: per-step sampling seeds, fp32 learner, LR warm-up (so LR changes
    every step), vLLM one sequence at a time (EXACT)."""
    job = {
        "model": {"path": str(int4_dir), "dtype": "fp16", "learner_dtype": "fp32"},
        "adapter": {"rank": 8, "alpha": 16},
        "data": {"type": "synthetic_arithmetic", "max_value": 9, "validation_size": 4},
        "rewards": [{"function": "orbit_test_rewards:share_of_b"}],
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_tokens": 6, **EXACT},  # 8 sequences, one by one
        "schedule": {"steps": STEPS, "learning_rate": 5e-3, "warmup_steps": 3},
        "eval": {"every_steps": 2},
        "checkpoint": {"every_steps": 2, "keep_last": 5, "retries": 1, "stop_timeout_s": 60},
        "run": {"name": "t", "output_dir": str(tmp_path / name)},
    }
    job.update(overrides)
    (tmp_path / "orbit_test_rewards.py").write_text(SHARE_OF_B)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _orbit(*args: str, env: dict) -> subprocess.Popen:
    """`orbit train ...` with the job's reward plugin (written next to the config) importable."""
    config_dir = Path(args[1]).parent
    pythonpath = os.pathsep.join(filter(None, [str(config_dir), os.environ.get("PYTHONPATH")]))
    return run_orbit(*args, cwd=config_dir, env_extra={**env, "PYTHONPATH": pythonpath})


def _finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    assert proc.returncode == 0, output[-4000:]
    return output


def _checkpoints(uri: str, env: dict) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "checkpoints", "list", uri, "--json"],
                         env={**os.environ, **env}, capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _export(uri: str, step: int, dest: Path, env: dict) -> dict[str, torch.Tensor]:
    subprocess.run([sys.executable, "-m", "orbit_runtime.cli", "checkpoints", "export", uri, str(step), str(dest)],
                   env={**os.environ, **env}, capture_output=True, text=True, check=True)  # fmt: skip
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in dest.iterdir()}
    return load_file(dest / "adapter_model.safetensors")


def _kill_learner(proc: subprocess.Popen, run: Path) -> None:
    rollout_pid = json.loads((run / "processes.json").read_text())["rollout"]["pid"]
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    _wait_for(lambda: not _alive(rollout_pid), 60, "vLLM to die with its learner")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, int4_dir, s3_endpoint):
    """STEPS steps in one go, checkpointed to S3: the reference for resumed runs."""
    tmp = tmp_path_factory.mktemp("straight")
    uri = f"s3://{s3_endpoint.new_bucket()}/straight"
    _finish(_orbit("train", str(_job(tmp, int4_dir, "straight")), "--checkpoint-uri", uri, env=s3_endpoint.env()))
    return {"uri": uri, "run": tmp / "straight" / "t", "tmp": tmp}


def test_kill_9_then_resume_continues_exactly(straight_run, tmp_path, int4_dir, s3_endpoint):
    env = s3_endpoint.env()
    uri = f"s3://{s3_endpoint.new_bucket()}/resumed"
    config = _job(tmp_path, int4_dir, "resumed")
    run = tmp_path / "resumed" / "t"
    proc = _orbit("train", str(config), "--checkpoint-uri", uri, env=env)
    try:  # kill -9 the learner once the step-2 checkpoint is complete, wherever it is then
        _wait_for(lambda: any(c["complete"] and c["step"] == 2 for c in _checkpoints(uri, env)), 400, "the step-2 checkpoint")
        _kill_learner(proc, run)
    finally:
        proc.kill()
    resumed = _finish(_orbit("train", str(config), "--checkpoint-uri", uri, "--resume", env=env))
    assert f"resuming from {uri}/step-00000002" in resumed

    _assert_same_as_straight_run(straight_run, run, uri, tmp_path, env)
    resume_rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"resume"' in line]
    assert resume_rows and resume_rows[0]["from_step"] == 2 and resume_rows[0]["seconds_to_first_step"] > 0
    # where the restart's seconds went (benchmarks/recovery.py splits them): each phase measured, none more than the whole
    phases = resume_rows[0]["startup_seconds"]
    assert set(phases) == {"process_start_to_init", "base_load", "rollout_start", "resync"}, phases
    parts = [*phases.values(), resume_rows[0]["restore_seconds"], resume_rows[0]["first_step_seconds"]]
    assert all(v > 0 for v in parts) and sum(parts) <= resume_rows[0]["seconds_to_first_step"], resume_rows[0]


def _assert_same_as_straight_run(straight_run: dict, run: Path, uri: str, tmp_path: Path, env: dict) -> None:
    """The resumed run's steps and final adapter equal the straight run's."""
    straight, again = _steps(straight_run["run"]), _steps(run)
    assert [s["step"] for s in again] == list(range(1, STEPS + 1))
    for key in ("prompt_indices", "learning_rate", "adapter_version"):
        assert [s[key] for s in again] == [s[key] for s in straight], key
    assert len({s["learning_rate"] for s in again}) == STEPS  # warm-up: a different LR at every step
    assert [s["reward_mean"] for s in again] == [s["reward_mean"] for s in straight]  # same samples (seeded)
    expected = _export(straight_run["uri"], STEPS, tmp_path / "a", env)
    got = _export(uri, STEPS, tmp_path / "b", env)
    assert expected.keys() == got.keys()
    assert any(t.abs().max() > 0 for k, t in expected.items() if "lora_B" in k), "the adapter never moved: nothing was tested"
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fault", ["disk_full", "sync_error", "disk_full_recording"])
def test_failed_commit_leaves_a_consistent_checkpoint(straight_run, tmp_path, int4_dir, s3_env, monkeypatch, fault):
    """Step 3's update is applied, then publishing it hits a full disk, or the rollout will not
    serve it (SyncError), or - once it is served and the step counted - writing its samples
    hits a full disk. The run must stop at step 2's state: the checkpoint it leaves holds
    step 2's adapter, optimizer, LR schedule, data cursor and RNG, and a resume from it equals
    the straight run. The faults are injected by wrapping one function in this in-process
    learner (a full disk or a canary mismatch cannot be produced on demand here); the learner,
    vLLM, S3 and the resume (a real `orbit train` process) are real."""
    from orbit_runtime.config import load_job_spec
    from orbit_runtime.sync.adapter_sync import SyncError
    from orbit_runtime.trainer import loop

    env = s3_env.env()
    uri = f"s3://{s3_env.new_bucket()}/{fault.replace('_', '-')}"
    # no periodic checkpoint: the only one is what the failing run leaves behind
    config = _job(tmp_path, int4_dir, "faulty", checkpoint={"every_steps": 100, "keep_last": 5, "retries": 1})
    monkeypatch.syspath_prepend(str(tmp_path))  # the reward plugin
    spec = load_job_spec(config)
    spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"uri": uri})})
    trainer = loop.Trainer(spec)
    expected_error = None
    if fault == "disk_full":
        real_publish = loop.publish_adapter

        def publish_adapter(policy, root, version, dtype=None):
            if version == 3:
                raise OSError(errno.ENOSPC, "No space left on device", str(root))
            return real_publish(policy, root, version, dtype)

        monkeypatch.setattr(loop, "publish_adapter", publish_adapter)
        expected_error = OSError
    if fault == "sync_error":
        real_sync = trainer.rollout.publish

        def sync(policy, version, path):
            if version == 3:
                raise SyncError(f"adapter v{version} from {path}: rollout canary log-probs differ (injected)")
            return real_sync(policy, version, path)

        monkeypatch.setattr(trainer.rollout, "publish", sync)
        expected_error = SyncError
    if fault == "disk_full_recording":
        real_record = trainer.recorder.record_samples

        def record_samples(rows):
            if rows and rows[0]["step"] == 3:
                raise OSError(errno.ENOSPC, "No space left on device", "samples.jsonl")
            return real_record(rows)

        monkeypatch.setattr(trainer.recorder, "record_samples", record_samples)
        expected_error = OSError
    with pytest.raises(expected_error):
        trainer.run()
    assert trainer.state.step == 2 and trainer.state.adapter_version == 2
    assert [r["step"] for r in trainer.state.steps] == [1, 2]
    assert [(c["step"], c["complete"], c["adapter_version"]) for c in _checkpoints(uri, env)] == [(2, True, 2)]

    _assert_same_checkpoint(straight_run["uri"], uri, step=2)  # what the straight run saved after step 2
    if fault == "disk_full":  # and a resume from it continues exactly like the straight run (a real process)
        run = tmp_path / "faulty" / "t"
        resumed = _finish(_orbit("train", str(config), "--checkpoint-uri", uri, "--resume", env=env))
        assert f"resuming from {uri}/step-00000002" in resumed
        _assert_same_as_straight_run(straight_run, run, uri, tmp_path, env)


def _assert_same_checkpoint(expected_uri: str, got_uri: str, step: int) -> None:
    """Checkpoint STEP under both URIs holds the same learner state (adapter, AdamW, LR schedule,
    RNG, data cursor, counters); only timings and metrics rows may differ."""
    from orbit_runtime.checkpoint.catalog import CheckpointCatalog
    from orbit_runtime.checkpoint.storage import open_store
    from orbit_runtime.trainer.checkpointing import read_checkpoint_files

    states, adapters = [], []
    for uri in (expected_uri, got_uri):
        catalog = CheckpointCatalog(open_store(uri))
        local = catalog.download_to_temp(catalog.get(step))
        states.append(read_checkpoint_files(local))
        adapters.append(load_file(local / "adapter" / "adapter_model.safetensors"))
    expected, got = states
    assert (got.step, got.adapter_version, got.sampler, got.config_hash) == (
        expected.step, expected.adapter_version, expected.sampler, expected.config_hash)  # fmt: skip
    assert got.scheduler == expected.scheduler
    # torch's RNG is seeded by the trainer (schedule.seed); Python's is not (no Orbit code draws
    # from it), so it differs between two processes and is not compared
    assert torch.equal(got.torch_rng, expected.torch_rng)
    for key in adapters[0]:
        torch.testing.assert_close(adapters[1][key], adapters[0][key], rtol=1e-5, atol=1e-6)
    for index, moments in expected.optimizer["state"].items():
        for name, value in moments.items():
            torch.testing.assert_close(got.optimizer["state"][index][name], value, rtol=1e-5, atol=1e-7)


def test_resume_refuses_a_different_config(straight_run, int4_dir, s3_endpoint):
    tmp = straight_run["tmp"]
    config = _job(tmp, int4_dir, "changed", schedule={"steps": STEPS, "learning_rate": 1e-2, "warmup_steps": 3})
    proc = _orbit("train", str(config), "--checkpoint-uri", straight_run["uri"], "--max-steps", str(STEPS + 2), env=s3_endpoint.env())
    stdout, _ = proc.communicate(timeout=300)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stdout)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "different job config" in result.stderr
    assert "schedule.learning_rate: 0.005 (checkpoint) -> 0.01 (now)" in result.stderr
    assert "Traceback" not in result.stderr


def test_kill_9_during_upload_leaves_a_torn_checkpoint_that_is_skipped(tmp_path, int4_dir, s3_endpoint):
    proxy = FaultProxy(s3_endpoint.url)
    env = s3_endpoint.env(proxy.url)
    uri = f"s3://{s3_endpoint.new_bucket()}/torn"
    config = _job(tmp_path, int4_dir, "torn")
    run = tmp_path / "torn" / "t"
    try:
        proxy.hold("step-00000004/MANIFEST.json")  # every file of step 4 uploads; its manifest never does
        proc = _orbit("train", str(config), "--checkpoint-uri", uri, env=env)
        try:
            assert proxy.held.wait(400), "the step-4 manifest upload never started"
            _kill_learner(proc, run)
        finally:
            proc.kill()
        proxy.release(forward=False)  # the learner is dead: its manifest upload never arrives
        listing = {c["step"]: c["complete"] for c in _checkpoints(uri, env)}
        assert listing == {2: True, 4: False}, listing

        output = _finish(_orbit("train", str(config), "--checkpoint-uri", uri, env=env))  # automatic resume
    finally:
        proxy.close()
    assert f"resuming from {uri}/step-00000002" in output
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    cleanup = [r for r in rows if r["kind"] == "checkpoint_cleanup"]
    assert cleanup and cleanup[0]["removed_steps"] == [4]
    assert [s["step"] for s in _steps(run)] == [1, 2, 3, 4]
    final = {c["step"]: c for c in _checkpoints(uri, s3_endpoint.env())}  # straight to moto: the proxy is gone
    assert final[4]["complete"] and final[2]["complete"]


def test_storage_outage_does_not_stop_training_and_never_leaks_credentials(tmp_path, int4_dir, s3_endpoint):
    proxy = FaultProxy(s3_endpoint.url)
    env = s3_endpoint.env(proxy.url)
    uri = f"s3://{s3_endpoint.new_bucket()}/outage"
    steps = 10
    config = _job(tmp_path, int4_dir, "outage", schedule={"steps": steps, "learning_rate": 1e-3},
                  checkpoint={"every_steps": 1, "keep_last": 2, "keep_best": 0, "retries": 1, "stop_timeout_s": 120})  # fmt: skip
    run = tmp_path / "outage" / "t"

    def checkpoint_rows() -> list[dict]:
        if not (run / "metrics.jsonl").exists():
            return []
        return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "checkpoint"]

    proc = _orbit("train", str(config), "--checkpoint-uri", uri, env=env)
    try:
        _wait_for(lambda: any(r["ok"] for r in checkpoint_rows()), 400, "a first checkpoint")
        vllm_pid = json.loads((run / "processes.json").read_text())["rollout"]["pid"]
        vllm_env = Path(f"/proc/{vllm_pid}/environ").read_bytes()
        proxy.fail()  # storage answers 503
        _wait_for(lambda: any(not r["ok"] and "ServiceUnavailable" in r["error"] for r in checkpoint_rows()), 120, "a 503")
        proxy.fail(False)
        proxy.go_down()  # storage refuses connections
        down_at = len(_steps(run))
        _wait_for(lambda: any(not r["ok"] and "connect" in r["error"].lower() for r in checkpoint_rows()), 120, "a refusal")
        # training goes on while storage is down: two more steps complete (one may have been in flight)
        _wait_for(lambda: len(_steps(run)) >= down_at + 2, 300, "steps completed during the outage")
        steps_during_outage = len(_steps(run)) - down_at
        proxy.come_back()
        output = _finish(proc)
    finally:
        proc.kill()
        proxy.close()
    rows = checkpoint_rows()
    assert len(_steps(run)) == steps and steps_during_outage >= 2  # training went on through the outage
    summary = json.loads((run / "summary.json").read_text())
    assert summary["checkpoint_failures"] >= 2 and summary["last_checkpoint_step"] == steps
    assert rows[-1]["ok"] and rows[-1]["failures_total"] == summary["checkpoint_failures"]
    assert "will be retried" in output  # the log line
    listing = _checkpoints(uri, s3_endpoint.env())
    assert all(c["complete"] for c in listing) and listing[-1]["step"] == steps

    # credentials appear nowhere: console output, logs, metrics, summary, checkpoints, child env
    texts = [output, *(p.read_text(errors="replace") for p in run.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".log", ".html"))]
    client = s3_endpoint.client()
    for key in s3_endpoint.keys(uri.split("/")[2]):
        if key.endswith((".json", ".jsonl")):
            texts.append(client.get_object(Bucket=uri.split("/")[2], Key=key)["Body"].read().decode())
    for text in texts:
        assert SECRET_KEY not in text and ACCESS_KEY not in text
    assert SECRET_KEY.encode() not in vllm_env and ACCESS_KEY.encode() not in vllm_env
