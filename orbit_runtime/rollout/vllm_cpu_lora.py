"""A single-adapter fast path for vLLM's CPU LoRA ops (installed by Orbit's vLLM plugin).

vLLM's CPU build applies LoRA with PyTorch ops written for many adapters at once
(`vllm/lora/ops/torch_ops`): every linear layer gathers a copy of the adapter's A and B
matrices FOR EACH TOKEN (`lora_a[token_indices]`, a [tokens, rank, in] tensor) and multiplies
token by token (`einsum("bi, boi -> bo")`). An RL rollout serves one adapter to every request
of a batch, so the gather copies one matrix thousands of times; on the `base` benchmark it
doubled generation time.

`SingleAdapterPunicaWrapperCPU` is vLLM's CPU wrapper that, when every token of the batch maps
to the same adapter slot (the check is one comparison, made when vLLM updates the batch's
LoRA mapping), computes the same two products as two GEMMs on that slot's matrices. It keeps
vLLM's rounding: the shrink (x @ A^T) in fp32 into vLLM's fp32 buffer, then the expand
(buffer @ B^T) from inputs rounded to the model dtype, its fp32 sum rounded once to the model
dtype (as a 16-bit CPU GEMM rounds; computed as an fp32 GEMM, orbit_runtime/rounded_matmul.py),
added in the model dtype. Only the summation order within a dot product differs (a GEMM's
blocking vs einsum's), so outputs agree to the last bit or one unit in the last place
(tests/unit/test_vllm_cpu_lora.py; the integration tests check the log-probs against the
learner). Batches that mix adapters, or the base model and an adapter, take vLLM's own path. Set ORBIT_VLLM_LORA_FAST_PATH=0 to always use vLLM's path.
"""

from __future__ import annotations

import os

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from orbit_runtime.rounded_matmul import rounded_linear

FAST_PATH_ENV = "ORBIT_VLLM_LORA_FAST_PATH"
QUALNAME = f"{__name__}.SingleAdapterPunicaWrapperCPU"


def enabled() -> bool:
    return os.environ.get(FAST_PATH_ENV, "1") != "0"


def _slot_matrix(stacked: torch.Tensor, slot: int) -> torch.Tensor | None:
    """Slot SLOT's [out, in] matrix of a stacked LoRA weight ([max_loras, 1, out, in] or [max_loras, out, in]);
    None for any other layout (e.g. per-expert stacks), which vLLM's own path handles."""
    if stacked.dim() == 4 and stacked.shape[1] == 1:
        return stacked[slot, 0]
    if stacked.dim() == 3:
        return stacked[slot]
    return None


class SingleAdapterPunicaWrapperCPU(PunicaWrapperCPU):
    """vLLM's CPU punica wrapper with GEMMs when the whole batch uses one adapter slot."""

    single_slot: int | None = None  # the slot every token of the batch uses, or None (mixed, or no LoRA)
    fast_calls = 0  # products computed by the fast path (tests check it ran)

    def _update_prefill_metadata(self, token_lora_tensor: torch.Tensor) -> None:
        super()._update_prefill_metadata(token_lora_tensor)
        # compute_meta merged consecutive tokens of one slot: one run of a real slot is one adapter for all
        one_run = self.batch_size == 1 and not self.no_lora
        self.single_slot = int(self._lora_indices_per_batch[0]) if one_run else None

    def _fast(self, x: torch.Tensor) -> bool:
        return self.single_slot is not None and x.shape[0] == self.token_nums

    def _shrink_prefill(self, y: torch.Tensor, x: torch.Tensor, w_t_all: torch.Tensor, scale: float) -> None:
        a = _slot_matrix(w_t_all, self.single_slot) if self._fast(x) else None
        if a is None:
            return super()._shrink_prefill(y, x, w_t_all, scale)
        self.fast_calls += 1
        out = torch.mm(x.to(y.dtype), a.to(y.dtype).t())  # [rank, in] in the buffer's dtype (fp32), as vLLM casts
        y[:, : out.shape[1]] = scale * out

    def _expand_slice_prefill(self, y: torch.Tensor, x: torch.Tensor, w_t_all: torch.Tensor, y_offset: int,
                              y_slice_size: int, add_inputs: bool) -> None:  # fmt: skip
        b = _slot_matrix(w_t_all, self.single_slot) if self._fast(x) else None
        if b is None:
            return super()._expand_slice_prefill(y, x, w_t_all, y_offset, y_slice_size, add_inputs)
        self.fast_calls += 1
        out = rounded_linear(x.to(y.dtype), b.to(y.dtype))  # the inputs rounded to the model dtype, as vLLM casts
        if add_inputs:
            y[:, y_offset : y_offset + y_slice_size] += out
        else:
            y[:, y_offset : y_offset + y_slice_size] = out


_stock_get_punica_wrapper = None  # vLLM's own classmethod, kept by the first install()


def install() -> None:
    """Make vLLM's CPU platform build this wrapper (vLLM resolves the wrapper's qualified name when LoRA starts)."""
    global _stock_get_punica_wrapper
    from vllm.platforms.cpu import CpuPlatform

    if _stock_get_punica_wrapper is None:
        _stock_get_punica_wrapper = CpuPlatform.__dict__["get_punica_wrapper"]
    CpuPlatform.get_punica_wrapper = classmethod(lambda cls: QUALNAME)


def uninstall() -> None:
    """Give vLLM's CPU platform its own wrapper back (a process that installed the fast path, then
    starts an engine with it turned off: an in-process engine after another, or a test)."""
    from vllm.platforms.cpu import CpuPlatform

    if _stock_get_punica_wrapper is not None:
        CpuPlatform.get_punica_wrapper = _stock_get_punica_wrapper
