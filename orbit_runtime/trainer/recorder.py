"""What a run leaves behind for people and tools: metrics.jsonl rows (steps, evals, events),
samples.jsonl, summary.json, report.html and processes.json, under runs/<name>/, and the same rows
sent to the experiment trackers of run.report_to (orbit_runtime/tracking)."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field

from orbit_runtime.checkpoint.catalog import step_dir
from orbit_runtime.learner.update import UpdateResult
from orbit_runtime.redaction import mask_all, secret_values
from orbit_runtime.run_paths import RunPaths
from orbit_runtime.sync.adapter_sync import SyncResult
from orbit_runtime.tracking import TrackerFanout, open_trackers
from orbit_runtime.tracking.fanout import TrackingContext
from orbit_runtime.trainer.batch import RolloutBatch
from orbit_runtime.trainer.report import render_report

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """The run's counters between steps (what a checkpoint restores besides the learner)."""

    step: int = 0
    adapter_version: int = 0
    started: float = field(default_factory=time.monotonic)
    elapsed_before: float = 0.0  # wall seconds of the run's earlier lives (before a resume)
    rows: list[dict] = field(default_factory=list)  # every metrics.jsonl row (steps, evals, ...), for checkpoints
    reward_errors: int = 0
    resumed_from: str | None = None
    tracker_runs: dict[str, str] = field(default_factory=dict)  # {tracker: its run id}, for a resume to continue

    @property
    def steps(self) -> list[dict]:
        return [r for r in self.rows if r.get("kind") == "step"]

    @property
    def evals(self) -> list[dict]:
        return [r for r in self.rows if r.get("kind") == "eval"]

    @property
    def wall_seconds(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started


def signal_health(steps: list[dict], on_policy: dict | None, noise_floor: float | None) -> dict:
    """The `/status` document's view of the RL signal: the canary (prefill and decode paths) and
    the step's train-rollout mismatch, and the on-policy guard's state."""
    last = steps[-1] if steps else {}
    return {
        "canary": {
            "verdict": last.get("canary_verdict"),
            "prefillMeanAbsDlogp": last.get("canary_mean_abs_dlogp"),
            "previousVersionMeanAbsDlogp": last.get("canary_previous_mean_abs_dlogp"),
            "decodeMeanAbsDlogp": last.get("canary_decode_mean_abs_dlogp"),
            "tolerance": last.get("canary_tolerance"),
            "noiseFloor": noise_floor,
        },
        "mismatch": {"meanAbsDlogp": last.get("mismatch_mean_abs"), "maxAbsDlogp": last.get("mismatch_max_abs")},
        "onPolicy": on_policy,
    }


def status_document(state: RunState, *, phase: str, max_steps: int, checkpoint_uri: str, last_checkpoint_step: int | None,
                    restarts: dict[str, int], signal: dict | None = None, reason: str | None = None) -> dict:  # fmt: skip
    """The learner's `/status` JSON: what the operator copies into the RLTrainingJob's status.
    REASON: why a failed run stopped (e.g. OffPolicy); SIGNAL: signal_health."""
    steps, evals = state.steps, state.evals
    last_eval = evals[-1] if evals else {}
    return {
        "phase": phase,  # starting, running, succeeded, stopped, failed
        "reason": reason,
        "step": state.step,
        "maxSteps": max_steps,
        "reward": steps[-1]["reward_mean"] if steps else None,
        "heldoutAccuracy": last_eval.get("accuracy"),
        "heldoutStderr": last_eval.get("accuracy_stderr"),
        "heldoutPrompts": last_eval.get("examples"),
        "signal": signal,
        "adapterVersion": state.adapter_version,
        "lastCheckpoint": (
            {"uri": f"{checkpoint_uri.rstrip('/')}/{step_dir(last_checkpoint_step)}", "step": last_checkpoint_step}
            if last_checkpoint_step
            else None
        ),
        "restarts": dict(restarts),
        "resumedFrom": state.resumed_from,
        "wallSeconds": round(state.wall_seconds, 1),
    }


def sample_rows(step: int, batch: RolloutBatch, group_size: int, limit: int) -> list[dict]:
    """Up to LIMIT samples of BATCH as JSON rows, spread over the groups (all when LIMIT >= the batch)."""
    n = len(batch.completions)
    if limit <= 0:
        return []
    chosen = range(n) if limit >= n else sorted({round(i * n / limit) for i in range(limit)})
    rows = []
    for i in chosen:
        example = batch.examples[i // group_size]
        rows.append({
            "step": step, "group": i // group_size, "index_in_group": i % group_size, "prompt_index": batch.indices[i // group_size],
            "prompt": example.prompt, "answer": example.answer, "completion": batch.texts[i],
            "reward": batch.rewards.total[i], "advantage": float(batch.advantages[i]),
            "tokens": len(batch.completions[i].token_ids), "finish_reason": batch.completions[i].finish_reason,
        })  # fmt: skip
        if batch.episodes is not None:  # the whole episode: every message, how it ended
            episode = batch.episodes[i]
            rows[-1] |= {"messages": episode.messages, "turns": episode.turns, "ending": episode.ending,
                         "model_tokens": episode.model_tokens, "environment_reward": episode.environment_reward}  # fmt: skip
    return rows


def step_row(step: int, adapter_version: int, batch: RolloutBatch, update: UpdateResult, sync: SyncResult, *, lr: float,
             adapter_bytes: int, timings: dict[str, float], step_seconds: float, restarts: dict[str, int],
             memory: dict[str, int]) -> dict:  # fmt: skip
    """The metrics.jsonl row of one committed step (MEMORY: the step's peaks, see observability.peak_memory)."""
    rewards = batch.rewards.total
    mean = sum(rewards) / len(rewards)
    mismatch = update.mismatch
    return {
        "kind": "step", "step": step,
        "reward_mean": mean, "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
        "reward_errors": sum(batch.rewards.errors.values()),
        "loss": update.loss, "policy_loss": update.policy_loss, "kl": update.kl,
        "clip_fraction": update.clip_fraction, "dual_clip_fraction": update.dual_clip_fraction,
        "is_weight_mean": update.is_weight_mean, "mis_rejected_fraction": update.mis_rejected_fraction,
        "is_over_cap_fraction": update.is_over_cap_fraction,
        "grad_norm": update.grad_norm, "learning_rate": lr, "optimizer_steps": update.optimizer_steps,
        "micro_batches": update.micro_batches, **memory,
        "mismatch_mean_abs": mismatch.mean_abs_dlogp, "mismatch_max_abs": mismatch.max_abs_dlogp,
        "mismatch_k3_kl": mismatch.k3_kl, **routing_fields(update),
        "samples": len(batch.completions), "tokens": batch.tokens, "prompt_indices": batch.indices,
        "tokens_per_second": batch.tokens / step_seconds,
        "adapter_version": adapter_version, "adapter_bytes": adapter_bytes,
        "sync_seconds": sync.seconds, "sync_attempts": sync.attempts, **canary_fields(sync),
        "truncated": sum(batch.truncated),
        **restarts, "step_seconds": step_seconds,
        **{k: round(v, 4) for k, v in timings.items()},
    }  # fmt: skip


def routing_fields(update: UpdateResult) -> dict:
    """Routing replay's figures in a step row (empty without replay): the learner's own experts vs the
    rollout's (all positions and layers, per layer, tokens agreeing in every layer) and the mismatch
    the learner would have without replay."""
    agreement, unreplayed = update.routing_agreement, update.unreplayed_mismatch
    if agreement is None or unreplayed is None:
        return {}
    return {
        "routing_agreement": agreement.overall,
        "routing_token_agreement": agreement.token_agreement,
        "routing_agreement_by_layer": {str(k): v for k, v in agreement.per_layer().items()},
        "routing_missing_samples": update.routing_missing,
        "mismatch_unreplayed_mean_abs": unreplayed.mean_abs_dlogp,
        "mismatch_unreplayed_max_abs": unreplayed.max_abs_dlogp,
    }


def canary_fields(sync: SyncResult) -> dict:
    """The sync's canary figures in a step row: prefill vs this version and the previous one, the
    verdict, the tolerance, and the decode path."""
    decode = sync.decode
    return {
        "canary_mean_abs_dlogp": sync.canary_mean_abs_dlogp,
        "canary_previous_mean_abs_dlogp": sync.canary_previous_mean_abs_dlogp,
        "canary_separation": sync.canary_separation,
        "canary_verdict": sync.canary_verdict,
        "canary_tolerance": sync.canary_tolerance,
        "canary_decode_mean_abs_dlogp": decode.mean_abs_dlogp if decode else None,
        "canary_decode_max_abs_dlogp": decode.max_abs_dlogp if decode else None,
        "sync_canary_expected_s": sync.expected_seconds,  # sync_s = publish + this + sync_seconds + decode
        "sync_decode_canary_s": sync.decode_seconds,
    }


def _sample_step(line: str) -> float:
    """The step of a samples.jsonl line; a torn line (a crash mid-write) sorts after every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


class RunRecorder:
    """Appends rows to the run's files; the rows also live in STATE (checkpoints carry them). SPEC, the
    job spec, is written to job.json (what `orbit plan --compare` plans the run with)."""

    def __init__(self, paths: RunPaths, state: RunState, name: str, spec=None) -> None:
        self.paths = paths
        self.state = state
        self.name = name
        self.spec = spec
        self.trackers = TrackerFanout({})  # none until open_trackers
        if spec is not None:
            paths.job_spec.write_text(spec.model_dump_json(indent=2))

    def shareable_spec(self) -> dict | None:
        """The job spec as JSON for what leaves the run directory (trackers, the report): every secret
        environment value and every URL's user:password@ masked (a tracking URI, a reward's kwargs)."""
        return mask_all(self.spec.model_dump(mode="json"), secret_values()) if self.spec is not None else None

    def open_trackers(self, resumed_step: int | None) -> None:
        """Start the trackers of run.report_to (after the run restored its checkpoint, if any: RESUMED_STEP);
        OrbitError if one is not installed. The rows recorded so far (a resumed run's curves) go to tracker
        runs that start empty."""
        run = self.spec.run
        if resumed_step is None:
            (self.paths.root / "tracking.json").unlink(missing_ok=True)  # a new run: new tracker runs
            self.state.tracker_runs.clear()
        context = TrackingContext(run_dir=self.paths.root, output_dir=self.paths.root.parent, run=run,
                                  spec_json=self.shareable_spec(), resumed_step=resumed_step,
                                  run_ids=self.state.tracker_runs)  # fmt: skip
        self.trackers = open_trackers(context, list(self.state.rows))

    def finish_trackers(self, phase: str, save_adapter, deadline: float) -> str | None:
        """Send the report and the final adapter (SAVE_ADAPTER(dir) writes it) and close the trackers with
        the run's PHASE, by DEADLINE (time.monotonic(); writing the adapter counts); a warning when they did
        not finish. The trackers are closed even when the adapter could not be written."""
        if not self.trackers.names:
            return None
        artifacts = [self.paths.report, self.paths.summary]
        if save_adapter is not None:
            try:
                artifacts.append(save_adapter(self.paths.final_adapter))
            except Exception as exc:
                log.error("could not write the final adapter for the trackers: %s: %s", type(exc).__name__, exc)
        return self.trackers.finish(phase, [a for a in artifacts if a.exists()], max(0.0, deadline - time.monotonic()))

    def record(self, row: dict) -> dict:
        """Append ROW (time-stamped) to metrics.jsonl and to the rows a checkpoint carries; returns it."""
        row = {"time": time.time(), **row}
        with open(self.paths.metrics, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.state.rows.append(row)
        self.trackers.log_row(row)
        return row

    def record_samples(self, rows: list[dict]) -> None:
        if rows:
            with open(self.paths.samples, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))
            self.trackers.log_samples(rows[0]["step"], rows)

    def restore(self, rows: list[dict]) -> None:
        """A resumed run continues the checkpoint's curves (rows after it are dropped)."""
        self.state.rows = list(rows)
        self.paths.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
        step = max((r["step"] for r in rows if r.get("kind") == "step"), default=0)
        if self.paths.samples.exists():
            kept = [line for line in self.paths.samples.read_text().splitlines() if _sample_step(line) <= step]
            self.paths.samples.write_text("".join(line + "\n" for line in kept))

    def write_processes(self, roles: dict) -> None:
        self.paths.processes.write_text(json.dumps(roles, indent=2))

    def write_summary(self, summary: dict) -> dict:
        self.paths.summary.write_text(json.dumps(summary, indent=2) + "\n")
        self.paths.report.write_text(render_report(self.name, self.state.steps, self.state.evals, summary, self.shareable_spec()))
        return summary
