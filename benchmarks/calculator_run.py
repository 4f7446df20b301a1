"""The calculator demo's result: held-out success before and after RL, from a finished run.

Reads the run directory `make demo-calculator` (or `orbit train examples/calculator.yaml`)
wrote: summary.json and metrics.jsonl. Reports the held-out success (greedy, whole episodes)
at every evaluation with its standard error, the rise in standard errors, and the run's
wall time and per-step phases, plus what produced it (commit, CPU, versions).

    python benchmarks/calculator_run.py --run runs/calculator --json benchmarks/results/calculator.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from benchmark_output import emit_json


def summarize(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary_path = run_dir / "summary.json"  # absent when the run was killed (SIGKILL) rather than stopped
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    evals = [r for r in rows if r["kind"] == "eval"]
    steps = [r for r in rows if r["kind"] == "step"]
    before, after = evals[0], evals[-1]
    stderr = math.hypot(before["accuracy_stderr"], after["accuracy_stderr"])
    phases = ("generate_s", "environment_s", "train_s", "sync_s", "step_seconds")
    return {
        "heldout_success_before": before["accuracy"],
        "heldout_success_before_stderr": before["accuracy_stderr"],
        "heldout_success_after": after["accuracy"],
        "heldout_success_after_stderr": after["accuracy_stderr"],
        "heldout_prompts": after["examples"],
        "rise_in_before_stderrs": (after["accuracy"] - before["accuracy"]) / before["accuracy_stderr"] if before["accuracy_stderr"] else None,
        "rise_in_stderrs_of_the_difference": (after["accuracy"] - before["accuracy"]) / stderr if stderr else None,
        "heldout_by_step": [{"step": r["step"], "success": r["accuracy"], "stderr": r["accuracy_stderr"]} for r in evals],
        "steps": steps[-1]["step"] if steps else 0,
        "wall_seconds": summary.get("wall_seconds", round(sum(r["step_seconds"] for r in steps), 1)),
        "median_step_phases_s": {p: statistics.median(r.get(p, 0.0) for r in steps) for p in phases},
        "mismatch_mean_abs_max": max(r["mismatch_mean_abs"] for r in steps),
        "canary_failures": summary.get("canary_failures"),  # None when the run left no summary.json
        "reward_by_step": [round(r["reward_mean"], 4) for r in steps],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, default=Path("runs/calculator"), help="The finished run's directory.")
    parser.add_argument("--json", type=Path, help="Also write the JSON here.")
    parser.add_argument("--command", default="make demo-calculator", help="What produced the run (recorded).")
    parser.add_argument("--note", default="", help="What this run was (recorded).")
    args = parser.parse_args()
    emit_json({"command": args.command, "note": args.note, "config": "examples/calculator.yaml", **summarize(args.run)}, args.json)


if __name__ == "__main__":
    main()
