"""RL stability, scheme A vs scheme B: does sharing the low-precision base make RL more stable?

The quickstart's job (examples/quickstart.yaml: GRPO on "What is N*10?", the demo model warmed
up and quantized as `make demo` builds it), same steps and settings, under
  A  Orbit: the learner computes on the same INT4 base + adapter that vLLM serves
  B  the traditional setup: the learner trains the adapter on the ORIGINAL 16-bit weights
     (the warmed-up checkpoint before quantization) while vLLM samples from the INT4 copy
each with TIS (algorithm.mismatch_correction: tis, the quickstart's) and without (none),
for each --seeds value (schedule.seed: the adapter's init, prompt order, sampling).

Orbit does not ship scheme B; this benchmark builds it by giving the trainer a learner loaded
from the 16-bit checkpoint (`load_dense_policy`, as benchmarks/mismatch.py's "traditional").
The canary still runs in both schemes, so both pay the same sync cost, but in B it verifies the
served adapter against an INT4 copy of the learner (the INT4 base vLLM serves, carrying the
16-bit learner's current adapter): checked against the 16-bit learner itself, the INT4 error
(about 0.02 mean |dlogp|) is as large as one step's change of the adapter, and the stale-adapter
check failed a run at step 12 (closer to v11's log-probs than to v12's) while vLLM served v12.
`reference.report_kl` makes both report the KL to the reference (the base with the adapter off:
INT4 in A, 16-bit in B) at kl_beta 0.

Per run: held-out accuracy at every evaluation (mean over the quickstart's 30 held-out prompts,
with its standard error), and per step the reward, KL to the reference, train-rollout mismatch
(mean and max |dlogp|, k3 KL), the mean TIS weight and the gradient norm. Runs are resumable:
each run's JSON is written to --out as it finishes and a rerun skips finished runs (a run cut
off midway starts over). Every run records the digest of the INT4 base it trained from: the
warm-up that builds the base is not bit-reproducible across CPU kinds (nor, at times, runs), so
a finished run counts only on the base the study now uses (--work), and the summary compares
the runs of that one base (runs on another base are listed by name, not averaged in). The
summary gives, per scheme x correction, the mean and spread over seeds of the curves and the
count of gradient-norm spikes (steps whose grad norm exceeds SPIKE_FACTOR x the run's median).
Never run it beside the test suite (2 cores).

    python benchmarks/stability.py --out benchmarks/results/stability --json benchmarks/results/stability.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from benchmark_output import emit_json
from quickstart_base import build_quickstart_base

from orbit_runtime.int4.base_digest import read_base_digest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SCHEMES = {"A": "learner on the INT4 base vLLM serves (Orbit)", "B": "learner on the original 16-bit weights, vLLM on INT4"}
CORRECTIONS = ("tis", "none")
SPIKE_FACTOR = 3.0
STEP_FIELDS = ("reward_mean", "reward_std", "kl", "mismatch_mean_abs", "mismatch_max_abs", "mismatch_k3_kl",
               "is_weight_mean", "is_over_cap_fraction", "grad_norm", "clip_fraction", "step_seconds")  # fmt: skip


def run_name(scheme: str, correction: str, seed: int) -> str:
    return f"{scheme.lower()}-{correction}-seed{seed}"  # run names are DNS labels: lower case


def job(int4: Path, correction: str, seed: int, runs: Path, name: str, steps: int | None = None) -> dict:
    """The quickstart's job with the run's correction and seed, and the KL reported (STEPS: a shorter smoke run)."""
    spec = yaml.safe_load(QUICKSTART.read_text())
    if steps is not None:
        spec["schedule"]["steps"] = steps
    spec["model"]["path"] = str(int4)
    spec["algorithm"]["mismatch_correction"] = correction
    spec["schedule"]["seed"] = seed
    spec["reference"] = {**spec.get("reference", {}), "report_kl": True}
    spec["checkpoint"] = {**spec.get("checkpoint", {}), "uri": f"file://{runs / name / 'checkpoints'}"}
    spec["run"] = {**spec.get("run", {}), "name": name, "output_dir": str(runs)}
    return spec


def worker(scheme: str, correction: str, seed: int, work: Path, steps: int | None) -> None:
    """One run, in this (fresh) process; its metrics land in WORK/runs/<name>/metrics.jsonl."""
    from orbit_runtime.config import parse_job_spec
    from orbit_runtime.learner.model import load_dense_policy, load_policy
    from orbit_runtime.trainer.loop import Trainer

    dense, int4 = work / "base", work / "base-int4"
    name = run_name(scheme, correction, seed)
    spec = parse_job_spec(job(int4, correction, seed, work / "runs", name, steps), f"stability run {name}")

    class SixteenBitLearner(Trainer):
        """Scheme B: the adapter is trained on the 16-bit checkpoint, not on the INT4 base vLLM serves;
        the canary verifies against `verifier`, an INT4 copy carrying the learner's adapter."""

        def _load_policy(self):
            policy = load_dense_policy(dense, self.spec.adapter, dtype=self.learner_dtype, lora_rounding=self.spec.learner.lora_rounding)
            policy.model.to(self.device)  # where scheme A's learner runs
            self.verifier = load_policy(int4, self.spec.adapter, dtype=self.learner_dtype, device=str(self.device),
                                        lora_rounding=self.spec.learner.lora_rounding)  # fmt: skip
            return policy

        def start_roles(self) -> None:
            rollout, verifier = self.rollout, self.verifier
            publish, calibrate = rollout.publish, rollout.calibrate

            def synced(policy):
                verifier.load_adapter_state(policy.adapter_state())  # the adapter the rollout is about to serve
                return verifier

            rollout.publish = lambda policy, version, path: publish(synced(policy), version, path)
            rollout.calibrate = lambda policy, dtype: calibrate(synced(policy), dtype)
            super().start_roles()

    trainer = (SixteenBitLearner if scheme == "B" else Trainer)(spec)
    trainer.run()


def read_run(run_dir: Path, scheme: str, correction: str, seed: int, wall_s: float, base_digest: str) -> dict:
    """The run's curves from its metrics.jsonl (BASE_DIGEST: the INT4 base it trained from)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    evals = [r for r in rows if r["kind"] == "eval"]
    grad = [r["grad_norm"] for r in steps]
    median = statistics.median(grad)
    return {
        "scheme": scheme, "correction": correction, "seed": seed, "wall_seconds": round(wall_s, 1),
        "base_digest": base_digest, "machine": machine(),
        "heldout": [{"step": r["step"], "accuracy": r["accuracy"], "stderr": r["accuracy_stderr"]} for r in evals],
        "heldout_prompts": evals[-1]["examples"] if evals else 0,
        "steps": [{"step": r["step"], **{k: r.get(k) for k in STEP_FIELDS}} for r in steps],
        "grad_norm_median": median,
        "grad_norm_max": max(grad),
        "grad_norm_spikes": sum(g > SPIKE_FACTOR * median for g in grad),
        "canary_noise_floor": json.loads((run_dir / "summary.json").read_text()).get("canary_noise_floor"),
    }  # fmt: skip


def machine() -> dict:
    """The CPU the run measured on (the speed of a run, and the base's warm-up, depend on it)."""
    from benchmark_output import environment

    env = environment()
    return {key: env.get(key) for key in ("commit", "cpu", "cpu_flags", "cpu_cores")}


def spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "min": None, "max": None, "stdev": None}
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}  # fmt: skip


def summarize(runs: list[dict]) -> dict:
    """Per scheme x correction: the mean and spread over seeds of each curve, per step."""
    out: dict = {}
    for scheme in SCHEMES:
        for correction in CORRECTIONS:
            group = [r for r in runs if r["scheme"] == scheme and r["correction"] == correction]
            if not group:
                continue
            eval_steps = sorted({e["step"] for r in group for e in r["heldout"]})
            heldout = {s: [e["accuracy"] for r in group for e in r["heldout"] if e["step"] == s] for s in eval_steps}
            last = max(eval_steps)
            per_step = {}
            for field in ("reward_mean", "kl", "mismatch_mean_abs", "mismatch_max_abs", "is_weight_mean", "is_over_cap_fraction", "grad_norm"):
                per_step[field] = [spread([row[field] for r in group for row in r["steps"] if row["step"] == s])
                                   for s in sorted({row["step"] for r in group for row in r["steps"]})]  # fmt: skip
            out[f"{scheme}-{correction}"] = {
                "scheme": SCHEMES[scheme], "correction": correction, "seeds": [r["seed"] for r in group],
                "heldout_by_step": {str(s): spread(v) for s, v in heldout.items()},
                "heldout_final": spread(heldout[last]),
                "reward_last10": spread([statistics.fmean(row["reward_mean"] for row in r["steps"][-10:]) for r in group]),
                "kl_final": spread([r["steps"][-1]["kl"] for r in group]),
                "mismatch_mean_abs": spread([statistics.fmean(row["mismatch_mean_abs"] for row in r["steps"]) for r in group]),
                "mismatch_max_abs_max": max(row["mismatch_max_abs"] for r in group for row in r["steps"]),
                "grad_norm_spikes": [r["grad_norm_spikes"] for r in group],
                "grad_norm_max": max(r["grad_norm_max"] for r in group),
                "per_step": per_step,
            }  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "stability", help="one JSON per finished run"
    )
    parser.add_argument("--json", type=Path, help="the summary over the runs found in --out")
    parser.add_argument("--work", type=Path, default=ROOT / "bench-out" / "stability", help="base models and run directories")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    parser.add_argument("--steps", type=int, help="RL steps per run (default: the quickstart's; fewer only to smoke-test)")
    parser.add_argument("--summary-only", action="store_true", help="summarize the runs in --out, run nothing")
    parser.add_argument("--worker", nargs=3, metavar=("SCHEME", "CORRECTION", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        scheme, correction, seed = args.worker
        worker(scheme, correction, int(seed), args.work, args.steps)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    _, int4 = build_quickstart_base(args.work)
    digest = read_base_digest(int4)
    if not args.summary_only:
        for seed in args.seeds:  # seed-major: a partial study still compares every scheme on the same seeds
            for scheme in args.schemes:
                for correction in args.corrections:
                    name = run_name(scheme, correction, seed)
                    # a shorter smoke run never stands in for a study run: its own file name
                    result = args.out / (f"{name}-steps{args.steps}.json" if args.steps else f"{name}.json")
                    if result.exists() and json.loads(result.read_text()).get("base_digest") == digest:
                        continue  # finished on this base (a run on another base is run again, its file replaced)
                    shutil.rmtree(args.work / "runs" / name, ignore_errors=True)  # a run cut off midway starts over
                    started = time.monotonic()
                    command = [sys.executable, __file__, "--work", str(args.work), "--worker", scheme, correction, str(seed)]
                    command += ["--steps", str(args.steps)] if args.steps else []
                    proc = subprocess.run(command, capture_output=True, text=True)
                    if proc.returncode != 0:
                        raise SystemExit(f"run {name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
                    row = read_run(args.work / "runs" / name, scheme, correction, seed, time.monotonic() - started, digest)
                    result.write_text(json.dumps(row, indent=1) + "\n")
                    print(f"{name}: held-out {row['heldout'][0]['accuracy']:.2f} -> {row['heldout'][-1]['accuracy']:.2f} "
                          f"in {row['wall_seconds']:.0f}s", flush=True)  # fmt: skip
    found = {p.stem: json.loads(p.read_text()) for p in sorted(args.out.glob("*-seed[0-9].json")) + sorted(args.out.glob("*-seed[0-9][0-9].json"))}
    runs = [run for run in found.values() if run.get("base_digest") == digest]
    emit_json({"config": "examples/quickstart.yaml", "base_digest": digest, "runs_found": len(runs),
               "runs_on_other_bases": sorted(name for name, run in found.items() if run.get("base_digest") != digest),
               "spike_factor": SPIKE_FACTOR, "groups": summarize(runs)}, args.json)  # fmt: skip


if __name__ == "__main__":
    main()
