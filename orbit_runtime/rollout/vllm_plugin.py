"""Orbit's vLLM plugin (entry point group `vllm.general_plugins`, loaded by every vLLM process).

On vLLM's CPU build it registers `CpuInt4Qwen3MoeForCausalLM` for the `Qwen3MoeForCausalLM`
architecture and `CpuInt4DeepseekV3ForCausalLM` for `DeepseekV3ForCausalLM`: the stock models
cannot run INT4 experts or MoE LoRA there (see `vllm_cpu_moe.py`, `vllm_cpu_deepseek.py`), and
it gives the CPU LoRA ops a single-adapter fast path (`vllm_cpu_lora.py`; ORBIT_VLLM_LORA_FAST_PATH=0
turns it off), and makes its processes sleep when idle instead of busy-polling for a second
(`vllm_cpu_idle.py`; ORBIT_VLLM_IDLE_SPIN_S sets the window). On GPU it does nothing, so
vLLM's own fused MoE model and LoRA kernels serve.
Set ORBIT_VLLM_CPU_MOE=0 to keep vLLM's model on CPU too (e.g. on a CPU with AMX).
On a CPU without AVX-512, whose vLLM library has no INT4 GEMM, it installs a portable one
(`int4/vllm_cpu_kernel.py`), so INT4 bases serve there too.
With VLLM_CPU_INT4_W4A8=0 (colocated engines) it also asks Linux for the AMX state. With
ORBIT_RETURN_ROUTED_EXPERTS=1 (routing replay) it makes the CPU build return the experts its
routers chose, as vLLM's GPU build does (`routing_capture.py`).
"""

from __future__ import annotations

import logging
import os

from orbit_runtime.rollout.server import W4A16_ENV

CPU_MOE_MODELS = {
    "Qwen3MoeForCausalLM": "orbit_runtime.rollout.vllm_cpu_moe:CpuInt4Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM": "orbit_runtime.rollout.vllm_cpu_deepseek:CpuInt4DeepseekV3ForCausalLM",
}
log = logging.getLogger(__name__)


def register() -> None:
    """Called by vLLM at start-up in each of its processes."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    if os.environ.get(W4A16_ENV) == "0":
        # vLLM's W4A16 kernel runs AMX instructions for bf16 without asking Linux for the AMX state
        # (its W4A8 default path does): the worker would die of SIGILL on its first forward
        from orbit_runtime.int4.vllm_cpu_kernel import enable_amx

        enable_amx()
    from orbit_runtime.int4.vllm_cpu_kernel import install_portable_kernel

    if install_portable_kernel():
        log.warning("orbit: vLLM's CPU library has no cpu_gemm_wna16 on this CPU (no AVX-512): INT4 linears use "
                    "Orbit's portable kernel (dequantize + fp32 GEMM), correct but slower")  # fmt: skip
    from orbit_runtime.rollout import vllm_cpu_idle, vllm_cpu_lora

    vllm_cpu_idle.install(vllm_cpu_idle.idle_spin_seconds())  # idle: sleep, the learner needs the cores

    if vllm_cpu_lora.enabled():
        vllm_cpu_lora.install()  # one adapter for the whole batch: two GEMMs, not a per-token gather
    else:
        vllm_cpu_lora.uninstall()  # an earlier engine of this process may have installed it
    if os.environ.get("ORBIT_VLLM_CPU_MOE", "1") == "0":
        return
    from vllm import ModelRegistry

    from orbit_runtime.rollout import routing_capture

    if routing_capture.enabled():
        routing_capture.install()
    for architecture, implementation in CPU_MOE_MODELS.items():
        ModelRegistry.register_model(architecture, implementation)  # lazy: imported when a model needs it
        log.info("orbit: %s on CPU uses %s (INT4 experts as linear layers)", architecture, implementation)
