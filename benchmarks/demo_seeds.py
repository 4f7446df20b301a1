"""`make demo`'s job over several RL seeds: held-out accuracy before and after, with standard errors.

Builds the demo base once as `make demo` does (`orbit demo-model --warmup-steps 400`, then
`orbit quantize`), then runs `orbit train examples/quickstart.yaml` with `schedule.seed`
set to each --seeds value (the seed draws the rollout samples and the adapter's init), each
run in a fresh process and its own run directory. Prints and writes JSON: per seed the
held-out accuracy before and after RL with its standard error over the 30 held-out
prompts, and the mean over seeds with its spread.

    python benchmarks/demo_seeds.py --json benchmarks/results/demo_seeds.json
    python benchmarks/demo_seeds.py --set schedule.learning_rate=4e-3 --seeds 0   # a variant

`--set KEY=VALUE` (YAML value, dotted key) changes the quickstart's job for every seed;
each run also records its held-out curve (accuracy at every evaluation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from benchmark_output import emit_json
from quickstart_base import build_quickstart_base

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of examples/quickstart.yaml, e.g. schedule.steps=80")
    args = parser.parse_args()
    overrides = dict(_parse_override(item) for item in args.overrides)
    orbit = [sys.executable, "-m", "orbit_runtime.cli"]
    runs = []
    with tempfile.TemporaryDirectory(prefix="orbit-demo-seeds-") as tmp:
        work = Path(tmp)
        build_quickstart_base(work, quiet=True)
        job = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
        for key, value in overrides.items():
            _set_field(job, key, value)
        for seed in args.seeds:
            job["model"]["path"] = str(work / "base-int4")
            job["schedule"]["seed"] = seed
            job["run"] = {"name": f"seed-{seed}", "output_dir": str(work / "runs")}
            config = work / f"seed-{seed}.yaml"
            config.write_text(yaml.safe_dump(job))
            done = subprocess.run([*orbit, "train", str(config)], capture_output=True, text=True)
            if done.returncode != 0:
                runs.append({"seed": seed, "error": done.stdout[-2000:] + done.stderr[-2000:]})
                continue
            run_dir = work / "runs" / f"seed-{seed}"
            summary = json.loads((run_dir / "summary.json").read_text())
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
            curve = {r["step"]: round(r["accuracy"], 4) for r in rows if r.get("kind") == "eval"}
            runs.append({"seed": seed, **{k: summary[k] for k in (
                "heldout_accuracy_before", "heldout_accuracy_before_stderr", "heldout_accuracy_after",
                "heldout_accuracy_after_stderr", "heldout_prompts", "steps", "wall_seconds", "canary_noise_floor",
                "canary_inconclusive_syncs", "canary_failures")}, "heldout_curve": curve})  # fmt: skip
    after = [r["heldout_accuracy_after"] for r in runs if "heldout_accuracy_after" in r]
    result = {"config": "examples/quickstart.yaml", "overrides": overrides, "seeds": args.seeds, "runs": runs}
    if after:
        result["heldout_accuracy_after_mean"] = statistics.mean(after)
        result["heldout_accuracy_after_min"], result["heldout_accuracy_after_max"] = min(after), max(after)
        result["heldout_accuracy_after_std_over_seeds"] = statistics.stdev(after) if len(after) > 1 else 0.0
    emit_json(result, args.json)


def _parse_override(item: str) -> tuple[str, object]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. schedule.steps=80")
    return key, yaml.safe_load(value)


def _set_field(job: dict, dotted: str, value: object) -> None:
    *parents, leaf = dotted.split(".")
    node = job
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


if __name__ == "__main__":
    main()
