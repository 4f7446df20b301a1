"""What a learner checkpoint holds, when one is due, and which one a run resumes from.

A checkpoint is everything that decides the next steps: the adapter (PEFT format), AdamW's
moments, the LR scheduler, the data cursor, the RNG states, the step and adapter version,
plus the metrics so far (to continue curves) and the config it was trained with (to refuse
resuming under a different one). The functions here take and return plain objects; the
Trainer does the I/O around them.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlparse

import torch

from orbit_runtime.checkpoint.catalog import CheckpointCatalog, CheckpointEntry, parse_step_dir
from orbit_runtime.checkpoint.storage import open_store
from orbit_runtime.config.fingerprint import describe_differences
from orbit_runtime.errors import OrbitError

log = logging.getLogger(__name__)

ADAPTER = "adapter"
TRAINER_STATE = "trainer_state.pt"
STATE = "state.json"
METRICS = "metrics.jsonl"


def checkpoint_due(
    step: int, last_step: int, last_time: float, now: float, every_steps: int | None, every_minutes: float | None
) -> bool:
    """A checkpoint is due every EVERY_STEPS steps, or when EVERY_MINUTES passed since the last one."""
    if step <= last_step:
        return False
    if every_steps is not None and step % every_steps == 0:
        return True
    return every_minutes is not None and now - last_time >= every_minutes * 60


@dataclass
class TrainingState:
    """The learner's state between two steps, as a checkpoint stores it."""

    step: int
    adapter_version: int
    sampler: dict
    elapsed_seconds: float
    reward_errors: int
    config_hash: str
    config_fields: dict
    optimizer: dict
    scheduler: dict
    torch_rng: torch.Tensor
    python_rng: tuple
    metrics: list[dict]  # every row of metrics.jsonl so far (steps, evals, checkpoints)
    cuda_rng: list[torch.Tensor] = field(default_factory=list)  # one per CUDA device; empty on CPU
    tracker_runs: dict[str, str] = field(default_factory=dict)  # {tracker: run id}: a resume continues those runs


def write_checkpoint_files(dest: Path, policy, state: TrainingState) -> None:
    """Write STATE (and POLICY's adapter) as the files of one checkpoint into DEST."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    policy.save_adapter(dest / ADAPTER)
    torch.save(
        {
            "optimizer": state.optimizer,
            "scheduler": state.scheduler,
            "torch_rng": state.torch_rng,
            "python_rng": state.python_rng,
            "cuda_rng": state.cuda_rng,
        },
        dest / TRAINER_STATE,
    )
    scalars = {
        "step": state.step,
        "adapter_version": state.adapter_version,
        "sampler": state.sampler,
        "elapsed_seconds": state.elapsed_seconds,
        "reward_errors": state.reward_errors,
        "config_hash": state.config_hash,
        "config_fields": state.config_fields,
        "tracker_runs": state.tracker_runs,
    }
    (dest / STATE).write_text(json.dumps(scalars, indent=2))
    (dest / METRICS).write_text("".join(json.dumps(row) + "\n" for row in state.metrics))


def read_checkpoint_files(src: Path) -> TrainingState:
    """The TrainingState stored in SRC (the adapter stays in SRC/adapter for the policy to load)."""
    src = Path(src)
    scalars = json.loads((src / STATE).read_text())
    tensors = torch.load(src / TRAINER_STATE, weights_only=True, map_location="cpu")  # written on a GPU, read anywhere
    metrics = [json.loads(line) for line in (src / METRICS).read_text().splitlines() if line.strip()]
    python_rng = tensors["python_rng"]
    known = {f.name for f in fields(TrainingState)}  # a newer Orbit's extra fields are not this one's
    return TrainingState(
        **{k: v for k, v in scalars.items() if k in known},
        optimizer=tensors["optimizer"],
        scheduler=tensors["scheduler"],
        torch_rng=tensors["torch_rng"],
        python_rng=(python_rng[0], tuple(python_rng[1]), python_rng[2]),
        metrics=metrics,
        cuda_rng=list(tensors.get("cuda_rng", [])),
    )


def capture_rng() -> tuple[torch.Tensor, tuple]:
    return torch.get_rng_state(), random.getstate()


def restore_rng(torch_rng: torch.Tensor, python_rng: tuple) -> None:
    torch.set_rng_state(torch_rng)
    random.setstate(python_rng)


def capture_cuda_rng() -> list[torch.Tensor]:
    """Each CUDA device's generator state (GPU dropout masks); empty without CUDA."""
    return torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []


def restore_cuda_rng(states: list[torch.Tensor]) -> None:
    """Put CUDA generator states back when this machine has the same devices; otherwise (a
    checkpoint from another machine, or a CPU one) GPU dropout masks will differ, which is logged."""
    if not states or not torch.cuda.is_available():
        if states:
            log.warning("checkpoint has CUDA RNG states but torch sees no GPU: GPU random streams are not restored")
        return
    if len(states) != torch.cuda.device_count():
        log.warning("checkpoint has %d CUDA RNG states, this machine %d GPUs: not restored", len(states), torch.cuda.device_count())
        return
    torch.cuda.set_rng_state_all(states)


def checkpoint_score(best_metric: str, steps_since_last: list[dict], last_eval: dict | None) -> float | None:
    """The number retention ranks checkpoints by ('best by reward')."""
    if best_metric == "heldout_accuracy":
        return last_eval["accuracy"] if last_eval else None
    rewards = [row["reward_mean"] for row in steps_since_last]
    return sum(rewards) / len(rewards) if rewards else None


# ---- choosing what to resume from ------------------------------------------------------
def split_checkpoint_uri(uri: str) -> tuple[str, int]:
    """`<prefix>/step-00000012` -> (`<prefix>`, 12); OrbitError if URI does not name a step."""
    parsed = urlparse(uri.rstrip("/"))
    head, _, last = parsed.path.rpartition("/")
    step = parse_step_dir(last)
    if step is None:
        raise OrbitError(
            f"--resume-from {uri!r}: expected a checkpoint URI ending in /step-NNNNNNNN (see `orbit checkpoints list`)"
        )
    return f"{parsed.scheme}://{parsed.netloc}{head}", step


@dataclass(frozen=True)
class ResumePlan:
    catalog: CheckpointCatalog | None  # where the checkpoint is read from
    entry: CheckpointEntry | None  # None: start fresh
    note: str  # one line for the user


def plan_resume(
    catalog: CheckpointCatalog,
    config_hash: str,
    config_fields: dict,
    *,
    resume: bool,
    resume_from: str | None,
    retries: int = 4,
) -> ResumePlan:
    """Which checkpoint this run continues from, or None.

    --resume-from URI: that checkpoint, whatever its config (differences are listed).
    Otherwise the newest complete checkpoint under the run's checkpoint URI, if any (also
    without --resume); it must have been written with this config. --resume with no
    checkpoint is an error; without --resume an empty prefix means a fresh start.
    """
    if resume_from:
        prefix, step = split_checkpoint_uri(resume_from)
        source = CheckpointCatalog(open_store(prefix, retries=retries))
        entry = next((e for e in source.entries() if e.step == step), None)
        if entry is None or not entry.complete:
            state = "incomplete (no valid manifest)" if entry else "not found"
            raise OrbitError(f"--resume-from {resume_from}: checkpoint {state}")
        differences = describe_differences(entry.manifest.get("config_fields", {}), config_fields)
        note = f"resuming from {entry.uri} (step {step})"
        if differences:
            note += " with a changed config:\n  " + "\n  ".join(differences)
        return ResumePlan(source, entry, note)
    complete = catalog.complete()
    if not complete:
        if resume:
            raise OrbitError(f"--resume: no complete checkpoint under {catalog.uri}")
        return ResumePlan(None, None, "no checkpoint to resume from; starting fresh")
    latest = complete[-1]
    if latest.config_hash != config_hash:
        recorded = latest.manifest.get("config_fields", {})
        differences = describe_differences(recorded, config_fields)
        reason, then = "with a different job config", "with the new config"
        digest = config_fields.get("model.base_digest")
        if digest is not None and recorded.get("model.base_digest") != digest:
            then = "on this base"
            reason = (
                "on a different base model (model.base_digest differs: the base was rebuilt or replaced)"
                if "model.base_digest" in recorded
                else "by an Orbit that did not record the base's content digest, so it cannot be matched to this base"
            )
        raise OrbitError(
            f"{latest.uri} was written {reason} (hash {latest.config_hash}, now {config_hash}); "
            "refusing to resume from it:\n  " + "\n  ".join(differences or ["(fields not recorded)"]) + "\n"
            "Use --checkpoint-uri to start a new run elsewhere, or --resume-from "
            f"{latest.uri} to continue from it {then}."
        )
    return ResumePlan(catalog, latest, f"resuming from {latest.uri} (step {latest.step})")
