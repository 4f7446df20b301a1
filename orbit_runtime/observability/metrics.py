"""Every Prometheus metric Orbit exports, defined in one place.

Names follow Prometheus conventions: prefix `orbit_`, then the role (`learner`, `sync`,
`rollout`, `reference`, `checkpoint`, `process`, `gpu`), base units and the `_total`,
`_seconds` and `_bytes` suffixes. No metric uses a `job` label (Prometheus reserves it for
the scrape job). Each role has its own registry, so a process exports only its own series
(the reference server never shows a learner step of 0): `LEARNER_REGISTRY` (learner, sync,
rollout as the learner sees it, checkpoints) and `REFERENCE_REGISTRY`. The `observe_*`
functions translate the learner's step/eval/checkpoint records into metrics, so the loop
itself makes few metric calls.

The rollout role is vLLM itself: its own `/metrics` (`vllm:*` series) is scraped as is.
What the learner sees of the rollout (request latency, tokens, restarts, health) is
exported by the learner under `orbit_rollout_*`.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily

disable_created_metrics()  # no `*_created` series: they double the series count and no panel uses them
LEARNER_REGISTRY = CollectorRegistry(auto_describe=True)
REFERENCE_REGISTRY = CollectorRegistry(auto_describe=True)
OPERATOR_REGISTRY = CollectorRegistry(auto_describe=True)
REGISTRIES = {"learner": LEARNER_REGISTRY, "reference": REFERENCE_REGISTRY, "operator": OPERATOR_REGISTRY}

# ---- operator ------------------------------------------------------------------------------
OPERATOR_RECONCILES = Counter(
    "orbit_operator_reconciles", "RLTrainingJob reconciles, by outcome (ok, invalid, retry: a transient API refusal, error).",
    ["outcome"],
    registry=OPERATOR_REGISTRY,
)
OPERATOR_RECONCILE_DURATION = Histogram(
    "orbit_operator_reconcile_duration_seconds", "Time one reconcile took (API calls included).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=OPERATOR_REGISTRY,
)
OPERATOR_JOBS = Gauge("orbit_operator_jobs", "RLTrainingJobs the operator knows, by phase.", ["phase"], registry=OPERATOR_REGISTRY)
OPERATOR_POD_CREATIONS = Counter("orbit_operator_pod_creations", "Pods created for jobs (first attempts and retries).",
                                 registry=OPERATOR_REGISTRY)  # fmt: skip
OPERATOR_STATUS_POLL_FAILURES = Counter(
    "orbit_operator_status_poll_failures", "Learner /status polls that failed (the job's progress is then stale).",
    registry=OPERATOR_REGISTRY,
)
OPERATOR_DOES_NOT_FIT = Counter(
    "orbit_operator_does_not_fit", "Jobs failed for not fitting their node (DoesNotFit), by where the plan said so: "
    "admission (the operator, before any pod) or prepare_base (the first pod, with the base's config.json).", ["stage"],
    registry=OPERATOR_REGISTRY,
)
OPERATOR_REQUEUED_JOBS = Gauge("orbit_operator_requeued_jobs", "Jobs with a reconcile scheduled (a poll, a backoff's end, a TTL, "
                               "the resync).", registry=OPERATOR_REGISTRY)  # fmt: skip
OPERATOR_API_RETRIES = Counter(
    "orbit_operator_api_retries", "API calls refused transiently (429, quota 403, 5xx) and retried later, by call and status code.",
    ["call", "code"], registry=OPERATOR_REGISTRY,
)
OPERATOR_KUEUE_WORKLOADS = Counter("orbit_operator_kueue_workloads", "Kueue Workloads created for jobs (one per job).",
                                   registry=OPERATOR_REGISTRY)  # fmt: skip
OPERATOR_KUEUE_EVICTIONS = Counter(
    "orbit_operator_kueue_evictions", "Running jobs whose pod was deleted because Kueue evicted (preempted) their Workload; "
    "not counted as failures.", registry=OPERATOR_REGISTRY,
)
OPERATOR_KUEUE_WORKLOAD_UPDATES = Counter(
    "orbit_operator_kueue_workload_updates", "Workload status writes, by kind: released (an evicted job's admission cleared "
    "once its pod is gone), finished (condition Finished) or pods_ready (condition PodsReady).", ["kind"], registry=OPERATOR_REGISTRY,
)
for _outcome in ("ok", "invalid", "retry", "error"):
    OPERATOR_RECONCILES.labels(_outcome)
for _stage in ("admission", "prepare_base"):
    OPERATOR_DOES_NOT_FIT.labels(_stage)
for _kind in ("released", "finished", "pods_ready"):
    OPERATOR_KUEUE_WORKLOAD_UPDATES.labels(_kind)

STEP_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 3600)
FAST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
REWARD_BUCKETS = (-1, -0.5, 0, 0.1, 0.25, 0.5, 0.75, 0.9, 1, 2, 5)

# ---- learner ---------------------------------------------------------------------------
LEARNER_STEP = Gauge("orbit_learner_step", "Last completed RL step.", registry=LEARNER_REGISTRY)
LEARNER_LAST_STEP_TIME = Gauge(
    "orbit_learner_last_step_timestamp_seconds",
    "Unix time the last step completed (the learner's start time before its first step).",
    registry=LEARNER_REGISTRY,
)
LEARNER_STEP_DURATION = Histogram(
    "orbit_learner_step_duration_seconds", "Wall time of one RL step.", buckets=STEP_BUCKETS, registry=LEARNER_REGISTRY
)
LEARNER_PHASE_SECONDS = Gauge(
    "orbit_learner_phase_seconds", "Time the last step spent per phase (generate, reward, reference, train, "
    "sync; sync's parts: sync_publish, sync_canary_expected, sync_decode_canary).", ["phase"], registry=LEARNER_REGISTRY
)
LEARNER_STEP_PEAK_MEMORY = Gauge(
    "orbit_learner_step_peak_memory_bytes",
    "Peak memory of the learner during the last step: rss (process, CPU), cuda_allocated and cuda_reserved (its GPU).",
    ["kind"],
    registry=LEARNER_REGISTRY,
)
LEARNER_MICRO_BATCHES = Gauge(
    "orbit_learner_micro_batches", "Forward/backward passes the last step's update took.", registry=LEARNER_REGISTRY
)
LEARNER_SAMPLES = Counter("orbit_learner_samples_total", "Completions trained on.", registry=LEARNER_REGISTRY)
LEARNER_TOKENS = Counter("orbit_learner_tokens_total", "Completion tokens trained on.", registry=LEARNER_REGISTRY)
LEARNER_REWARD_MEAN = Gauge("orbit_learner_reward_mean", "Mean reward of the last step's samples.", registry=LEARNER_REGISTRY)
LEARNER_REWARD_STD = Gauge("orbit_learner_reward_std", "Std of the last step's rewards.", registry=LEARNER_REGISTRY)
LEARNER_REWARD = Histogram("orbit_learner_reward", "Reward per sample.", buckets=REWARD_BUCKETS, registry=LEARNER_REGISTRY)
LEARNER_REWARD_ERRORS = Counter(
    "orbit_learner_reward_errors_total", "Reward function calls that raised (the sample got 0).", registry=LEARNER_REGISTRY
)
LEARNER_KL = Gauge("orbit_learner_kl_to_reference", "k3 KL of the policy to the reference, last step.", registry=LEARNER_REGISTRY)
LEARNER_MISMATCH_MEAN = Gauge(
    "orbit_learner_mismatch_mean_abs_logprob", "Mean |learner - rollout| token log-prob, last step.", registry=LEARNER_REGISTRY
)
LEARNER_MISMATCH_MAX = Gauge(
    "orbit_learner_mismatch_max_abs_logprob", "Max |learner - rollout| token log-prob, last step.", registry=LEARNER_REGISTRY
)
LEARNER_HELDOUT_STDERR = Gauge(
    "orbit_learner_heldout_accuracy_stderr", "Standard error of orbit_learner_heldout_accuracy over the held-out prompts.",
    registry=LEARNER_REGISTRY,
)  # fmt: skip
LEARNER_MISMATCH_BOUND = Gauge(
    "orbit_learner_mismatch_bound_abs_logprob", "The mismatch bound in force: algorithm.max_mismatch (set or calibrated), "
    "else 0.05 (what the OrbitMismatchHigh alert compares with).",
    registry=LEARNER_REGISTRY,
)  # fmt: skip
LEARNER_OFF_POLICY_STEPS = Gauge(
    "orbit_learner_off_policy_steps", "Consecutive steps whose mismatch exceeded algorithm.max_mismatch.", registry=LEARNER_REGISTRY
)
LEARNER_MISMATCH_KL = Gauge("orbit_learner_mismatch_k3_kl", "k3 KL of rollout to learner, last step.", registry=LEARNER_REGISTRY)
LEARNER_MISMATCH_UNREPLAYED = Gauge(
    "orbit_learner_mismatch_unreplayed_mean_abs_logprob", "moe.routing_replay: mean |learner - rollout| token log-prob "
    "with the learner's own routing, last step (orbit_learner_mismatch_mean_abs_logprob is with replay).",
    registry=LEARNER_REGISTRY,
)  # fmt: skip
LEARNER_ROUTING_AGREEMENT = Gauge(
    "orbit_learner_routing_agreement", "moe.routing_replay: share of positions whose experts the learner's own router "
    "chose as the rollout's did, last step, per MoE layer (layer=\"all\": every layer together).",
    ["layer"], registry=LEARNER_REGISTRY,
)  # fmt: skip
LEARNER_ROUTING_MISSING = Counter(
    "orbit_learner_routing_missing_samples_total", "moe.routing_replay: samples whose routing did not come back from "
    "the rollout (trained with the learner's own routing).", registry=LEARNER_REGISTRY,
)  # fmt: skip
LEARNER_CLIP_FRACTION = Gauge(
    "orbit_learner_importance_ratio_clip_fraction", "Share of tokens whose PPO ratio was clipped.", registry=LEARNER_REGISTRY
)
LEARNER_IS_WEIGHT = Gauge(
    "orbit_learner_mismatch_is_weight_mean", "Mean TIS/MIS weight (1 = no correction), last step.", registry=LEARNER_REGISTRY
)
LEARNER_IS_OVER_CAP = Gauge(
    "orbit_learner_mismatch_over_cap_fraction",
    "Share of the last step's tokens whose train-rollout importance ratio exceeds algorithm.is_cap (what TIS truncates).",
    registry=LEARNER_REGISTRY,
)
LEARNER_LOSS = Gauge("orbit_learner_loss", "GRPO loss of the last step.", registry=LEARNER_REGISTRY)
LEARNER_GRAD_NORM = Gauge("orbit_learner_grad_norm", "Adapter gradient norm before clipping.", registry=LEARNER_REGISTRY)
LEARNER_LR = Gauge("orbit_learner_learning_rate", "Learning rate used by the last step.", registry=LEARNER_REGISTRY)
LEARNER_ADAPTER_VERSION = Gauge(
    "orbit_learner_adapter_version", "Adapter version the learner published last.", registry=LEARNER_REGISTRY
)
LEARNER_HELDOUT_ACCURACY = Gauge(
    "orbit_learner_heldout_accuracy", "Accuracy on the held-out prompts (mean@k; greedy with k = 1), last evaluation.",
    registry=LEARNER_REGISTRY
)
LEARNER_UP = Gauge("orbit_learner_up", "1 while the learner runs its loop.", registry=LEARNER_REGISTRY)

# ---- adapter sync ----------------------------------------------------------------------
SYNC_ROLLOUT_VERSION = Gauge(
    "orbit_sync_rollout_adapter_version", "Adapter version the rollout serves (verified).", registry=LEARNER_REGISTRY
)
SYNC_DURATION = Histogram(
    "orbit_sync_duration_seconds", "Publish + load + canary verification of one adapter version.",
    buckets=FAST_BUCKETS, registry=LEARNER_REGISTRY,
)  # fmt: skip
SYNC_BYTES = Counter("orbit_sync_bytes_total", "Adapter bytes published to the rollout.", registry=LEARNER_REGISTRY)
SYNC_CANARY_FAILURES = Counter(
    "orbit_sync_canary_failures_total", "Adapter loads rejected by canary verification.", registry=LEARNER_REGISTRY
)
SYNC_CANARY_DELTA = Gauge(
    "orbit_sync_canary_mean_abs_logprob", "Canary mean |learner - rollout| log-prob of the served adapter, by path "
    "(prefill: the fixed canary scored with prompt_logprobs; decode: a seeded continuation sampled by the rollout).",
    ["path"], registry=LEARNER_REGISTRY,
)  # fmt: skip
SYNC_CANARY_SEPARATION = Gauge(
    "orbit_sync_canary_separation_abs_logprob", "Canary mean |version N - version N-1| learner log-prob: what a stale "
    "adapter would show.", registry=LEARNER_REGISTRY,
)  # fmt: skip
SYNC_CANARY_INCONCLUSIVE = Counter(
    "orbit_sync_canary_inconclusive_total", "Syncs whose canary could not tell version N from N-1 (they differ by less "
    "than the check resolves); served on the fresh name alone.", registry=LEARNER_REGISTRY,
)  # fmt: skip
SYNC_CANARY_DECODE_FAILURES = Counter(
    "orbit_sync_canary_decode_failures_total", "Decode canaries that could not be measured (the sync itself passed).",
    registry=LEARNER_REGISTRY,
)  # fmt: skip
SYNC_CANARY_NOISE_FLOOR = Gauge(
    "orbit_sync_canary_noise_floor_abs_logprob", "Canary mean |dlogp| of the base model (no adapter) between vLLM and the "
    "learner, measured when the rollout engine starts: the arithmetic noise of this dtype and machine.",
    registry=LEARNER_REGISTRY,
)  # fmt: skip
SYNC_CANARY_TOLERANCE = Gauge(
    "orbit_sync_canary_tolerance_abs_logprob", "The canary's tolerance (sync.tolerance, or calibrated from the noise floor).",
    registry=LEARNER_REGISTRY,
)  # fmt: skip

# ---- rollout (as the learner sees it) --------------------------------------------------
ROLLOUT_REQUEST_DURATION = Histogram(
    "orbit_rollout_request_duration_seconds", "Latency of requests to the rollout engine.", ["kind"],
    buckets=FAST_BUCKETS, registry=LEARNER_REGISTRY,
)  # fmt: skip
ROLLOUT_IN_FLIGHT = Gauge("orbit_rollout_requests_in_flight", "Requests waiting on the rollout engine.", registry=LEARNER_REGISTRY)
ROLLOUT_TOKENS = Counter("orbit_rollout_generated_tokens_total", "Tokens generated by the rollout engine.", registry=LEARNER_REGISTRY)
ROLLOUT_RESTARTS = Counter("orbit_rollout_restarts_total", "Times the rollout server was restarted.", registry=LEARNER_REGISTRY)
ROLE_REQUESTS_RESENT = Counter(
    "orbit_learner_role_requests_resent", "Requests a role server (rollout, reference) closed without an answer, sent again once.",
    ["role"], registry=LEARNER_REGISTRY,
)
ROLE_RECOVERY_DURATION = Histogram(
    "orbit_learner_role_recovery_seconds",
    "A dead role server's recovery, by phase: restart (a new server started, or the external one answering again) and "
    "resync (the new server brought back to the run's state: the served adapter loaded and verified).",
    ["role", "phase"], buckets=STEP_BUCKETS, registry=LEARNER_REGISTRY,
)  # fmt: skip
REFERENCE_RESTARTS = Counter(
    "orbit_learner_reference_restarts_total", "Times the reference server was restarted (server mode).", registry=LEARNER_REGISTRY
)
LEARNER_STEP_ROLLBACKS = Counter(
    "orbit_learner_step_rollbacks_total",
    "Updates undone because publishing or syncing them failed (the run stops at the previous step).",
    registry=LEARNER_REGISTRY,
)
SHARED_BASE_BYTES = Gauge(
    "orbit_shared_base_bytes", "placement colocated: bytes of the one base copy the learner maps from the rollout engine.",
    registry=LEARNER_REGISTRY,
)
SHARED_BASE_ATTACH_DURATION = Histogram(
    "orbit_shared_base_attach_seconds", "placement colocated: time to receive, map and verify the rollout engine's base.",
    registry=LEARNER_REGISTRY,
)
SHARED_BASE_ATTACHES = Counter(
    "orbit_shared_base_attaches_total", "placement colocated: times the learner attached to the rollout engine's base "
    "(1 + rollout restarts).", registry=LEARNER_REGISTRY,
)
ROLLOUT_KV_CACHE_RELEASED = Gauge(
    "orbit_rollout_kv_cache_released", "1 while the rollout engine's KV cache is freed for the learner's update "
    "(placement colocated on a GPU).", registry=LEARNER_REGISTRY,
)
ROLLOUT_UP = Gauge("orbit_rollout_up", "1 if the rollout engine answered its last health check.", registry=LEARNER_REGISTRY)

# ---- checkpoints -----------------------------------------------------------------------
CHECKPOINT_DURATION = Histogram(
    "orbit_checkpoint_duration_seconds", "Upload time of one checkpoint attempt.", buckets=FAST_BUCKETS, registry=LEARNER_REGISTRY
)
CHECKPOINT_BYTES = Gauge("orbit_checkpoint_size_bytes", "Size of the last checkpoint that landed.", registry=LEARNER_REGISTRY)
CHECKPOINT_FAILURES = Counter(
    "orbit_checkpoint_failures_total", "Checkpoint attempts that failed (storage errors after retries).", registry=LEARNER_REGISTRY
)
CHECKPOINT_LAST_SUCCESS = Gauge(
    "orbit_checkpoint_last_success_timestamp_seconds",
    "Unix time the last checkpoint landed (the learner's start time before its first one).",
    registry=LEARNER_REGISTRY,
)
CHECKPOINT_LAST_STEP = Gauge("orbit_checkpoint_last_step", "Step of the last checkpoint that landed.", registry=LEARNER_REGISTRY)

# ---- reference server (its own process and registry entries) ---------------------------
REFERENCE_REQUESTS = Counter("orbit_reference_requests_total", "Log-prob requests served.", ["outcome"], registry=REFERENCE_REGISTRY)
REFERENCE_SEQUENCES = Counter("orbit_reference_sequences_total", "Sequences scored.", registry=REFERENCE_REGISTRY)
REFERENCE_DURATION = Histogram(
    "orbit_reference_request_duration_seconds", "Latency of one log-prob request (queueing included).",
    buckets=FAST_BUCKETS, registry=REFERENCE_REGISTRY,
)  # fmt: skip


# Labelled series exist from the start (at 0), so panels and rules never see "no data" for them.
for _phase in ("generate", "reward", "reference", "train", "sync"):
    LEARNER_PHASE_SECONDS.labels(_phase)
for _kind in ("generate", "eval", "sync"):
    ROLLOUT_REQUEST_DURATION.labels(_kind)
for _outcome in ("ok", "invalid"):
    REFERENCE_REQUESTS.labels(_outcome)


class ResourceCollector:
    """Process memory (RSS) of this role and, when CUDA is present, GPU memory per device."""

    def __init__(self, role: str) -> None:
        self.role = role

    def collect(self):
        import psutil

        rss = GaugeMetricFamily("orbit_process_resident_memory_bytes", "Resident memory of the role's process.", labels=["role"])
        rss.add_metric([self.role], psutil.Process(os.getpid()).memory_info().rss)
        yield rss
        try:
            import torch
        except ImportError:
            return
        if torch.cuda.is_available():
            used = GaugeMetricFamily("orbit_gpu_memory_allocated_bytes", "GPU memory held by tensors.", labels=["role", "device"])
            peak = GaugeMetricFamily("orbit_gpu_memory_peak_bytes", "Peak GPU memory held by tensors (the learner "
                                     "resets it at each step's start: its peak within the current step).", labels=["role", "device"])  # fmt: skip
            for i in range(torch.cuda.device_count()):
                used.add_metric([self.role, str(i)], torch.cuda.memory_allocated(i))
                peak.add_metric([self.role, str(i)], torch.cuda.max_memory_allocated(i))
            yield used
            yield peak

    def describe(self):
        return []


_resources_registered: set[str] = set()


def register_resources(role: str) -> None:
    """Export this process's memory (and GPU memory) in ROLE's registry, once per process."""
    if role not in _resources_registered:
        REGISTRIES[role].register(ResourceCollector(role))
        _resources_registered.add(role)


# ---- translating records into metrics --------------------------------------------------
def observe_step(record: dict, per_sample_rewards: list[float]) -> None:
    """Update the learner/sync/rollout metrics from one step's metrics row."""
    LEARNER_STEP.set(record["step"])
    LEARNER_LAST_STEP_TIME.set(record["time"])
    LEARNER_STEP_DURATION.observe(record["step_seconds"])
    for phase in ("generate_s", "reward_s", "reference_s", "train_s", "sync_s",  # sync_s's parts: sync_*
                  "sync_publish_s", "sync_canary_expected_s", "sync_decode_canary_s"):  # fmt: skip
        if record.get(phase) is not None:
            LEARNER_PHASE_SECONDS.labels(phase.removesuffix("_s")).set(record[phase])
    for kind, key in (("rss", "peak_rss_bytes"), ("cuda_allocated", "cuda_peak_allocated_bytes"),
                      ("cuda_reserved", "cuda_peak_reserved_bytes")):  # fmt: skip
        if key in record:
            LEARNER_STEP_PEAK_MEMORY.labels(kind).set(record[key])
    if "micro_batches" in record:
        LEARNER_MICRO_BATCHES.set(record["micro_batches"])
    LEARNER_SAMPLES.inc(record["samples"])
    LEARNER_TOKENS.inc(record["tokens"])
    ROLLOUT_TOKENS.inc(record["tokens"])
    LEARNER_REWARD_MEAN.set(record["reward_mean"])
    LEARNER_REWARD_STD.set(record["reward_std"])
    for reward in per_sample_rewards:
        LEARNER_REWARD.observe(reward)
    LEARNER_REWARD_ERRORS.inc(record["reward_errors"])
    LEARNER_KL.set(record["kl"])
    LEARNER_MISMATCH_MEAN.set(record["mismatch_mean_abs"])
    LEARNER_MISMATCH_MAX.set(record["mismatch_max_abs"])
    LEARNER_MISMATCH_KL.set(record["mismatch_k3_kl"])
    if "routing_missing_samples" in record:  # counted even when no routing came back at all
        LEARNER_ROUTING_MISSING.inc(record["routing_missing_samples"])
        LEARNER_MISMATCH_UNREPLAYED.set(record["mismatch_unreplayed_mean_abs"])
    if record.get("routing_agreement") is not None:
        LEARNER_ROUTING_AGREEMENT.labels("all").set(record["routing_agreement"])
        for layer, agreement in record["routing_agreement_by_layer"].items():
            LEARNER_ROUTING_AGREEMENT.labels(layer).set(agreement)
    LEARNER_CLIP_FRACTION.set(record["clip_fraction"])
    LEARNER_IS_WEIGHT.set(record["is_weight_mean"])
    LEARNER_IS_OVER_CAP.set(record["is_over_cap_fraction"])
    LEARNER_LOSS.set(record["loss"])
    LEARNER_GRAD_NORM.set(record["grad_norm"])
    LEARNER_LR.set(record["learning_rate"])
    SYNC_DURATION.observe(record["sync_seconds"])
    SYNC_BYTES.inc(record["adapter_bytes"])
    SYNC_CANARY_DELTA.labels("prefill").set(record["canary_mean_abs_dlogp"])
    if record.get("canary_decode_mean_abs_dlogp") is not None:
        SYNC_CANARY_DELTA.labels("decode").set(record["canary_decode_mean_abs_dlogp"])
    if record.get("canary_separation") is not None:
        SYNC_CANARY_SEPARATION.set(record["canary_separation"])


def observe_start(now: float, adapter_version: int) -> None:
    """A learner (re)starts: progress and checkpoint clocks start now, versions as restored."""
    LEARNER_UP.set(1)
    LEARNER_LAST_STEP_TIME.set(now)
    CHECKPOINT_LAST_SUCCESS.set(now)
    LEARNER_ADAPTER_VERSION.set(adapter_version)
    SYNC_ROLLOUT_VERSION.set(adapter_version)


def observe_eval(record: dict) -> None:
    LEARNER_HELDOUT_ACCURACY.set(record["accuracy"])
    LEARNER_HELDOUT_STDERR.set(record.get("accuracy_stderr", 0.0))


def observe_checkpoint(event: dict) -> None:
    """Update the checkpoint metrics from one writer event (see checkpoint.writer)."""
    CHECKPOINT_DURATION.observe(event["seconds"])
    if event["ok"]:
        CHECKPOINT_BYTES.set(event["bytes"])
        CHECKPOINT_LAST_SUCCESS.set(event["time"])
        CHECKPOINT_LAST_STEP.set(event["step"])
    else:
        CHECKPOINT_FAILURES.inc()
