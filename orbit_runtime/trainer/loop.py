"""The learner drives the RL loop; the rollout (and reference) roles are HTTP servers.

One step: sample prompts -> vLLM generates a group of completions per prompt (with token
log-probs) -> rewards -> group advantages -> [reference log-probs] -> policy update (GRPO
loss with mismatch correction, AdamW on the LoRA adapter) -> commit: publish adapter
v<N+1> atomically, vLLM loads it under a new name, canary verification, record the step.
If the commit fails, the update is rolled back (see rollback): the run's state is always one
step's. Held-out prompts are scored greedily at the start, every `eval.every_steps` and at
the end.

The parts, each in its own module: batch (generate + score), learner.update (the
update), roles (supervised rollout and reference servers), evaluation, checkpoint_manager and
resume_and_shutdown,
stopping (signals), rollback, recorder (metrics rows, samples, summary, report).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from pathlib import Path

import torch

from orbit_runtime.algorithms.grpo import LossConfig
from orbit_runtime.algorithms.lr_schedule import lr_multiplier
from orbit_runtime.api_key import api_key, new_api_key
from orbit_runtime.config.adapter import check_served_targets, model_type
from orbit_runtime.config.fingerprint import config_hash, training_fields
from orbit_runtime.config.spec import JobSpec
from orbit_runtime.data.datasets import load_splits
from orbit_runtime.data.sampler import PromptSampler
from orbit_runtime.errors import OrbitError
from orbit_runtime.int4.base_digest import read_base_digest
from orbit_runtime.learner.allocator import pin_mmap_threshold
from orbit_runtime.learner.device import resolve_device
from orbit_runtime.learner.micro_batches import MicroBatchLimits
from orbit_runtime.learner.model import Policy, load_policy, parse_dtype
from orbit_runtime.learner.update import UpdateResult, policy_update
from orbit_runtime.observability import metrics
from orbit_runtime.observability.peak_memory import PeakMemory
from orbit_runtime.observability.process_age import process_age_seconds
from orbit_runtime.observability.process_memory import servers_pss
from orbit_runtime.observability.sandbox_metrics import take_step_counts
from orbit_runtime.observability.server import MetricsServer
from orbit_runtime.rewards.scoring import RewardScorer
from orbit_runtime.run_paths import RunPaths
from orbit_runtime.sync.adapter_sync import prune_adapters, publish_adapter
from orbit_runtime.sync.memory_adapter import InMemoryAdapter
from orbit_runtime.tracking.fanout import check_installed
from orbit_runtime.trainer.batch import BatchBuilder, RolloutBatch, canary_pairs
from orbit_runtime.trainer.checkpoint_manager import CheckpointManager
from orbit_runtime.trainer.colocated import ColocatedBase, load_colocated
from orbit_runtime.trainer.episodes import episode_runner
from orbit_runtime.trainer.evaluation import Evaluator, describe_eval
from orbit_runtime.trainer.on_policy import OffPolicy, OnPolicyGuard
from orbit_runtime.trainer.recorder import RunRecorder, RunState, sample_rows, signal_health, status_document, step_row
from orbit_runtime.trainer.resume_and_shutdown import CheckpointsAndShutdown
from orbit_runtime.trainer.role_lifecycle import RoleLifecycle
from orbit_runtime.trainer.roles import DecodeCanary, ExternalRoles, ReferenceRole, RolloutRole, rollout_server_config
from orbit_runtime.trainer.rollback import StepSnapshot
from orbit_runtime.trainer.stopping import StopController, Stopped

log = logging.getLogger(__name__)


def loss_config(spec: JobSpec) -> LossConfig:
    algo = spec.algorithm
    return LossConfig(
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        kl_beta=algo.kl_beta,
        aggregation=algo.loss_aggregation,
        correction=algo.mismatch_correction,
        is_cap=algo.is_cap,
        mismatch_level=algo.mismatch_level,
        dual_clip=algo.dual_clip,
        kl_clamp=algo.kl_clamp,
        max_tokens=spec.environment.max_tokens if spec.environment else spec.rollout.max_tokens,  # Dr.GRPO's constant
    )


class Trainer(RoleLifecycle, CheckpointsAndShutdown):
    """One run of the RL loop. RESUME/RESUME_FROM: see checkpointing.plan_resume. Its checkpoints and
    the end of a run are trainer/resume_and_shutdown.py's; starting and stopping its roles
    trainer/role_lifecycle.py's."""

    def __init__(self, spec: JobSpec, console=None, *, resume: bool = False, resume_from: str | None = None,
                 external: ExternalRoles | None = None) -> None:  # fmt: skip
        from transformers import AutoTokenizer

        # where a (re)start's seconds go, reported with the first step after a resume (benchmarks/recovery.py)
        self.startup_seconds = {"process_start_to_init": process_age_seconds()}
        self.spec, self.console = spec, console
        if spec.learner.pin_malloc_threshold:
            pin_mmap_threshold()  # before the base loads: freed step temporaries go back to the OS
        check_installed(spec.run.report_to)  # a tracker's missing extra stops the run here, not hours in
        external = external or ExternalRoles()
        self.paths = RunPaths(Path(spec.run.output_dir) / spec.run.name, external.adapters_dir).create()
        self.base_digest = read_base_digest(Path(spec.model.path))  # OrbitError if the base changed after quantize
        self.config_fields = training_fields(spec, base_digest=self.base_digest)
        self.config_hash = config_hash(self.config_fields)
        self.checkpoints = CheckpointManager(spec, self.paths.checkpoint_staging, self.config_hash, self.config_fields,
                                             resume=resume, resume_from=resume_from)  # fmt: skip
        torch.manual_seed(spec.schedule.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model.path)
        self.episodes = episode_runner(spec, self.tokenizer)  # multi-turn jobs; None: single-turn
        self.splits = load_splits(spec.data, self.episodes.environment if self.episodes else None)
        self.sampler = PromptSampler(size=len(self.splits.train), seed=spec.schedule.seed)
        self.learner_dtype = spec.model.learner_dtype or spec.model.dtype
        self.device = resolve_device(spec.learner.device)
        self.limits = MicroBatchLimits(spec.learner.micro_batch_tokens, spec.learner.micro_batch_size)
        decode = (
            DecodeCanary(spec.sync.decode_tokens, spec.rollout.temperature, spec.schedule.seed)
            if spec.sync.decode_tokens
            else None
        )
        # the run's API key: the pod's (ORBIT_API_KEY, from the job's Secret), or a new one for the child servers
        self.api_key = api_key() or new_api_key()
        server_config = rollout_server_config(spec, self.paths.logs / "vllm.log", self.device)
        server_config.api_key = self.api_key
        self.rollout = RolloutRole(server_config, canary_pairs(spec, self.tokenizer, self.splits.validation),
                                   spec.sync.tolerance, spec.sync.retries, spec.rollout.max_restarts,
                                   external.rollout_url, external.wait_s, decode)  # fmt: skip
        self.shared_base: ColocatedBase | None = None
        loading = time.monotonic()
        self.policy = self._load_policy()
        self.startup_seconds["base_load"] = time.monotonic() - loading
        self.policy.set_gradient_checkpointing(spec.learner.gradient_checkpointing)
        self.peak_memory = PeakMemory(self.device)
        self.optimizer = torch.optim.AdamW(
            self.policy.trainable_parameters(), lr=spec.schedule.learning_rate, weight_decay=spec.schedule.weight_decay
        )
        sched = spec.schedule
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            functools.partial(lr_multiplier, warmup=sched.warmup_steps, total=sched.steps, kind=sched.lr_schedule,
                              min_ratio=sched.min_lr_ratio),
        )  # fmt: skip
        self.loss_config = loss_config(spec)
        self.state = RunState()
        self.recorder = RunRecorder(self.paths, self.state, spec.run.name, spec)
        self.stop = StopController()
        self.on_policy = OnPolicyGuard.from_spec(spec.algorithm.max_mismatch, spec.algorithm.max_mismatch_steps)
        self.stop_reason: str | None = None
        self.off_policy: OffPolicy | None = None
        self.reference = ReferenceRole(spec.reference.mode, self.policy, Path(spec.model.path), self.learner_dtype,
                                       self.paths.logs / "reference.log", spec.reference.max_restarts, self.limits,
                                       external.reference_url, external.wait_s, api_key=self.api_key)  # fmt: skip
        self.builder = BatchBuilder(spec, self.tokenizer, RewardScorer(spec.rewards), self.rollout, self.reference,
                                    self.episodes)  # fmt: skip
        self.evaluator = Evaluator(spec, self.tokenizer, self.builder, self.rollout, self.splits.validation)
        self.metrics_server: MetricsServer | None = None
        self._probe_stop = threading.Event()
        self._restarts_written = (0, 0)  # (rollout, reference) restarts reflected in processes.json
        self._first_step_report: dict | None = None
        self._phase_memory: dict = {}  # the last step's memory by phase (rollout, update)
        self.phase, self.max_steps = "starting", spec.schedule.steps
        try:
            self._restore()
        except BaseException:
            self.stop_roles()  # colocated: the engine was started to load the policy
            raise
        removed = self.checkpoints.remove_torn()
        if removed:
            self.recorder.record({"kind": "checkpoint_cleanup", "removed_steps": removed})
            self._say(
                f"removed torn checkpoint(s) of step {', '.join(map(str, removed))} under {self.checkpoints.uri} (never completed)"
            )

    def _load_policy(self) -> Policy:
        """The INT4 base + a fresh adapter; placement colocated: the rollout engine's base (trainer/colocated.py)."""
        spec = self.spec
        check_served_targets(model_type(Path(spec.model.path)), spec.adapter)  # before anything loads
        if spec.placement != "colocated":
            policy = load_policy(Path(spec.model.path), spec.adapter, dtype=self.learner_dtype, device=self.device,
                                 lora_rounding=spec.learner.lora_rounding)  # fmt: skip
            if spec.moe.routing_replay and not policy.moe_blocks():
                raise OrbitError(f"moe.routing_replay: {spec.model.path} is a dense model, it has no MoE layer to replay")
            return policy
        policy, self.shared_base = load_colocated(spec, self.rollout, self.device, self.learner_dtype)
        attached = self.shared_base.attached
        self._say(f"placement colocated: the learner computes on the rollout engine's base ({attached.arena.size / 2**20:.1f} MiB, "
                  f"one copy, sealed read-only; vLLM's {attached.meta['kernel']} {attached.meta['isa_hint']})")  # fmt: skip
        return policy

    # ---- one RL step ---------------------------------------------------------------------
    def evaluate(self) -> dict:
        row = self.recorder.record(self.evaluator.evaluate(self.state.step))
        metrics.observe_eval(row)
        return row

    def step(self) -> dict:
        """One RL step; returns its metrics row. On any failure the run's state is left as before the step."""
        timings: dict[str, float] = {}
        started = time.monotonic()
        state = self.state
        self.peak_memory.reset()
        snapshot = StepSnapshot.capture(self.policy, self.optimizer, self.scheduler, self.sampler.state_dict())
        counters = (state.step, state.adapter_version, state.reward_errors, len(state.rows))
        updated = False

        def before_optimizer_step() -> None:
            nonlocal updated
            self.stop.commit_started()  # from here on the step completes or is rolled back
            updated = True

        try:
            indices = self.sampler.next_batch(self.spec.rollout.prompts_per_step)
            batch = self.builder.build(indices, [self.splits.train[i] for i in indices], state.step, timings)
            t = time.monotonic()
            phases = {"run_pss_rollout_phase_bytes": self._run_pss()}
            with self.rollout.kv_cache_released() as released:  # colocated on a GPU: the KV cache takes turns
                update = policy_update(self.policy, self.optimizer, batch.for_update(), self.loss_config,
                                       temperature=self.spec.rollout.temperature, max_grad_norm=self.spec.schedule.max_grad_norm,
                                       epochs=self.spec.algorithm.epochs_per_batch, minibatches=self.spec.algorithm.minibatches,
                                       limits=self.limits, before_first_optimizer_step=before_optimizer_step)  # fmt: skip
                phases |= {"run_pss_update_phase_bytes": self._run_pss(), "kv_cache_released": released}
            self._phase_memory = {k: v for k, v in phases.items() if v is not None}
            lr = self.scheduler.get_last_lr()[0]
            self.scheduler.step()  # once per RL step (see ScheduleSpec)
            timings["train_s"] = time.monotonic() - t
            return self._commit(batch, update, lr, timings, started)
        except BaseException:
            with self.stop.deferred():  # a further Ctrl-C must not leave the rollback half done
                self.sampler = PromptSampler.from_state(snapshot.restore(self.policy, self.optimizer, self.scheduler))
                state.step, state.adapter_version, state.reward_errors = counters[:3]
                del state.rows[counters[3] :]
                if updated:
                    metrics.LEARNER_STEP_ROLLBACKS.inc()
                    log.warning(
                        "step %d failed after its update; rolled back to the state after step %d", state.step + 1, state.step
                    )
            raise

    def _private_base_bytes(self) -> int:
        """Bytes of the base this learner holds in its own memory (colocated: what is not the engine's pages)."""
        mapped = self.shared_base.attached.mapped if self.shared_base and self.shared_base.attached else None
        return sum(t.nbytes for t in self.policy.base_tensors() if mapped is None or not mapped.holds(t))

    def _run_pss(self) -> int | None:
        """PSS of this run's local processes, shared pages once (None: the roles are containers)."""
        return servers_pss([self.rollout.server, self.reference.server])

    def _adapter_source(self, version: int) -> tuple[Path | InMemoryAdapter, int]:
        """What the rollout loads as VERSION, and its bytes: the published PEFT directory, or
        (colocated) the adapter's tensors in memory, handed over without files."""
        if self.shared_base is not None:
            source = InMemoryAdapter(*self.policy.adapter_export())
            return source, source.nbytes
        return publish_adapter(self.policy, self.paths.adapters, version, parse_dtype(self.spec.model.dtype))  # the served dtype

    def _commit(self, batch: RolloutBatch, update: UpdateResult, lr: float, timings: dict[str, float], started: float) -> dict:
        """Publish and serve the updated adapter, then record the step (the step row is written last)."""
        state = self.state
        t = time.monotonic()
        version = state.adapter_version + 1
        source, size = self._adapter_source(version)
        timings["sync_publish_s"] = time.monotonic() - t  # the adapter written (or exported) for the rollout
        sync = self.rollout.publish(self.policy, version, source)
        timings["sync_s"] = time.monotonic() - t
        if self.shared_base is None:
            prune_adapters(self.paths.adapters, version, keep=2)
        state.adapter_version = version
        state.step += 1
        state.reward_errors += sum(batch.rewards.errors.values())
        if (self.rollout.restarts, self.reference.restarts) != self._restarts_written:
            self.write_processes()
        self.recorder.record_samples(sample_rows(state.step, batch, self.spec.rollout.group_size, self.spec.run.log_samples))
        restarts = {"rollout_restarts": self.rollout.restarts, "reference_restarts": self.reference.restarts}
        row = step_row(state.step, version, batch, update, sync, lr=lr, adapter_bytes=size, timings=timings,
                       step_seconds=time.monotonic() - started, restarts=restarts,
                       memory={**self.peak_memory.read(), **self._phase_memory})  # fmt: skip
        if code_programs := take_step_counts():  # the code_tests reward's programs since the last step, per status
            row["code_programs"] = code_programs
        if update.routing_missing:
            log.warning("step %d: %d of %d samples came back without the rollout's routing; they used the learner's own",
                        state.step, update.routing_missing, len(batch.completions))  # fmt: skip
        on_policy, off_policy = self.on_policy.check(row, [*state.steps, row])
        row = self.recorder.record({**row, **on_policy})
        metrics.LEARNER_ADAPTER_VERSION.set(version)
        metrics.SYNC_ROLLOUT_VERSION.set(version)
        metrics.observe_step(row, batch.rewards.total)
        self.off_policy = off_policy  # raised by run() after this step: it is committed, its checkpoint kept
        return row

    # ---- the run -------------------------------------------------------------------------
    def run(self, max_steps: int | None = None) -> dict:
        """Train for schedule.steps (or MAX_STEPS); returns the summary also written to summary.json.

        SIGTERM (the pod is being stopped) and Ctrl-C stop the run the same way (see stopping):
        then the state is checkpointed, waiting at most checkpoint.stop_timeout_s, and
        KeyboardInterrupt is raised (exit 130 / 143).
        """
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        total = self.max_steps = max_steps or self.spec.schedule.steps
        self.stop.install()
        interrupted = False
        self._start_metrics()
        try:
            # opened here, not in __init__, so that the finally below always closes them (nothing to train
            # included: a run that died after its last step still finishes its tracker runs)
            self.recorder.open_trackers(self.state.step if self.state.resumed_from else None)
            if self.state.step >= total:
                self._say(f"the checkpoint is at step {self.state.step}, max steps is {total}: nothing to train")
                self.phase = "succeeded"
                return self.write_summary(interrupted=False)
            self.stop.interruptible = True
            self.start_roles()
            self.phase = "running"
            if not self.state.evals:
                before = self.evaluate()
                self._say(f"held-out accuracy before RL: {describe_eval(before)}")
            columns = [TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                       TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn()]  # fmt: skip
            with Progress(*columns, console=self.console, transient=False) as progress:
                task = progress.add_task("train", total=total, completed=self.state.step, info="")
                while self.state.step < total:
                    row = self.step()
                    if self.off_policy is not None:
                        raise self.off_policy
                    self._after_step(total)
                    last = self.state.evals[-1]
                    progress.update(task, completed=self.state.step, info=(
                        f"reward {row['reward_mean']:.2f} | held-out {last['accuracy']:.0%}±{last.get('accuracy_stderr', 0):.0%} of {last['examples']} "
                        f"| mismatch {row['mismatch_mean_abs']:.1e} "
                        f"| {row['tokens_per_second']:.0f} tok/s"))  # fmt: skip
            after = self.evaluate()
            self._say(f"held-out accuracy after RL:  {describe_eval(after)} (step {self.state.step})")
            self.phase = "succeeded"
        except Stopped:
            interrupted, self.phase = True, "stopped"
            self._say(f"stopped at step {self.state.step} ({self.stop.name}); servers shut down")
        except OffPolicy as exc:
            self.phase, self.stop_reason = "failed", exc.reason
            self._say(f"[red]{exc}")
            raise
        finally:
            self.phase = "failed" if self.phase in ("starting", "running") else self.phase
            with self.stop.deferred():  # stop signals are recorded, never raised, while shutting down
                self.stop_roles()
                summary = self._shut_down("stopping" if interrupted else "end of run", interrupted)
            self.stop.uninstall()
        if interrupted:
            raise KeyboardInterrupt(self.stop.signal)
        return summary

    def _start_metrics(self) -> None:
        """Serve /metrics and /healthz (if metrics.port is set) and start the progress clocks."""
        metrics.register_resources("learner")
        metrics.observe_start(time.time(), self.state.adapter_version)
        self.on_policy.export()
        if self.spec.metrics.port is None:
            return
        self.metrics_server = MetricsServer(metrics.LEARNER_REGISTRY, self.spec.metrics.host, self.spec.metrics.port,
                                            status=self.status, api_key=self.api_key).start()  # fmt: skip
        self._say(f"metrics: {self.metrics_server.url}/metrics (health: /healthz, progress: /status)")

    def status(self) -> dict:
        """The `/status` document (see recorder.status_document)."""
        restarts = {"rollout": self.rollout.restarts, "reference": self.reference.restarts}
        signal = signal_health(self.state.steps, self.on_policy.health(), self.rollout.noise_floor)
        return status_document(self.state, phase=self.phase, max_steps=self.max_steps, checkpoint_uri=self.checkpoints.uri,
                               last_checkpoint_step=self.checkpoints.stats.last_success_step, restarts=restarts,
                               signal=signal, reason=self.stop_reason)  # fmt: skip

    def _after_step(self, total: int) -> None:
        """Between two steps: resume report, checkpoint, evaluation; then honour a pending stop."""
        state = self.state
        if self._first_step_report is not None:
            report = {**self._first_step_report, "step": state.step, "seconds_to_first_step": process_age_seconds(),
                      "startup_seconds": self.startup_seconds, "first_step_seconds": state.steps[-1]["step_seconds"]}  # fmt: skip
            self._first_step_report = None
            self.recorder.record(report)
            self._say(f"resumed at step {report['from_step']}: first step done {report['seconds_to_first_step']:.1f}s after start "
                      f"(restoring the checkpoint took {report['restore_seconds']:.1f}s)")  # fmt: skip
        self._record_checkpoint_events()
        if state.step < total and self.checkpoints.due(state.step):
            self.checkpoint()
        self.stop.check()
        self.stop.interruptible = True
        if state.step % self.spec.eval.every_steps == 0 and state.step < total:
            self.evaluate()

    def _say(self, text: str) -> None:
        """A line for the user: on the console when there is one, else in the log."""
        if self.console is not None:
            self.console.print(text)
        else:
            log.info(text)
