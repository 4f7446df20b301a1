"""The job spec: one pydantic model read from YAML by `orbit train` (and, later, the CRD).

No torch import here: the CLI validates a config instantly. Every section forbids unknown
keys, so a typo is an error naming the field, not a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orbit_runtime.config.adapter import AdapterSpec
from orbit_runtime.config.code_data import HumanEvalData, SyntheticCodeData
from orbit_runtime.config.environment import BfclData, EnvironmentData, EnvironmentSpec
from orbit_runtime.config.learner import LearnerSpec
from orbit_runtime.config.moe import MoeSpec
from orbit_runtime.config.prompt_data import FileData, SyntheticArithmeticData
from orbit_runtime.config.run_outputs import MetricsSpec, RunSpec
from orbit_runtime.config.storage_uri import validate_storage_uri


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSettings(Section):
    """How the base is computed with (an RLTrainingJob has these; its base comes from `base`)."""

    dtype: Literal["bf16", "fp16"] = Field("bf16", description="Activation dtype of vLLM and the learner.")
    learner_dtype: Literal["bf16", "fp16", "fp32"] | None = Field(
        None, description="Learner compute dtype if it should differ from `dtype` (fp32 is exact but slower)."
    )


class ModelSpec(ModelSettings):
    """The frozen INT4 base (an `orbit quantize` output directory) and how it is computed with."""

    path: str = Field(description="INT4 checkpoint directory (compressed-tensors pack-quantized).")


class AlgorithmSpec(Section):
    """GRPO with the options verl and TRL users expect."""

    name: Literal["grpo"] = Field("grpo", description="The algorithm: grpo (the only one).")
    loss_aggregation: Literal["token_mean", "sequence_mean", "token_sum_norm"] = Field(
        "token_mean",
        description=(
            "token_mean: mean over all tokens of the batch (DAPO); sequence_mean: mean per sequence, then over "
            "sequences (original GRPO); token_sum_norm: sum over tokens / (sequences * rollout.max_tokens) (Dr.GRPO). "
            "Sequences with no tokens are left out of the sequence counts (as verl's agg_loss does)."
        ),
    )
    normalize_advantage_std: bool = Field(True, description="Divide group-centred rewards by the group std (off in Dr.GRPO).")
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO ratio clip below 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip above 1 + clip_high (DAPO clip-higher).")
    kl_beta: float = Field(0.0, ge=0, description="Weight of the k3 KL penalty to the reference policy (0 disables it).")
    mismatch_correction: Literal["none", "tis", "mis"] = Field(
        "tis", description="Correct train-rollout mismatch with truncated (tis) or masked (mis) importance sampling."
    )
    is_cap: float = Field(
        2.0,
        gt=1,
        description=(
            "C for the importance ratio rho = p_learner / p_rollout of the sampled tokens (learner before the update; "
            "see mismatch_level). TIS: weight min(rho, C). MIS: weight rho where rho <= C, else 0 (rejected). "
            "Rejected tokens still count in the loss_aggregation denominators: they add 0, they do not shrink the average."
        ),
    )
    mismatch_level: Literal["token", "sequence"] = Field(
        "token",
        description=(
            "token: one rho per token. sequence: one rho per completion, the product of its tokens' ratios (as verl's "
            "sequence-level IS), so TIS truncates and MIS keeps or rejects whole completions."
        ),
    )
    dual_clip: float | None = Field(
        3.0,
        gt=1,
        description=(
            "Dual-clip PPO (verl's clip_ratio_c): for negative advantages a token's loss is capped at -A * dual_clip "
            "(ratios above it get no gradient). Acts only when the ratio exceeds it, i.e. with epochs_per_batch > 1. "
            "null disables it."
        ),
    )
    kl_clamp: float | None = Field(
        10.0, gt=0, description="Bound on the per-token k3 KL estimate (verl's low_var_kl uses 10); null disables it."
    )
    max_mismatch: float | Literal["auto"] | None = Field(
        None,
        description="On-policy guarantee: the bound on mean |learner - rollout| log-prob of the sampled tokens (and of the "
        "sync's decode canary). Exceeding it for max_mismatch_steps consecutive steps stops the run with reason "
        "OffPolicy (its checkpoint kept). auto: calibrated as 4x the largest mismatch of the run's first 5 steps (a floor "
        "measured on a tiny random model would stop real models by mistake). null: off.",
    )
    max_mismatch_steps: int = Field(3, ge=1, description="Consecutive steps over algorithm.max_mismatch before the run stops.")
    epochs_per_batch: int = Field(1, ge=1, le=8, description="Passes over each rollout batch.")
    minibatches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per pass: the rollout batch is split, in order, into this many minibatches (PPO "
        "minibatches; each has its own loss normalisers). With more than one step per batch the ratios move off 1 "
        "and clipping acts. Old log-probs are those of the policy before the batch's first step.",
    )


DataSpec = Annotated[
    SyntheticArithmeticData | FileData | HumanEvalData | SyntheticCodeData | EnvironmentData | BfclData, Field(discriminator="type")
]


class RewardSpec(Section):
    """One reward function: a built-in name or a dotted path `package.module:function`."""

    function: str = Field(description="Built-in (exact_match, prefix_match, boxed_format, regex, code_tests, environment) or 'module.path:callable'.")
    weight: float = Field(1.0, description="Its weight in the summed reward.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments passed to the function.")
    max_error_fraction: float = Field(
        0.5, ge=0, le=1, description="Fail the step (naming this reward) when more than this share of a step's samples "
        "raise in it; below it a failed sample scores 0 and is counted (orbit_learner_reward_errors_total)."
    )


class RolloutSpec(Section):
    """Sampling (vLLM): group size, prompts per step, lengths, and vLLM's GPU settings."""

    group_size: int = Field(8, ge=2, description="Completions sampled per prompt (the GRPO group).")
    prompts_per_step: int = Field(16, ge=1, description="Prompts per RL step (each sampled group_size times).")
    max_tokens: int = Field(16, ge=1, description="Most tokens per completion.")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature. The learner scores tokens at the same temperature (logits / T), "
        "so the gradient is for the distribution that was sampled."
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling. Only 1.0 is accepted: the learner scores the full distribution at "
        "`temperature`, and training on a truncated sampler would optimise another policy than the one that acted."
    )
    truncated: Literal["keep", "mask", "reward"] = Field(
        "keep", description="Completions cut at max_tokens (finish_reason length): keep (scored like any other), mask "
        "(left out of the loss: DAPO's overlong filtering) or reward (their reward is truncated_reward)."
    )
    truncated_reward: float = Field(0.0, description="The reward of a truncated completion when truncated is 'reward'.")
    use_chat_template: bool = Field(True, description="Wrap prompts with the tokenizer's chat template.")
    kv_cache_gib: int = Field(1, ge=1, description="vLLM CPU KV cache (VLLM_CPU_KVCACHE_SPACE).")
    max_model_len: int = Field(512, ge=32, description="vLLM's context length (prompt + completion).")
    max_restarts: int = Field(2, ge=0, description="Times a dead rollout server is restarted before the run stops.")
    # vLLM's GPU settings, passed as its flags; null leaves vLLM's own default
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Share of each GPU's memory vLLM may take (weights + KV cache). Default: vLLM's "
        "0.9, or 0.5 when the learner runs on CUDA too (they share the GPU). On vLLM's CPU build the KV cache is "
        "rollout.kv_cache_gib instead."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs vLLM shards the model over.")
    enable_prefix_caching: bool | None = Field(
        None, description="Reuse the KV cache of shared prompt prefixes (a group's completions share their prompt)."
    )
    max_num_seqs: int | None = Field(None, ge=1, description="Most sequences vLLM schedules at once.")
    enforce_eager: bool | None = Field(
        None, description="Run vLLM without CUDA graphs (--enforce-eager). Default: only on vLLM's CPU build, which has "
        "no CUDA graphs; on a GPU eager mode makes decode several times slower, so it is for debugging only."
    )

    @field_validator("top_p")
    @classmethod
    def validate_top_p(cls, top_p: float) -> float:
        if top_p != 1.0:
            raise ValueError(
                "must be 1.0: the learner computes log-probs of the full distribution at rollout.temperature (as verl and "
                "TRL do), so a truncated (top_p < 1) sampler would make the gradient that of another policy; "
                "lower rollout.temperature instead"
            )
        return top_p


class ReferenceSpec(Section):
    """The reference policy (for the KL penalty): where it is computed."""

    mode: Literal["shared", "server"] = Field(
        "shared", description="shared: the learner's own base with the adapter disabled; server: a separate HTTP process."
    )
    max_restarts: int = Field(2, ge=0, description="server mode: times a dead reference server is restarted before the run stops.")
    report_kl: bool = Field(
        False,
        description="Compute the reference log-probs every step and report the KL to the reference (the step's `kl`) even "
        "when algorithm.kl_beta is 0, as a drift monitor: it costs one reference forward per step, and changes no update.",
    )


class ScheduleSpec(Section):
    """Optimisation schedule. The LR schedule advances once per RL step (one rollout batch),
    whatever algorithm.epochs_per_batch is: warm-up and decay are counted in RL steps."""

    steps: int = Field(100, ge=1, description="RL steps of the run.")
    learning_rate: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW).")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="After warm-up: constant, or linear/cosine decay to min_lr_ratio at schedule.steps."
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final LR as a fraction of learning_rate (linear/cosine).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient norm clip.")
    seed: int = Field(0, description="Seed of torch (the adapter's initialisation), prompt order and sampling.")


# The largest base-model noise floor a dtype's canary accepts: above it learner and rollout do not
# compute the same model (another base, another dtype), and a tolerance calibrated on it would pass anything.
NOISE_FLOOR_CEILING = {"bf16": 0.1, "fp16": 0.02}


class SyncSpec(Section):
    """How each adapter update reaches vLLM and is verified (the canary)."""

    canary_sequences: int = Field(4, ge=1, description="Fixed sequences scored by both engines after every sync.")
    tolerance: float | None = Field(
        None, gt=0, description="Max mean |dlogp| on the canary. Default: calibrated from the noise floor measured when "
        "the rollout engine starts (the base model scored by vLLM and the learner): max(3 x floor, floor + 0.005). "
        "Whatever the tolerance, the served log-probs must also be closer to the new version's than to the previous one's."
    )
    decode_tokens: int = Field(
        8, ge=0, description="At each sync, vLLM samples this many seeded tokens after each canary prompt and the learner "
        "recomputes their log-probs: the decode path the loss uses (0: off). Exported, and gated by algorithm.max_mismatch."
    )
    retries: int = Field(2, ge=0, description="Reloads under a fresh name before the step fails.")
    canary_completion: str = Field(
        "\\boxed{{{answer}}}",
        description="Text scored after each held-out canary prompt; {answer} is the prompt's reference answer "
        "(prompts without one use 'ok'). Any fixed text works: it only has to be the same for both engines. "
        "A Python format string: write literal braces twice ({{ }}).",
    )

    @field_validator("canary_completion")
    @classmethod
    def validate_canary(cls, template: str) -> str:
        try:
            template.format(answer="42")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"not a format string with only {{answer}} ({type(exc).__name__}: {exc}); write literal braces twice") from None
        return template


class EvalSpec(Section):
    """Held-out evaluation."""

    every_steps: int = Field(10, ge=1, description="Held-out evaluation every N steps (and at start and end).")
    samples: int = Field(
        1, ge=1, description="Completions per held-out prompt. 1: greedy (temperature 0). More: sampled at "
        "eval.temperature; accuracy is then mean@k and pass@k is reported too."
    )
    temperature: float | None = Field(None, ge=0, description="Default: 0 with one sample, rollout.temperature with more.")
    max_tokens: int | None = Field(None, ge=1, description="Default: rollout.max_tokens.")
    reward: RewardSpec | None = Field(
        None,
        description="The held-out score: its mean over the held-out prompts is reported as held-out accuracy. "
        "Default: exact_match with the kwargs of an exact_match entry in rewards, if any.",
    )


class CheckpointSpec(Section):
    """Where and when the learner checkpoints (see orbit_runtime/checkpoint). No credentials here:
    the S3 endpoint and keys come from the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY) or from files a mounted Secret provides (AWS_SHARED_CREDENTIALS_FILE)."""

    uri: str | None = Field(
        None, description="s3://bucket/prefix or file:///absolute/path; default: file://<output_dir>/<name>/checkpoints."
    )
    every_steps: int | None = Field(10, ge=1, description="Checkpoint every N steps (null: only on the minute interval).")
    every_minutes: float | None = Field(
        None, gt=0, description="Also checkpoint when this many minutes passed since the last one."
    )
    keep_last: int = Field(3, ge=1, description="Keep the newest N complete checkpoints ...")
    keep_best: int = Field(1, ge=0, description="... plus the best N by best_metric.")
    best_metric: Literal["reward_mean", "heldout_accuracy"] = Field(
        "reward_mean",
        description="reward_mean: mean training reward over the steps since the previous checkpoint; "
        "heldout_accuracy: the latest greedy validation accuracy.",
    )
    retries: int = Field(4, ge=0, description="Retries per storage request (exponential backoff) before a checkpoint attempt fails; "
                         "a failed checkpoint is retried later while training goes on.")  # fmt: skip
    stop_timeout_s: float = Field(
        60.0,
        gt=0,
        description="On SIGTERM/Ctrl-C and at the end, wait at most this long for the last checkpoint and the experiment "
        "trackers together (the trackers get at least 10 s). A pod's grace period is this plus 30 s.",
    )

    @field_validator("uri")
    @classmethod
    def validate_uri(cls, uri: str | None) -> str | None:
        return None if uri is None else validate_storage_uri(uri)  # ValueError -> the error names checkpoint.uri

    @model_validator(mode="after")
    def validate_interval(self) -> CheckpointSpec:
        if self.every_steps is None and self.every_minutes is None:
            raise ValueError("set every_steps or every_minutes (or both)")
        return self


class JobSpec(Section):
    """An RL post-training job: `RLTrainingJob.spec` and the `orbit train` config file."""

    model: ModelSpec
    placement: Literal["separate", "colocated"] = Field(
        "separate",
        description="separate: the rollout engine and the learner each hold the base in memory; colocated: one copy, "
        "the rollout engine's, which the learner maps read-only and computes on with vLLM's INT4 kernel "
        "(dense models on CPU in this version; `orbit plan` says which fits).",
    )
    adapter: AdapterSpec = Field(default_factory=AdapterSpec)
    moe: MoeSpec = Field(default_factory=MoeSpec)
    learner: LearnerSpec = Field(default_factory=LearnerSpec)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    data: DataSpec = Field(
        default_factory=SyntheticArithmeticData, description="The prompts: synthetic arithmetic, a JSONL/Parquet file, HumanEval or synthetic code tasks."
    )
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(function="exact_match")], min_length=1, description="The reward functions, summed by weight."
    )
    environment: EnvironmentSpec | None = Field(
        None, description="Multi-turn episodes with tools or an environment (see docs/multi-turn.md); unset: single-turn completions."
    )
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    reference: ReferenceSpec = Field(default_factory=ReferenceSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    sync: SyncSpec = Field(default_factory=SyncSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    run: RunSpec = Field(default_factory=RunSpec)

    @model_validator(mode="after")
    def validate_minibatches(self) -> JobSpec:
        samples = self.rollout.prompts_per_step * self.rollout.group_size
        if self.algorithm.minibatches > samples:
            raise ValueError(
                f"algorithm.minibatches ({self.algorithm.minibatches}) exceeds the samples per step "
                f"(rollout.prompts_per_step x rollout.group_size = {samples})"
            )
        return self

    @model_validator(mode="after")
    def validate_environment(self) -> JobSpec:
        env = self.environment
        if env is None:
            if any(r.function == "environment" for r in self.rewards):
                raise ValueError("rewards: the environment reward needs an environment section")
            return self
        try:
            env.check()
        except ValueError as exc:
            raise ValueError(f"environment: {exc}") from None
        if not self.rollout.use_chat_template:
            raise ValueError("rollout.use_chat_template: episodes are rendered with the chat template; it cannot be false")
        if env.max_tokens >= self.rollout.max_model_len:
            raise ValueError(f"environment.max_tokens ({env.max_tokens}) must be below rollout.max_model_len "
                             f"({self.rollout.max_model_len}): the episode follows its prompt in vLLM's context")
        if env.type == "tools" and any(r.function == "environment" for r in self.rewards):
            raise ValueError("rewards: a tools environment gives no environment reward; score its answers with rewards "
                             "such as exact_match")
        if self.moe.routing_replay:
            raise ValueError("moe.routing_replay: not supported with multi-turn episodes in this version (each turn's "
                             "request returns the routing of its own positions only)")
        if env.type in ("verifiers", "bfcl"):
            if "rewards" not in self.model_fields_set:  # a verifiers rubric, BFCL's answer check
                self.rewards = [RewardSpec(function="environment")]
            if "data" not in self.model_fields_set:
                self.data = EnvironmentData(type="environment") if env.type == "verifiers" else BfclData(type="bfcl")
        if (env.type == "bfcl") != isinstance(self.data, BfclData):
            raise ValueError("environment.type bfcl and data.type bfcl go together")
        if isinstance(self.data, EnvironmentData) and env.type != "verifiers":
            raise ValueError("data.type environment: only a verifiers environment brings its own tasks")
        if env.type == "verifiers" and not isinstance(self.data, EnvironmentData):
            raise ValueError("data: a verifiers environment runs its own tasks; set data.type to environment")
        return self

    @model_validator(mode="after")
    def validate_placement(self) -> JobSpec:
        if self.placement != "colocated":
            return self
        problems = []
        if self.reference.mode != "shared":
            problems.append("reference.mode must be shared (the reference is the shared base with the adapter off)")
        if self.model.learner_dtype not in (None, self.model.dtype):
            problems.append(f"model.learner_dtype must be unset or {self.model.dtype}: the learner computes on vLLM's tensors")
        if self.learner.device == "cuda":
            problems.append("learner.device cannot be cuda: the colocated base is shared through CPU memory in this version")
        if self.rollout.tensor_parallel_size != 1:
            problems.append("rollout.tensor_parallel_size must be 1: the learner maps one worker's weights")
        if problems:
            raise ValueError("placement colocated: " + "; ".join(problems))
        return self

    def checkpoint_uri(self) -> str:
        """checkpoint.uri, or the run directory's checkpoints/ folder."""
        return self.checkpoint.uri or f"file://{Path(self.run.output_dir).resolve() / self.run.name / 'checkpoints'}"
