"""The Trainer's checkpoints and the end of a run: restoring a checkpoint when the run resumes,
taking one between steps, and shutting down (the final checkpoint, the summary and report, the
trackers) within checkpoint.stop_timeout_s.

A part of Trainer (trainer/loop.py), kept apart because it is one concern: it reads the
trainer's spec, policy, optimizer, scheduler, sampler, state, checkpoints, recorder, rollout,
reference, on_policy and shared_base; a restore sets the run's state, its sampler and the resume
report the first step after it records.
"""

from __future__ import annotations

import logging
import time

from orbit_runtime.data.sampler import PromptSampler
from orbit_runtime.observability import metrics
from orbit_runtime.trainer.checkpointing import (
    TrainingState,
    capture_cuda_rng,
    capture_rng,
    checkpoint_score,
    restore_cuda_rng,
    restore_rng,
)
from orbit_runtime.trainer.evaluation import heldout_summary

log = logging.getLogger(__name__)
TRACKER_CLOSE_S = 10.0  # the least the trackers get to close at the end, even after a slow final checkpoint


class CheckpointsAndShutdown:
    """Trainer's methods for checkpoints (restore, save) and the end of a run (see the module docstring)."""

    def _restore(self) -> None:
        """Continue from the planned checkpoint (learner, data cursor, RNG, counters, curves), if any."""
        started = time.monotonic()
        saved = self.checkpoints.restore(self.policy, self.optimizer, self.scheduler, len(self.splits.train))
        if saved is None:
            self.paths.start_fresh()
            return
        self.sampler = PromptSampler.from_state(saved.sampler)
        restore_rng(saved.torch_rng, saved.python_rng)
        restore_cuda_rng(saved.cuda_rng)
        state = self.state
        state.step, state.adapter_version = saved.step, saved.adapter_version
        state.elapsed_before, state.reward_errors = saved.elapsed_seconds, saved.reward_errors
        state.resumed_from = self.checkpoints.plan.entry.uri
        if self.checkpoints.resumes_own_run:  # a branch (--resume-from another run's checkpoint) gets tracker runs of its own
            state.tracker_runs.update(saved.tracker_runs)
        self.paths.start_fresh(keep_samples=True)
        self.recorder.restore(saved.metrics)
        self.on_policy.restore(state.steps)
        self._first_step_report = {"kind": "resume", "from": state.resumed_from, "from_step": saved.step,
                                   "restore_seconds": time.monotonic() - started}  # fmt: skip
        self._say(self.checkpoints.plan.note)

    def _training_state(self) -> TrainingState:
        torch_rng, python_rng = capture_rng()
        state = self.state
        return TrainingState(
            step=state.step, adapter_version=state.adapter_version, sampler=self.sampler.state_dict(),
            elapsed_seconds=state.wall_seconds, reward_errors=state.reward_errors,
            config_hash=self.config_hash, config_fields=self.config_fields,
            optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict(),
            torch_rng=torch_rng, python_rng=python_rng, metrics=list(state.rows), cuda_rng=capture_cuda_rng(),
            tracker_runs=dict(state.tracker_runs),
        )  # fmt: skip

    def checkpoint(self) -> None:
        """Checkpoint the state after the last completed step (staged here, uploaded in the background)."""
        state = self.state
        since = [r for r in state.steps if r["step"] > self.checkpoints.last_step]
        score = checkpoint_score(self.spec.checkpoint.best_metric, since, state.evals[-1] if state.evals else None)
        self.checkpoints.save(self.policy, self._training_state(), score)

    def _record_checkpoint_events(self) -> None:
        for event in self.checkpoints.events():
            metrics.observe_checkpoint(self.recorder.record(event))

    def _shut_down(self, reason: str, interrupted: bool) -> dict:
        """Checkpoint the last completed step, write the summary and report, close the trackers, within
        checkpoint.stop_timeout_s in all (the trackers get at least TRACKER_CLOSE_S; the pod's grace period
        is stop_timeout_s plus 30 s, for this and for stopping the roles before it). Each
        part is attempted even if another fails (e.g. on a full disk), so the error that stopped the run
        is the one the user sees; failures here are logged."""
        summary: dict = {}
        deadline = time.monotonic() + self.spec.checkpoint.stop_timeout_s
        for what, action in (("final checkpoint", lambda: self._finish_checkpoints(reason, deadline)),
                             ("summary", lambda: summary.update(self.write_summary(interrupted))),
                             ("trackers", lambda: self._finish_trackers(deadline))):  # fmt: skip
            try:
                action()
            except Exception as exc:
                log.error("could not write the %s (%s): %s: %s", what, reason, type(exc).__name__, exc)
        metrics.LEARNER_UP.set(0)
        if self.metrics_server:
            self.metrics_server.stop()
        return summary

    def _finish_trackers(self, deadline: float) -> None:
        # what the checkpoint left of the deadline; at least TRACKER_CLOSE_S, even past it (inside the pod's 30 s margin)
        deadline = max(deadline, time.monotonic() + TRACKER_CLOSE_S)
        warning = self.recorder.finish_trackers(self.phase, self.policy.save_adapter, deadline)
        if warning:
            self._say(f"[yellow]{warning}")

    def _finish_checkpoints(self, reason: str, deadline: float) -> None:
        """Checkpoint the last completed step (if not yet) and wait for it to land until DEADLINE."""
        if self.state.step > self.checkpoints.last_step:
            self.checkpoint()
        warning = self.checkpoints.close(max(deadline - time.monotonic(), 0.0))
        if warning:
            self._say(f"[yellow]{warning} ({reason})")
        self._record_checkpoint_events()

    def write_summary(self, interrupted: bool) -> dict:
        stats = self.checkpoints.stats
        return self.recorder.write_summary({
            **heldout_summary(self.state.evals, self.spec.eval.samples),
            "steps": self.state.step,
            "wall_seconds": round(self.state.wall_seconds, 1),
            "adapter_version": self.state.adapter_version,
            "rollout_restarts": self.rollout.restarts,
            "reference_restarts": self.reference.restarts,
            "canary_failures": self.rollout.canary_failures,
            "reward_errors": self.state.reward_errors,
            "interrupted": interrupted,
            "resumed_from": self.state.resumed_from,
            "checkpoint_uri": self.checkpoints.uri,
            "last_checkpoint_step": stats.last_success_step,
            "checkpoint_failures": stats.failures,
            "stop_reason": self.stop_reason,
            "canary_noise_floor": self.rollout.noise_floor,
            "canary_inconclusive_syncs": sum(1 for r in self.state.steps if r.get("canary_verdict") == "inconclusive"),
            "on_policy": self.on_policy.health(),
            "placement": self.spec.placement,
            "learner_private_base_bytes": self._private_base_bytes(),
            **({"shared_base_unchanged": self.shared_base.unchanged(), "shared_base_attaches": self.shared_base.attaches,
                "shared_base_engine_on_shared_pages": self.shared_base.engine_on_shared_pages,
                "shared_base_bytes": self.shared_base.attached.arena.size if self.shared_base.attached else None}
               if self.shared_base else {}),
        })  # fmt: skip
