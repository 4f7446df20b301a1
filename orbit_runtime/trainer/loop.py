"""The learner drives the RL loop; the rollout (and reference) roles are HTTP servers.

One step: sample prompts -> vLLM generates a group of completions per prompt (with token
log-probs) -> rewards -> group advantages -> [reference log-probs] -> learner log-probs ->
GRPO loss with mismatch correction -> AdamW on the LoRA adapter -> publish adapter v<N+1>
atomically -> vLLM loads it under a new name -> canary verification. Held-out prompts are
scored greedily at the start, every `eval.every_steps` and at the end.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from orbit_runtime.algorithms.grpo import LossConfig, LossInputs, group_advantages, grpo_loss
from orbit_runtime.algorithms.lr_schedule import lr_multiplier
from orbit_runtime.checkpoint.catalog import CheckpointCatalog
from orbit_runtime.checkpoint.storage import StorageError, open_store
from orbit_runtime.checkpoint.writer import CheckpointWriter, StagedCheckpoint
from orbit_runtime.config.fingerprint import config_hash, training_fields
from orbit_runtime.config.spec import JobSpec
from orbit_runtime.data.datasets import Example, load_splits
from orbit_runtime.data.sampler import PromptSampler
from orbit_runtime.errors import OrbitError
from orbit_runtime.learner.mismatch import measure_mismatch
from orbit_runtime.learner.model import load_policy
from orbit_runtime.observability import metrics
from orbit_runtime.observability.server import MetricsServer
from orbit_runtime.reference.client import ReferenceClient, ReferenceServer, SharedReference
from orbit_runtime.rewards.builtin import exact_match
from orbit_runtime.rewards.scoring import RewardScorer
from orbit_runtime.rollout.client import Completion
from orbit_runtime.rollout.server import VLLMServerConfig
from orbit_runtime.run_paths import RunPaths
from orbit_runtime.sync.adapter_sync import publish_adapter
from orbit_runtime.trainer.checkpointing import (
    ADAPTER,
    TrainingState,
    capture_rng,
    checkpoint_due,
    checkpoint_score,
    plan_resume,
    read_checkpoint_files,
    restore_rng,
    write_checkpoint_files,
)
from orbit_runtime.trainer.report import render_report
from orbit_runtime.trainer.rollout_service import RolloutService

log = logging.getLogger(__name__)
VLLM_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}


class Stopped(Exception):
    """SIGTERM or Ctrl-C: stop after cleaning up."""


@dataclass
class RunState:
    step: int = 0
    adapter_version: int = 0
    started: float = field(default_factory=time.monotonic)
    elapsed_before: float = 0.0  # wall seconds of the run's earlier lives (before a resume)
    rows: list[dict] = field(default_factory=list)  # every metrics.jsonl row (steps, evals, ...), for checkpoints
    reward_errors: int = 0
    last_checkpoint_step: int = 0
    last_checkpoint_time: float = field(default_factory=time.monotonic)
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


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    return pad_sequence([r.float() for r in rows], batch_first=True)


class Trainer:
    """One run of the RL loop. RESUME/RESUME_FROM: see checkpointing.plan_resume."""

    ROLLOUT_PROBE_INTERVAL_S = 5.0

    def __init__(self, spec: JobSpec, console=None, *, resume: bool = False, resume_from: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.spec = spec
        self.console = console
        self.paths = RunPaths(Path(spec.run.output_dir) / spec.run.name).create()
        self.config_fields = training_fields(spec)
        self.config_hash = config_hash(self.config_fields)
        self.catalog = CheckpointCatalog(open_store(spec.checkpoint_uri(), retries=spec.checkpoint.retries))
        try:
            self.resume_plan = plan_resume(
                self.catalog, self.config_hash, self.config_fields,
                resume=resume, resume_from=resume_from, retries=spec.checkpoint.retries,
            )  # fmt: skip
        except StorageError as exc:
            raise OrbitError(f"cannot read checkpoints to decide whether to resume: {exc}") from None
        torch.manual_seed(spec.schedule.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model.path)
        self.splits = load_splits(spec.data)
        self.sampler = PromptSampler(size=len(self.splits.train), seed=spec.schedule.seed)
        self.scorer = RewardScorer(spec.rewards)
        learner_dtype = spec.model.learner_dtype or spec.model.dtype
        self.policy = load_policy(Path(spec.model.path), spec.adapter, dtype=learner_dtype)
        self.optimizer = torch.optim.AdamW(
            self.policy.trainable_parameters(), lr=spec.schedule.learning_rate, weight_decay=spec.schedule.weight_decay
        )
        sched = spec.schedule
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            functools.partial(lr_multiplier, warmup=sched.warmup_steps, total=sched.steps, kind=sched.lr_schedule,
                              min_ratio=sched.min_lr_ratio),
        )  # fmt: skip
        self.loss_config = LossConfig(
            clip_low=spec.algorithm.clip_low,
            clip_high=spec.algorithm.clip_high,
            kl_beta=spec.algorithm.kl_beta,
            aggregation=spec.algorithm.loss_aggregation,
            correction=spec.algorithm.mismatch_correction,
            is_cap=spec.algorithm.is_cap,
            max_tokens=spec.rollout.max_tokens,
        )
        self.state = RunState()
        self.rollout: RolloutService | None = None
        self.reference_server: ReferenceServer | None = None
        self.reference = None
        self._restarts_written = 0  # rollout restarts already reflected in processes.json
        self._stop_signal: int | None = None
        self._interruptible = False  # may a stop signal abort the current work right away?
        self._first_step_report: dict | None = None
        self.metrics_server: MetricsServer | None = None
        self._probe_stop = threading.Event()
        if self.resume_plan.entry is not None:
            self._restore()
        else:
            self.paths.start_fresh()
        self.writer = CheckpointWriter(self.catalog, keep_last=spec.checkpoint.keep_last, keep_best=spec.checkpoint.keep_best)
        self._remove_torn_checkpoints()

    def _remove_torn_checkpoints(self) -> None:
        """Step directories a dead writer left without a manifest are never read; this run owns the prefix, so drop them."""
        try:
            removed = self.catalog.remove_torn()
        except StorageError as exc:
            log.warning("could not remove torn checkpoints (the writer retries later): %s", exc)
            return
        if removed:
            steps = [e.step for e in removed]
            self.record({"kind": "checkpoint_cleanup", "removed_steps": steps})
            self._say(f"removed torn checkpoint(s) of step {', '.join(map(str, steps))} under {self.catalog.uri} (never completed)")

    # ---- checkpoints ---------------------------------------------------------------------
    def _restore(self) -> None:
        """Load the planned checkpoint: adapter, optimizer, scheduler, data cursor, RNG, curves."""
        plan = self.resume_plan
        started = time.monotonic()
        try:
            local = plan.catalog.download_to_temp(plan.entry)
        except StorageError as exc:
            raise OrbitError(f"cannot resume: {exc}") from None
        try:
            saved = read_checkpoint_files(local)
            if saved.sampler.get("size") != len(self.splits.train):
                raise OrbitError(
                    f"{plan.entry.uri}: its data cursor is for {saved.sampler.get('size')} training prompts, "
                    f"this config has {len(self.splits.train)}"
                )
            try:
                self.policy.load_adapter(local / ADAPTER)
            except ValueError as exc:
                raise OrbitError(f"{plan.entry.uri}: {exc}") from None
            self.optimizer.load_state_dict(saved.optimizer)
            self.scheduler.load_state_dict(saved.scheduler)
            self.sampler = PromptSampler.from_state(saved.sampler)
            restore_rng(saved.torch_rng, saved.python_rng)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        state = self.state
        state.step = state.last_checkpoint_step = saved.step
        state.adapter_version = saved.adapter_version
        state.elapsed_before = saved.elapsed_seconds
        state.reward_errors = saved.reward_errors
        state.rows = list(saved.metrics)
        state.resumed_from = plan.entry.uri
        self.paths.start_fresh()
        self.paths.metrics.write_text("".join(json.dumps(r) + "\n" for r in saved.metrics))
        self._first_step_report = {"kind": "resume", "from": plan.entry.uri, "from_step": saved.step,
                                   "restore_seconds": time.monotonic() - started}  # fmt: skip
        self._say(plan.note)

    def _training_state(self) -> TrainingState:
        torch_rng, python_rng = capture_rng()
        state = self.state
        return TrainingState(
            step=state.step, adapter_version=state.adapter_version, sampler=self.sampler.state_dict(),
            elapsed_seconds=state.wall_seconds, reward_errors=state.reward_errors,
            config_hash=self.config_hash, config_fields=self.config_fields,
            optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict(),
            torch_rng=torch_rng, python_rng=python_rng, metrics=list(state.rows),
        )  # fmt: skip

    def checkpoint(self) -> None:
        """Stage the state after the last completed step locally and hand it to the background writer."""
        state, spec = self.state, self.spec
        since = [r for r in state.steps if r["step"] > state.last_checkpoint_step]
        score = checkpoint_score(spec.checkpoint.best_metric, since, state.evals[-1] if state.evals else None)
        staging = self.paths.checkpoint_staging / f"step-{state.step:08d}"
        shutil.rmtree(staging, ignore_errors=True)
        write_checkpoint_files(staging, self.policy, self._training_state())
        meta = {"config_hash": self.config_hash, "config_fields": self.config_fields,
                "adapter_version": state.adapter_version, "score": score, "best_metric": spec.checkpoint.best_metric}  # fmt: skip
        self.writer.submit(StagedCheckpoint(state.step, staging, meta))
        state.last_checkpoint_step, state.last_checkpoint_time = state.step, time.monotonic()

    def _record_checkpoint_events(self) -> None:
        for event in self.writer.events():
            metrics.observe_checkpoint(self.record(event))

    def _finish_checkpoints(self, reason: str) -> None:
        """Checkpoint the last completed step (if not yet) and wait a bounded time for it to land."""
        if self.state.step > self.state.last_checkpoint_step:
            self.checkpoint()
        timeout = self.spec.checkpoint.stop_timeout_s
        if self.writer.pending_step is not None and not self.writer.wait(timeout):
            last = self.writer.stats.last_success_step
            self._say(
                f"[yellow]checkpoint of step {self.writer.pending_step} did not land within {timeout:.0f}s ({reason}); "
                f"newest complete checkpoint: {f'step {last}' if last else 'none from this run'}; "
                f"last error: {self.writer.stats.last_error}"
            )
        self.writer.close()
        self._record_checkpoint_events()

    # ---- prompts -------------------------------------------------------------------------
    def encode_prompt(self, example: Example) -> list[int]:
        if self.spec.rollout.use_chat_template and self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": example.prompt}], add_generation_prompt=True, tokenize=False
            )
        else:
            text = example.prompt
        return self.tokenizer.encode(text, add_special_tokens=False)

    def canary(self) -> list[tuple[list[int], list[int]]]:
        """Fixed sequences both engines score after each sync: held-out prompts + their answers."""
        pairs = []
        for example in self.splits.validation[: self.spec.sync.canary_sequences]:
            answer = f"\\boxed{{{example.answer}}}" if example.answer is not None else "ok"
            completion = self.tokenizer.encode(answer, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            pairs.append((self.encode_prompt(example), completion))
        return pairs

    # ---- roles ---------------------------------------------------------------------------
    def start_roles(self) -> None:
        spec = self.spec
        vllm_config = VLLMServerConfig(
            Path(spec.model.path),
            dtype=VLLM_DTYPE[spec.model.dtype],
            max_lora_rank=spec.adapter.rank,
            max_model_len=spec.rollout.max_model_len,
            kv_cache_gib=spec.rollout.kv_cache_gib,
            seed=spec.schedule.seed,
            log_path=self.paths.logs / "vllm.log",
        )
        self.rollout = RolloutService(
            vllm_config, self.canary(), spec.canary_tolerance(), spec.sync.retries, spec.rollout.max_restarts
        )
        self.rollout.start()
        if self.state.adapter_version > 0:  # resumed: serve the checkpoint's adapter version again
            path, _ = publish_adapter(self.policy, self.paths.adapters, self.state.adapter_version)
            self.rollout.publish(self.policy, self.state.adapter_version, path)
        if spec.reference.mode == "server":
            learner_dtype = spec.model.learner_dtype or spec.model.dtype
            self.reference_server = ReferenceServer(Path(spec.model.path), learner_dtype, self.paths.logs / "reference.log")
            self.reference_server.start()
            self.reference = ReferenceClient(self.reference_server.base_url)
        else:
            self.reference = SharedReference(self.policy)
        metrics.ROLLOUT_UP.set(1)
        threading.Thread(target=self._probe_rollout, name="rollout-probe", daemon=True).start()
        self.write_processes()

    def write_processes(self) -> None:
        self._restarts_written = self.rollout.restarts if self.rollout else 0
        roles = {"learner": {"pid": os.getpid(), **({"metrics_url": self.metrics_server.url} if self.metrics_server else {})}}
        if self.rollout and self.rollout.server:
            roles["rollout"] = {
                "pid": self.rollout.server.pid,
                "url": self.rollout.server.base_url,
                "restarts": self.rollout.restarts,
            }
        if self.reference_server:
            roles["reference"] = {"pid": self.reference_server.pid, "url": self.reference_server.base_url}
        self.paths.processes.write_text(json.dumps(roles, indent=2))

    def stop_roles(self) -> None:
        self._probe_stop.set()
        if self.rollout:
            self.rollout.stop()
        if isinstance(self.reference, ReferenceClient):
            self.reference.close()
        if self.reference_server:
            self.reference_server.stop()

    # ---- evaluation ----------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Greedy completions of the held-out prompts through vLLM, scored by the same rewards."""
        examples = self.splits.validation
        prompts = [self.encode_prompt(e) for e in examples]
        max_tokens = self.spec.eval.max_tokens or self.spec.rollout.max_tokens
        model = self.rollout.served_name
        groups = self.rollout.call(
            lambda c: c.generate(prompts, model=model, n=1, max_tokens=max_tokens, temperature=0.0), kind="eval"
        )
        texts = [self.tokenizer.decode(g[0].token_ids, skip_special_tokens=True) for g in groups]
        rewards = self.scorer.score(texts, [e.prompt for e in examples], [e.answer for e in examples])
        match_kwargs = next((r.kwargs for r in self.spec.rewards if r.function == "exact_match"), {})
        correct = [v or 0.0 for v in exact_match(texts, answers=[e.answer for e in examples], **match_kwargs)]
        result = {
            "kind": "eval",
            "step": self.state.step,
            "accuracy": sum(correct) / len(correct),
            "reward_mean": sum(rewards.total) / len(rewards.total),
            "examples": len(examples),
            "sample": texts[0][:80],
        }
        self.record(result)
        metrics.observe_eval(result)
        return result

    # ---- one RL step ---------------------------------------------------------------------
    def step(self) -> dict:
        """One RL step; returns its metrics row."""
        timings: dict[str, float] = {}
        started = time.monotonic()
        # Until the optimizer touches the adapter, a stop signal may abort this step: it then
        # rolls the data cursor and RNG back, so the step is redone exactly after a resume.
        sampler_before, rng_before = self.sampler.state_dict(), capture_rng()
        try:
            result = self._step_interruptible(timings)
        except Stopped:
            self.sampler = PromptSampler.from_state(sampler_before)
            restore_rng(*rng_before)
            raise
        return self._step_commit(result, timings, started)

    def _step_interruptible(self, timings: dict[str, float]) -> dict:
        """Generate, score and compute the gradient; nothing of the run's state is changed yet."""
        spec, state = self.spec, self.state
        group = spec.rollout.group_size
        self._interruptible = True
        indices = self.sampler.next_batch(spec.rollout.prompts_per_step)
        examples = [self.splits.train[i] for i in indices]
        prompts = [self.encode_prompt(e) for e in examples]

        t = time.monotonic()
        model = self.rollout.served_name
        seed = spec.schedule.seed * 1_000_003 + state.step  # reproducible sampling, also after a resume
        groups = self.rollout.call(
            lambda c: c.generate(
                prompts,
                model=model,
                n=group,
                max_tokens=spec.rollout.max_tokens,
                temperature=spec.rollout.temperature,
                top_p=spec.rollout.top_p,
                seed=seed,
            ),  # fmt: skip
            kind="generate",
        )
        completions: list[Completion] = [c for g in groups for c in g]
        timings["generate_s"] = time.monotonic() - t

        t = time.monotonic()
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]
        per_sample = [e for e in examples for _ in range(group)]
        rewards = self.scorer.score(texts, [e.prompt for e in per_sample], [e.answer for e in per_sample])
        reward_tensor = torch.tensor(rewards.total)
        advantages = group_advantages(reward_tensor, group, spec.algorithm.normalize_advantage_std)
        timings["reward_s"] = time.monotonic() - t

        pairs = [(c.prompt_ids, c.token_ids) for c in completions]
        rollout_lp = [torch.tensor(c.logprobs) for c in completions]
        mask = _pad([torch.ones(len(c.token_ids)) for c in completions])
        t = time.monotonic()
        ref_lp = _pad(self.reference.logprobs(pairs)) if spec.algorithm.kl_beta > 0 else None
        timings["reference_s"] = time.monotonic() - t

        t = time.monotonic()
        rollout_padded = _pad(rollout_lp)
        old_lp = None  # the learner's log-probs before this update: the first pass's, detached
        for epoch in range(spec.algorithm.epochs_per_batch):
            new_lp_list = self.policy.completion_logprobs(pairs)
            new_lp = _pad(new_lp_list)
            if old_lp is None:
                old_lp = new_lp.detach()
                mismatch = measure_mismatch([x.detach().float() for x in new_lp_list], rollout_lp)
            out = grpo_loss(LossInputs(new_lp, old_lp, rollout_padded, advantages, mask, ref_lp), self.loss_config)
            self.optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(), spec.schedule.max_grad_norm))
            if epoch == 0:
                self._interruptible = False  # from here on the step completes (see _on_stop_signal)
            self.optimizer.step()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        timings["train_s"] = time.monotonic() - t
        return {"indices": indices, "completions": completions, "rewards": rewards, "out": out,
                "grad_norm": grad_norm, "lr": lr, "mismatch": mismatch}  # fmt: skip

    def _step_commit(self, result: dict, timings: dict[str, float], started: float) -> dict:
        """Publish the updated adapter and record the step (runs to the end even if a stop signal came)."""
        state = self.state
        completions, rewards, out, mismatch = result["completions"], result["rewards"], result["out"], result["mismatch"]
        state.reward_errors += sum(rewards.errors.values())
        t = time.monotonic()
        state.adapter_version += 1
        path, size = publish_adapter(self.policy, self.paths.adapters, state.adapter_version)
        metrics.LEARNER_ADAPTER_VERSION.set(state.adapter_version)
        sync = self.rollout.publish(self.policy, state.adapter_version, path)
        metrics.SYNC_ROLLOUT_VERSION.set(state.adapter_version)
        timings["sync_s"] = time.monotonic() - t
        self._prune_adapters(keep=2)
        state.step += 1

        step_s = time.monotonic() - started
        tokens = sum(len(c.token_ids) for c in completions)
        n = len(rewards.total)
        mean = sum(rewards.total) / n
        record = {
            "kind": "step",
            "step": state.step,
            "reward_mean": mean,
            "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards.total) / n),
            "reward_errors": sum(rewards.errors.values()),
            "loss": float(out.loss.detach()),
            "policy_loss": out.policy_loss,
            "kl": out.kl,
            "clip_fraction": out.clip_fraction,
            "is_weight_mean": out.is_weight_mean,
            "grad_norm": result["grad_norm"],
            "learning_rate": result["lr"],
            "mismatch_mean_abs": mismatch.mean_abs_dlogp,
            "mismatch_max_abs": mismatch.max_abs_dlogp,
            "mismatch_k3_kl": mismatch.k3_kl,
            "samples": n,
            "tokens": tokens,
            "prompt_indices": result["indices"],
            "tokens_per_second": tokens / step_s,
            "adapter_version": state.adapter_version,
            "adapter_bytes": size,
            "sync_seconds": sync.seconds,
            "sync_attempts": sync.attempts,
            "canary_mean_abs_dlogp": sync.canary_mean_abs_dlogp,
            "rollout_restarts": self.rollout.restarts,
            "step_seconds": step_s,
            **{k: round(v, 4) for k, v in timings.items()},
        }
        metrics.observe_step(self.record(record), rewards.total)
        if self.rollout.restarts != self._restarts_written:
            self.write_processes()
        return record

    def _prune_adapters(self, keep: int) -> None:
        """Keep the last KEEP versions on disk (the served one and its successor)."""
        for old in range(1, self.state.adapter_version - keep + 1):
            shutil.rmtree(self.paths.adapters / f"v{old}", ignore_errors=True)

    def record(self, row: dict) -> dict:
        """Append ROW (time-stamped) to metrics.jsonl and to the rows a checkpoint carries; returns it."""
        row = {"time": time.time(), **row}
        self.state.rows.append(row)
        with open(self.paths.metrics, "a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    # ---- the run -------------------------------------------------------------------------
    def run(self, max_steps: int | None = None) -> dict:
        """Train for schedule.steps (or MAX_STEPS); returns the summary also written to summary.json.

        SIGTERM (the pod is being stopped) and Ctrl-C stop the run the same way: the current
        step is abandoned if the optimizer has not touched the adapter yet (and redone after a
        resume), else finished; then the state is checkpointed, waiting at most
        checkpoint.stop_timeout_s, and KeyboardInterrupt is raised (exit 130 / 143).
        """
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        total = max_steps or self.spec.schedule.steps
        previous = {sig: signal.signal(sig, self._on_stop_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        interrupted = False
        self._start_metrics()
        try:
            if self.state.step >= total:
                self._say(f"the checkpoint is at step {self.state.step}, max steps is {total}: nothing to train")
                return self.write_summary(interrupted=False)
            self._interruptible = True
            self.start_roles()
            if not self.state.evals:
                before = self.evaluate()
                self._say(f"held-out accuracy before RL: {before['accuracy']:.1%} ({before['examples']} prompts, greedy)")
            columns = [TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                       TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]  # fmt: skip
            with Progress(*columns, console=self.console, transient=False) as progress:
                task = progress.add_task("train", total=total, completed=self.state.step, info="")
                while self.state.step < total:
                    row = self.step()
                    self._after_step(total)
                    acc = self.state.evals[-1]["accuracy"]
                    progress.update(task, completed=self.state.step, info=(
                        f"reward {row['reward_mean']:.2f} | held-out {acc:.0%} | mismatch {row['mismatch_mean_abs']:.1e} "
                        f"| {row['tokens_per_second']:.0f} tok/s"))  # fmt: skip
            after = self.evaluate()
            self._say(f"held-out accuracy after RL:  {after['accuracy']:.1%} (step {self.state.step})")
        except Stopped:
            interrupted = True
            self._say(f"stopped at step {self.state.step} ({signal.Signals(self._stop_signal).name}); servers shut down")
        finally:
            self._interruptible = False
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.stop_roles()
            self._finish_checkpoints("stopping" if interrupted else "end of run")
        summary = self.write_summary(interrupted)
        metrics.LEARNER_UP.set(0)
        if self.metrics_server:
            self.metrics_server.stop()
        if interrupted:
            raise KeyboardInterrupt(self._stop_signal)
        return summary

    # ---- metrics -------------------------------------------------------------------------
    def _start_metrics(self) -> None:
        """Serve /metrics and /healthz (if metrics.port is set) and start the progress clocks."""
        metrics.register_resources("learner")
        metrics.observe_start(time.time(), self.state.adapter_version)
        if self.spec.metrics.port is None:
            return
        self.metrics_server = MetricsServer(metrics.LEARNER_REGISTRY, self.spec.metrics.host, self.spec.metrics.port).start()
        self._say(f"metrics: {self.metrics_server.url}/metrics (health: /healthz)")

    def _probe_rollout(self) -> None:
        """Background: keep orbit_rollout_up current between steps (a step may take minutes)."""
        while not self._probe_stop.wait(self.ROLLOUT_PROBE_INTERVAL_S):
            metrics.ROLLOUT_UP.set(1 if self.rollout.healthy() else 0)

    def _after_step(self, total: int) -> None:
        """Between two steps: resume report, checkpoint, evaluation; then honour a pending stop."""
        state, spec = self.state, self.spec
        if self._first_step_report is not None:
            import psutil

            report = {**self._first_step_report, "step": state.step,
                      "seconds_to_first_step": time.time() - psutil.Process().create_time()}  # fmt: skip
            self._first_step_report = None
            self.record(report)
            self._say(f"resumed at step {report['from_step']}: first step done {report['seconds_to_first_step']:.1f}s after start "
                      f"(restoring the checkpoint took {report['restore_seconds']:.1f}s)")  # fmt: skip
        self._record_checkpoint_events()
        every = spec.checkpoint
        if state.step < total and checkpoint_due(
            state.step,
            state.last_checkpoint_step,
            state.last_checkpoint_time,
            time.monotonic(),
            every.every_steps,
            every.every_minutes,
        ):
            self.checkpoint()
        if self._stop_signal is not None:
            raise Stopped(f"signal {self._stop_signal}")
        self._interruptible = True
        if state.step % spec.eval.every_steps == 0 and state.step < total:
            self.evaluate()

    def _on_stop_signal(self, signum, frame) -> None:
        """SIGTERM/SIGINT: abort now if nothing would be lost, else stop after the step commits."""
        if self._stop_signal is not None and signum == signal.SIGINT:
            raise Stopped(f"signal {signum}")  # a second Ctrl-C: the user is not waiting any longer
        self._stop_signal = signum
        if self._interruptible:
            self._interruptible = False
            raise Stopped(f"signal {signum}")

    def write_summary(self, interrupted: bool) -> dict:
        evals = self.state.evals
        stats = self.writer.stats
        summary = {
            "heldout_accuracy_before": evals[0]["accuracy"] if evals else None,
            "heldout_accuracy_after": evals[-1]["accuracy"] if len(evals) > 1 else None,
            "steps": self.state.step,
            "wall_seconds": round(self.state.wall_seconds, 1),
            "adapter_version": self.state.adapter_version,
            "rollout_restarts": self.rollout.restarts if self.rollout else 0,
            "canary_failures": self.rollout.canary_failures if self.rollout else 0,
            "reward_errors": self.state.reward_errors,
            "interrupted": interrupted,
            "resumed_from": self.state.resumed_from,
            "checkpoint_uri": self.catalog.uri,
            "last_checkpoint_step": stats.last_success_step,
            "checkpoint_failures": stats.failures,
        }
        self.paths.summary.write_text(json.dumps(summary, indent=2) + "\n")
        self.paths.report.write_text(render_report(self.spec.run.name, self.state.steps, evals, summary))
        return summary

    def _say(self, text: str) -> None:
        """A line for the user: on the console when there is one, else in the log."""
        if self.console is not None:
            self.console.print(text)
        else:
            log.info(text)
