"""What a run leaves behind for people and tools: metrics.jsonl rows (steps, evals, events),
samples.jsonl, summary.json, report.html and processes.json, under runs/<name>/."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

from orbit_runtime.run_paths import RunPaths
from orbit_runtime.trainer.batch import RolloutBatch
from orbit_runtime.trainer.report import render_report


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

    @property
    def steps(self) -> list[dict]:
        return [r for r in self.rows if r.get("kind") == "step"]

    @property
    def evals(self) -> list[dict]:
        return [r for r in self.rows if r.get("kind") == "eval"]

    @property
    def wall_seconds(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started


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
    return rows


def reward_stats(rewards: list[float]) -> tuple[float, float]:
    mean = sum(rewards) / len(rewards)
    return mean, math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))


class RunRecorder:
    """Appends rows to the run's files; the rows also live in STATE (checkpoints carry them)."""

    def __init__(self, paths: RunPaths, state: RunState, name: str) -> None:
        self.paths = paths
        self.state = state
        self.name = name

    def record(self, row: dict) -> dict:
        """Append ROW (time-stamped) to metrics.jsonl and to the rows a checkpoint carries; returns it."""
        row = {"time": time.time(), **row}
        with open(self.paths.metrics, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.state.rows.append(row)
        return row

    def record_samples(self, rows: list[dict]) -> None:
        if rows:
            with open(self.paths.samples, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))

    def restore(self, rows: list[dict]) -> None:
        """A resumed run continues the checkpoint's curves (rows after it are dropped)."""
        self.state.rows = list(rows)
        self.paths.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
        step = max((r["step"] for r in rows if r.get("kind") == "step"), default=0)
        if self.paths.samples.exists():
            kept = [line for line in self.paths.samples.read_text().splitlines() if json.loads(line)["step"] <= step]
            self.paths.samples.write_text("".join(line + "\n" for line in kept))

    def write_processes(self, roles: dict) -> None:
        self.paths.processes.write_text(json.dumps(roles, indent=2))

    def write_summary(self, summary: dict) -> dict:
        self.paths.summary.write_text(json.dumps(summary, indent=2) + "\n")
        self.paths.report.write_text(render_report(self.name, self.state.steps, self.state.evals, summary))
        return summary
