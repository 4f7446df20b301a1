"""What goes into a learner checkpoint and how a run picks the one to resume from."""

from __future__ import annotations

import random

import pytest
import torch

from orbit_runtime.checkpoint.catalog import CheckpointCatalog
from orbit_runtime.checkpoint.storage import open_store
from orbit_runtime.config import AdapterSpec, parse_job_spec
from orbit_runtime.config.fingerprint import config_hash, describe_differences, training_fields
from orbit_runtime.errors import OrbitError
from orbit_runtime.trainer.checkpointing import (
    ADAPTER,
    TrainingState,
    capture_rng,
    checkpoint_due,
    plan_resume,
    read_checkpoint_files,
    restore_rng,
    split_checkpoint_uri,
    write_checkpoint_files,
)


def _spec(**sections):
    return parse_job_spec({"model": {"path": "/models/int4"}, **sections})


def test_hash_ignores_where_and_how_often_but_not_what():
    base = training_fields(_spec())
    same = training_fields(
        _spec(checkpoint={"uri": "s3://b/p", "every_steps": 3}, eval={"every_steps": 2}, schedule={"steps": 999},
              run={"output_dir": "/elsewhere"})  # fmt: skip
    )
    assert config_hash(base) == config_hash(same)
    changed = training_fields(_spec(algorithm={"kl_beta": 0.04}, schedule={"learning_rate": 3e-4}))
    assert config_hash(changed) != config_hash(base)
    lines = describe_differences(base, changed)
    assert lines == [
        "algorithm.kl_beta: 0.0 (checkpoint) -> 0.04 (now)",
        "schedule.learning_rate: 0.0001 (checkpoint) -> 0.0003 (now)",
    ]


def test_checkpoint_due_by_steps_or_minutes():
    assert checkpoint_due(10, 0, 0.0, 1.0, every_steps=5, every_minutes=None)
    assert not checkpoint_due(11, 10, 0.0, 1.0, every_steps=5, every_minutes=None)
    assert not checkpoint_due(10, 10, 0.0, 1.0, every_steps=5, every_minutes=None)  # already taken
    assert checkpoint_due(11, 10, 0.0, 61.0, every_steps=5, every_minutes=1.0)
    assert not checkpoint_due(11, 10, 0.0, 59.0, every_steps=None, every_minutes=1.0)


def _fake_checkpoint(catalog: CheckpointCatalog, tmp_path, step: int, fields: dict) -> None:
    d = tmp_path / f"c{step}"
    d.mkdir()
    (d / "state.json").write_text("{}")
    catalog.write(step, d, {"config_hash": config_hash(fields), "config_fields": fields})


def test_plan_resume_auto_refuse_and_explicit(tmp_path):
    catalog = CheckpointCatalog(open_store(f"file://{tmp_path / 'ckpt'}"))
    fields = training_fields(_spec())
    assert plan_resume(catalog, config_hash(fields), fields, resume=False, resume_from=None).entry is None
    with pytest.raises(OrbitError, match="no complete checkpoint"):
        plan_resume(catalog, config_hash(fields), fields, resume=True, resume_from=None)

    _fake_checkpoint(catalog, tmp_path, 4, fields)
    _fake_checkpoint(catalog, tmp_path, 8, fields)
    plan = plan_resume(catalog, config_hash(fields), fields, resume=False, resume_from=None)
    assert plan.entry.step == 8  # automatic: the newest complete checkpoint

    other = training_fields(_spec(adapter={"rank": 4}))
    with pytest.raises(OrbitError) as refused:
        plan_resume(catalog, config_hash(other), other, resume=True, resume_from=None)
    assert "adapter.rank: 16 (checkpoint) -> 4 (now)" in str(refused.value)
    assert "--resume-from" in str(refused.value)

    explicit = plan_resume(catalog, config_hash(other), other, resume=False, resume_from=f"file://{tmp_path / 'ckpt'}/step-00000004")
    assert explicit.entry.step == 4 and "adapter.rank" in explicit.note
    with pytest.raises(OrbitError, match="not found"):
        plan_resume(catalog, config_hash(fields), fields, resume=False, resume_from=f"file://{tmp_path / 'ckpt'}/step-00000005")
    with pytest.raises(OrbitError, match="step-NNNNNNNN"):
        split_checkpoint_uri("s3://bucket/prefix")


def test_checkpoint_files_restore_policy_optimizer_scheduler_and_rng(int4_dir, tmp_path):
    from orbit_runtime.learner.model import load_policy

    adapter = AdapterSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    policy = load_policy(int4_dir, adapter, dtype="fp32")
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    pairs = [([3, 4, 5], [6, 7])]
    for _ in range(2):  # some optimizer state worth saving
        loss = -policy.completion_logprobs(pairs)[0].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    torch_rng, python_rng = capture_rng()
    state = TrainingState(
        step=2, adapter_version=2, sampler={"size": 10, "seed": 0, "epoch": 0, "position": 8}, elapsed_seconds=1.5,
        reward_errors=1, config_hash="abc", config_fields={"a": 1}, optimizer=optimizer.state_dict(),
        scheduler=scheduler.state_dict(), torch_rng=torch_rng, python_rng=python_rng, metrics=[{"kind": "step", "step": 2}],
        tracker_runs={"mlflow": "0a1b", "wandb": "x7y8"},
    )  # fmt: skip
    write_checkpoint_files(tmp_path / "ckpt", policy, state)
    expected_adapter = policy.adapter_state()
    expected_draw = (torch.rand(3), random.random())

    fresh = load_policy(int4_dir, adapter, dtype="fp32")
    fresh_opt = torch.optim.AdamW(fresh.trainable_parameters(), lr=1e-2)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda s: min(1.0, (s + 1) / 4))
    loaded = read_checkpoint_files(tmp_path / "ckpt")
    fresh.load_adapter(tmp_path / "ckpt" / ADAPTER)
    fresh_opt.load_state_dict(loaded.optimizer)
    fresh_sched.load_state_dict(loaded.scheduler)
    restore_rng(loaded.torch_rng, loaded.python_rng)

    assert all(torch.equal(expected_adapter[k], v) for k, v in fresh.adapter_state().items())
    assert fresh_sched.get_last_lr() == scheduler.get_last_lr() and fresh_sched.last_epoch == 2
    moments = fresh_opt.state_dict()["state"]
    assert all(torch.equal(moments[i]["exp_avg"], optimizer.state_dict()["state"][i]["exp_avg"]) for i in moments)
    assert torch.equal(torch.rand(3), expected_draw[0]) and random.random() == expected_draw[1]
    assert (loaded.step, loaded.adapter_version, loaded.sampler["position"], loaded.metrics) == (2, 2, 8, state.metrics)
    assert loaded.tracker_runs == {"mlflow": "0a1b", "wandb": "x7y8"}  # a pod's resume continues its tracker runs

    wrong_rank = load_policy(int4_dir, AdapterSpec(rank=8, alpha=8, target_modules=["q_proj", "v_proj"]), dtype="fp32")
    with pytest.raises(ValueError, match="does not fit"):
        wrong_rank.load_adapter(tmp_path / "ckpt" / ADAPTER)


def test_new_settings_at_their_defaults_keep_earlier_checkpoints_resumable():
    """The quickstart's fingerprint as Orbit computed it before the signal-integrity settings
    (commit f423963): guards (sync, algorithm.max_mismatch, rewards[].max_error_fraction) are
    not in it, and rollout.truncated counts only when it is not 'keep'."""
    from pathlib import Path

    from orbit_runtime.config import load_job_spec
    from orbit_runtime.config.fingerprint import config_hash, training_fields

    spec = load_job_spec(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")
    # the quickstart as it was at f423963 (its learning rate has since been raised to 4e-3)
    spec = spec.model_copy(update={"schedule": spec.schedule.model_copy(update={"learning_rate": 2.0e-3})})
    assert config_hash(training_fields(spec, base_digest="abc")) == "cbd4664e74e70290"
    guarded = spec.model_copy(update={"algorithm": spec.algorithm.model_copy(update={"max_mismatch": 0.01})})
    assert config_hash(training_fields(guarded, base_digest="abc")) == "cbd4664e74e70290"
    masked = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"truncated": "mask"})})
    assert config_hash(training_fields(masked, base_digest="abc")) != "cbd4664e74e70290"


def test_only_a_resume_of_the_runs_own_checkpoint_continues_its_tracker_runs(tmp_path):
    from orbit_runtime.trainer.checkpoint_manager import CheckpointManager

    def manager(name: str, resume_from: str | None = None) -> CheckpointManager:
        spec = _spec(run={"name": name, "output_dir": str(tmp_path / "runs")})
        fields = training_fields(spec)
        return CheckpointManager(spec, tmp_path / name / "staging", config_hash(fields), fields, resume=False,
                                 resume_from=resume_from)  # fmt: skip

    first = manager("a")
    fields = training_fields(_spec(run={"name": "a", "output_dir": str(tmp_path / "runs")}))
    _fake_checkpoint(first.catalog, tmp_path, 3, fields)
    assert manager("a").resumes_own_run  # the same run, restarted: the same MLflow/W&B runs
    assert manager("a", resume_from=f"{first.uri}/step-00000003").resumes_own_run  # its own, named explicitly
    branch = manager("b", resume_from=f"{first.uri}/step-00000003")
    assert branch.plan.entry.step == 3 and not branch.resumes_own_run  # a branch must not write into run a's tracker runs
    assert not manager("c").resumes_own_run  # nothing to resume
