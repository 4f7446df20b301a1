"""A job config's identity for resume: the settings that change what training computes.

Where checkpoints go, how often they are written, how evaluation and sync verification run,
where metrics are served, what is logged, where the learner and the rollout run and how
they split their work (micro-batches, GPU settings, `placement`: one base copy or two), and how many steps the run lasts do
not change the computation of any step, so they are left out: a run can be resumed to
train longer, on another device, or with checkpoints redirected. Everything else - model,
adapter, algorithm, data, rewards, rollout sampling, schedule - is in the hash.

The base model is identified by its content digest (model.base_digest, see
int4/base_digest.py), not by its path: a base moved elsewhere is the same base, and a
different base rebuilt at the same path is not.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from orbit_runtime.config.spec import JobSpec

EXCLUDED = (
    "checkpoint", "eval", "metrics", "sync", "run.output_dir", "run.log_samples", "run.report_to", "run.tracking", "schedule.steps",
    "rollout.max_restarts", "rollout.kv_cache_gib", "reference.max_restarts", "reference.report_kl", "learner",
    "rollout.gpu_memory_utilization", "rollout.tensor_parallel_size", "rollout.enable_prefix_caching", "rollout.max_num_seqs",
    "rollout.enforce_eager", "algorithm.max_mismatch", "algorithm.max_mismatch_steps", "placement",
)  # fmt: skip


# Fields added after checkpoints were first written, left out of the hash while at their
# default: a run that does not use them resumes the checkpoints of earlier versions.
LATER_DEFAULTS = {"rollout.truncated": "keep", "rollout.truncated_reward": 0.0, "moe.routing_replay": False,
                  "environment": None}  # fields added after runs were checkpointed: their defaults keep old hashes
REWARD_GUARDS = ("max_error_fraction",)  # per reward: when a step fails, not what it computes


def flatten_fields(value: Any, prefix: str = "", keep_empty: bool = False) -> dict[str, Any]:
    """A nested dict (a spec's model_dump) as {dotted.field: leaf}. An empty dict has no leaves and is
    left out, unless KEEP_EMPTY (then it is a leaf itself; the hash keeps leaving it out)."""
    if isinstance(value, dict) and (value or not keep_empty or not prefix):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten_fields(item, f"{prefix}.{key}" if prefix else str(key), keep_empty))
        return out
    return {prefix: value}


def training_fields(spec: JobSpec, base_digest: str | None = None) -> dict[str, Any]:
    """The config as {dotted.field: value}, without the EXCLUDED fields.

    schedule.steps stays in when the LR decays: it sets the decay horizon. With BASE_DIGEST
    (`read_base_digest(spec.model.path)`) the base is identified by it: model.base_digest is
    in and model.path is out. Without it, model.path stands for the base (as before).
    """
    excluded = EXCLUDED if spec.schedule.lr_schedule == "constant" else tuple(e for e in EXCLUDED if e != "schedule.steps")
    if base_digest is not None:
        excluded += ("model.path",)
    flat = flatten_fields(spec.model_dump(mode="json"))
    fields = {k: v for k, v in flat.items() if not any(k == e or k.startswith(e + ".") for e in excluded)}
    fields = {k: v for k, v in fields.items() if not (k in LATER_DEFAULTS and v == LATER_DEFAULTS[k])}
    if "rewards" in fields:
        fields["rewards"] = [{k: v for k, v in r.items() if k not in REWARD_GUARDS} for r in fields["rewards"]]
    if base_digest is not None:
        fields["model.base_digest"] = base_digest
    return fields


def config_hash(fields: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of FIELDS (first 16 hex digits)."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def describe_differences(old: dict[str, Any], new: dict[str, Any], limit: int = 10,
                         labels: tuple[str, str] = ("checkpoint", "now")) -> list[str]:  # fmt: skip
    """Human-readable lines `field: old (LABELS[0]) -> new (LABELS[1])` for every field that differs."""
    lines = []
    for key in sorted(set(old) | set(new)):
        if old.get(key, "(unset)") != new.get(key, "(unset)"):
            lines.append(
                f"{key}: {json.dumps(old.get(key, '(unset)'))} ({labels[0]}) -> {json.dumps(new.get(key, '(unset)'))} ({labels[1]})"
            )
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more"]
    return lines
