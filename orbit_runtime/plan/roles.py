"""Memory of each role's process on one of its GPUs (or on the host), by row.

Rows (bytes on one GPU):
  base_int4            packed INT4 weights and their scales
  base_16bit           embeddings, LM head, norms, routers, 16-bit linears (and fp32 routing biases)
  lora                 the adapter: vLLM's adapter slots; in the learner fp32 weights, gradients,
                       AdamW moments and the step snapshot Orbit keeps to roll a failed step back
  activations          the learner's saved activations at its largest micro-batch (see activations.py)
  logits               the learner's full-vocabulary log-softmax at its backward
  kv_cache             vLLM's KV cache for one step's rollout batch (MLA: the compressed latent)
  rollout_activations  vLLM's forward scratch: max_num_batched_tokens through one layer, and the
                       sampler's logits for max_num_seqs sequences
  runtime              the process itself: CUDA context, cuBLAS/NCCL workspaces, non-tensor memory
  weights, gradients, optimizer_state, rollout_weights   full-parameter fine-tuning (scheme B)

The runtime and scratch sizes are assumptions, not measurements (named below); everything
else follows from the model's shape and the job.
"""

from __future__ import annotations

import math

from orbit_runtime.plan.activations import UpdateMemory, scoring_memory, update_memory
from orbit_runtime.plan.architecture import Architecture
from orbit_runtime.plan.hardware import GIB
from orbit_runtime.plan.parameters import model_linears, widest_intermediate
from orbit_runtime.plan.request import PlanRequest
from orbit_runtime.plan.weights import DTYPE_BYTES, LEARNER_LORA_BYTES, BaseWeights, lora_params, vllm_lora_bytes

# the process's own memory (assumed): a CUDA context with cuBLAS workspaces is ~0.5-1 GiB, NCCL adds
# buffers when sharded; on the CPU, the resident libraries (torch, transformers, vLLM's engine)
GPU_RUNTIME = {"rollout": int(1.5 * GIB), "learner": 1 * GIB, "reference": 1 * GIB, "shared": 2 * GIB, "full_finetune": int(1.5 * GIB)}
CPU_RUNTIME = {"rollout": int(1.5 * GIB), "learner": int(0.6 * GIB), "reference": int(0.6 * GIB)}
# host memory a GPU role needs besides what it loads (assumed): the Python process with its CUDA libraries
HOST_RUNTIME = 3 * GIB
VLLM_BATCHED_TOKENS_GPU = 8192  # vLLM's default max_num_batched_tokens on GPU (chunked prefill)
VLLM_MAX_SEQS_GPU = 256  # the sampler scratch is sized for this many sequences unless rollout.max_num_seqs says
KV_BLOCK = 16  # vLLM's KV cache block, in tokens


def kv_bytes_per_token(arch: Architecture, request: PlanRequest, gpus: int) -> int:
    """One token's KV cache on one of GPUS tensor-parallel ranks (MLA's latent is whole on every rank)."""
    a, kv = arch.attention, DTYPE_BYTES[request.dtype]
    if a.kind == "mla":
        return arch.layers * (a.kv_lora_rank + a.qk_rope_head_dim) * kv
    heads = max(1, a.kv_heads // max(gpus, 1))
    return arch.layers * 2 * heads * a.head_dim * kv


def kv_tokens(request: PlanRequest) -> int:
    """KV tokens of one step's rollout: every sequence at full length (blocks of 16); with prefix
    caching (vLLM's default on GPU) a group shares its prompt's blocks."""
    blocks = lambda tokens: math.ceil(tokens / KV_BLOCK) * KV_BLOCK  # noqa: E731
    sequences = min(request.samples, request.max_num_seqs or request.samples)
    if request.prefix_caching is False:
        tokens = sequences * blocks(request.sequence_tokens)
    else:
        prompts = math.ceil(sequences / request.group)
        tokens = prompts * blocks(request.prompt_tokens) + sequences * blocks(request.completion_tokens)
    return max(tokens, blocks(request.max_model_len))  # vLLM needs room for one longest sequence to start


def rollout_scratch(arch: Architecture, request: PlanRequest, gpus: int, cpu: bool) -> int:
    """vLLM's forward scratch (assumed shape): the batched tokens through the widest layer, and the sampler."""
    tokens = request.max_model_len if cpu else VLLM_BATCHED_TOKENS_GPU
    a, n = arch.attention, max(gpus, 1)
    per_token = 4 * arch.hidden + (a.q_width + 2 * a.kv_width + a.out_width) / n + 3 * widest_intermediate(arch) / n
    sequences = request.max_num_seqs or (request.samples if cpu else VLLM_MAX_SEQS_GPU)
    return int(tokens * per_token * DTYPE_BYTES[request.dtype] + 3 * 4 * sequences * arch.vocab / n)


def rollout_rows(arch: Architecture, base: BaseWeights, request: PlanRequest, gpus: int, cpu: bool = False) -> dict[str, int]:
    """vLLM on one of GPUS tensor-parallel GPUs (cpu: vLLM's CPU build, its KV cache a fixed allocation)."""
    int4, dense = base.on_gpu(gpus, request.dtype)
    kv = request.cpu_kv_cache_gib * GIB if cpu else kv_tokens(request) * kv_bytes_per_token(arch, request, gpus)
    return {"base_int4": int4, "base_16bit": dense, "lora": vllm_lora_bytes(model_linears(arch), request, gpus, base.kv_heads), "kv_cache": kv,
            "rollout_activations": rollout_scratch(arch, request, gpus, cpu),
            "runtime": (CPU_RUNTIME if cpu else GPU_RUNTIME)["rollout"]}  # fmt: skip


def learner_rows(arch: Architecture, base: BaseWeights, request: PlanRequest, gpus: int = 1, cpu: bool = False) -> dict[str, int]:
    """The learner on one of GPUS shards (1: the whole learner on one device, as today's learner runs)."""
    int4, dense = base.on_gpu(gpus, request.learner_dtype)
    update = update_memory(arch, request, gpus)
    return {"base_int4": int4, "base_16bit": dense,
            "lora": LEARNER_LORA_BYTES * lora_params(model_linears(arch), request, gpus, base.kv_heads),
            "activations": update.activations, "logits": update.logits,
            "runtime": (CPU_RUNTIME if cpu else GPU_RUNTIME)["learner"]}  # fmt: skip


def reference_rows(arch: Architecture, base: BaseWeights, request: PlanRequest, cpu: bool = False) -> dict[str, int]:
    """`orbit reference`: the base with no adapter, scoring without gradients, on one device."""
    int4, dense = base.on_gpu(1, request.learner_dtype)
    activations, logits = scoring_memory(arch, request)
    return {"base_int4": int4, "base_16bit": dense, "activations": activations, "logits": logits,
            "runtime": (CPU_RUNTIME if cpu else GPU_RUNTIME)["reference"]}  # fmt: skip


def host_bytes(role: str, base: BaseWeights, request: PlanRequest) -> int:
    """Host memory a GPU role needs: the learner and the reference load the whole base on the CPU
    before moving it to the GPU (int4_base.py); vLLM streams memory-mapped shards to its GPUs."""
    if role == "rollout":
        return HOST_RUNTIME + 2 * GIB * request.tensor_parallel_size
    int4, dense = base.on_gpu(1, request.learner_dtype)
    return int4 + dense + HOST_RUNTIME


def full_finetune_rows(arch: Architecture, total_params: int, request: PlanRequest, nodes: int, gpus_per_node: int,
                       state_bytes: int = 16, update: UpdateMemory | None = None) -> dict[str, int]:  # fmt: skip
    """Full-parameter training on one GPU of NODES nodes, sharded over all their GPUs as FSDP/ZeRO-3 shards
    it: bf16 weights and gradients, fp32 master weights and AdamW moments (STATE_BYTES 16 a parameter;
    8 with bf16 moments and no master copy), a bf16 vLLM copy for the rollout. Activations are those of
    the micro-batch each GPU trains on, every linear keeping its input (UPDATE: computed already)."""
    if update is None:
        update = update_memory(arch, request.model_copy(update={"learner_dtype": "bf16"}), 1, full_finetune=True)
    gpus = nodes * gpus_per_node
    # the rollout engine: tensor parallel within a node, pipeline parallel across nodes; MLA's latent is whole on each TP rank
    kv_ranks = nodes * (min(gpus_per_node, arch.attention.kv_heads) if arch.attention.kind == "gqa" else 1)
    return {"weights": 2 * total_params // gpus, "gradients": 2 * total_params // gpus,
            "optimizer_state": (state_bytes - 4) * total_params // gpus,
            "activations": update.activations, "logits": update.logits,
            "rollout_weights": 2 * total_params // gpus,
            "kv_cache": kv_tokens(request) * kv_bytes_per_token(arch, request, 1) // kv_ranks,
            "runtime": GPU_RUNTIME["full_finetune"]}  # fmt: skip
