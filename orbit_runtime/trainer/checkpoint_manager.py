"""The run's checkpoints: which one to resume from, restoring it, staging new ones for the
background writer, and the bounded wait for the last one when the run stops. What a
checkpoint holds and the pure decisions live in `checkpointing`."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from orbit_runtime.checkpoint.catalog import CheckpointCatalog, step_dir
from orbit_runtime.checkpoint.storage import StorageError, open_store
from orbit_runtime.checkpoint.writer import CheckpointWriter, StagedCheckpoint, WriterStats
from orbit_runtime.config.spec import JobSpec
from orbit_runtime.errors import OrbitError
from orbit_runtime.trainer.checkpointing import (
    ADAPTER,
    TrainingState,
    checkpoint_due,
    plan_resume,
    read_checkpoint_files,
    write_checkpoint_files,
)

log = logging.getLogger(__name__)


class CheckpointManager:
    def __init__(self, spec: JobSpec, staging_root: Path, config_hash: str, config_fields: dict, *,
                 resume: bool, resume_from: str | None) -> None:  # fmt: skip
        self.spec = spec
        self.staging_root = staging_root
        self.config_hash, self.config_fields = config_hash, config_fields
        self.catalog = CheckpointCatalog(open_store(spec.checkpoint_uri(), retries=spec.checkpoint.retries))
        try:
            self.plan = plan_resume(self.catalog, config_hash, config_fields, resume=resume, resume_from=resume_from,
                                    retries=spec.checkpoint.retries)  # fmt: skip
        except StorageError as exc:
            raise OrbitError(f"cannot read checkpoints to decide whether to resume: {exc}") from None
        self.writer = CheckpointWriter(self.catalog, keep_last=spec.checkpoint.keep_last, keep_best=spec.checkpoint.keep_best)
        self.last_step = 0
        self.last_time = time.monotonic()

    @property
    def uri(self) -> str:
        return self.catalog.uri

    @property
    def resumes_own_run(self) -> bool:
        """Whether the planned checkpoint is one of this run's own (not --resume-from another run's)."""
        return self.plan.catalog is not None and self.plan.catalog.uri.rstrip("/") == self.catalog.uri.rstrip("/")

    @property
    def stats(self) -> WriterStats:
        return self.writer.stats

    def restore(self, policy, optimizer, scheduler, train_size: int) -> TrainingState | None:
        """Load the planned checkpoint into POLICY, OPTIMIZER and SCHEDULER; the rest (data cursor,
        RNG, counters, rows) is returned for the trainer to apply. None: nothing to resume."""
        entry = self.plan.entry
        if entry is None:
            return None
        try:
            local = self.plan.catalog.download_to_temp(entry)
        except StorageError as exc:
            raise OrbitError(f"cannot resume: {exc}") from None
        try:
            saved = read_checkpoint_files(local)
            if saved.sampler.get("size") != train_size:
                raise OrbitError(
                    f"{entry.uri}: its data cursor is for {saved.sampler.get('size')} training prompts, this config has {train_size}"
                )
            try:
                policy.load_adapter(local / ADAPTER)
            except ValueError as exc:
                raise OrbitError(f"{entry.uri}: {exc}") from None
            optimizer.load_state_dict(saved.optimizer)
            scheduler.load_state_dict(saved.scheduler)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        self.last_step = saved.step
        return saved

    def remove_torn(self) -> list[int]:
        """Drop step directories a dead writer left without a manifest (never read; this run owns the prefix)."""
        try:
            return [e.step for e in self.catalog.remove_torn()]
        except StorageError as exc:
            log.warning("could not remove torn checkpoints (the writer retries later): %s", exc)
            return []

    def due(self, step: int) -> bool:
        every = self.spec.checkpoint
        return checkpoint_due(step, self.last_step, self.last_time, time.monotonic(), every.every_steps, every.every_minutes)

    def save(self, policy, state: TrainingState, score: float | None) -> None:
        """Stage STATE (taken between two steps) locally and hand it to the background writer."""
        staging = self.staging_root / step_dir(state.step)
        shutil.rmtree(staging, ignore_errors=True)
        write_checkpoint_files(staging, policy, state)
        meta = {"config_hash": self.config_hash, "config_fields": self.config_fields, "adapter_version": state.adapter_version,
                "score": score, "best_metric": self.spec.checkpoint.best_metric}  # fmt: skip
        self.writer.submit(StagedCheckpoint(state.step, staging, meta))
        self.last_step, self.last_time = state.step, time.monotonic()

    def events(self) -> list[dict]:
        return self.writer.events()

    def close(self, timeout_s: float) -> str | None:
        """Wait up to TIMEOUT_S for the pending checkpoint, then stop the writer; a warning if it did not land."""
        warning = None
        pending = self.writer.pending_step
        if pending is not None and not self.writer.wait(timeout_s):
            last = self.writer.stats.last_success_step
            warning = (
                f"checkpoint of step {pending} did not land within {timeout_s:.0f}s; newest complete checkpoint: "
                f"{f'step {last}' if last else 'none from this run'}; last error: {self.writer.stats.last_error}"
            )
        self.writer.close()
        return warning
