"""The single-adapter fast path of vLLM's CPU LoRA ops against vLLM's own path (same metadata, same tensors).

vLLM's wrapper and ours are both real: they are built and given a batch mapping as vLLM's
LoRA manager does (`update_metadata`), then apply LoRA through the calls vLLM's layers make
(`add_lora_linear` for column layers, `add_shrink` + `add_expand` with a 3-D buffer for the
row-parallel ones). The fast path's products are GEMMs where vLLM's are per-token einsums,
so the fp32 buffer may differ in summation order only; the model-dtype outputs must agree
to one unit in the last place.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.lora.punica_wrapper.punica_cpu", reason="needs vLLM (the CPU build)")

from vllm.lora.layers.utils import LoRAMapping  # noqa: E402
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU  # noqa: E402

from orbit_runtime.rollout.vllm_cpu_lora import SingleAdapterPunicaWrapperCPU  # noqa: E402

MAX_LORAS, RANK, HIDDEN, VOCAB = 2, 8, 64, 128
SLICES = (48, 16, 16)  # a fused q/k/v projection's output slices


def wrappers(index_mapping: list[int]) -> tuple[PunicaWrapperCPU, SingleAdapterPunicaWrapperCPU]:
    """vLLM's wrapper and ours over the same batch: adapter ids per token (0: the base model)."""
    mapping = LoRAMapping(index_mapping, index_mapping, is_prefill=True)
    lora_index_to_id = [1, 2]  # slot 0 serves adapter id 1, slot 1 adapter id 2
    out = []
    for cls in (PunicaWrapperCPU, SingleAdapterPunicaWrapperCPU):
        wrapper = cls(max_num_batched_tokens=256, max_batches=8, device="cpu")
        wrapper.update_metadata(mapping, lora_index_to_id, MAX_LORAS, VOCAB)
        out.append(wrapper)
    return out[0], out[1]


def stacked(dtype: torch.dtype, seed: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """lora_a_stacked / lora_b_stacked as vLLM's layers hold them: per slice [max_loras, 1, rank, in] / [max_loras, 1, out, rank]."""
    g = torch.Generator().manual_seed(seed)
    a = tuple(torch.randn(MAX_LORAS, 1, RANK, HIDDEN, generator=g).to(dtype) * 0.1 for _ in SLICES)
    b = tuple(torch.randn(MAX_LORAS, 1, size, RANK, generator=g).to(dtype) * 0.1 for size in SLICES)
    return a, b


def ulps_apart(x: torch.Tensor, y: torch.Tensor) -> int:
    """The largest difference in units in the last place between two 16-bit tensors."""
    as_int = {torch.bfloat16: torch.int16, torch.float16: torch.int16}[x.dtype]
    return int((x.view(as_int).int() - y.view(as_int).int()).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 200])
def test_one_adapter_for_the_batch_matches_vllms_path(dtype: torch.dtype, tokens: int) -> None:
    stock, fast = wrappers([2] * tokens)
    assert fast.single_slot == 1, "the whole batch uses adapter id 2, in slot 1"
    lora_a, lora_b = stacked(dtype, seed=tokens)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    base = torch.randn(tokens, sum(SLICES), generator=torch.Generator().manual_seed(2)).to(dtype)
    y_stock, y_fast = base.clone(), base.clone()
    stock.add_lora_linear(y_stock, x, lora_a, lora_b, 1.0, SLICES)
    fast.add_lora_linear(y_fast, x, lora_a, lora_b, 1.0, SLICES)
    assert fast.fast_calls == 2 * len(SLICES), "every shrink and expand took the fast path"
    assert not torch.equal(y_stock, base), "the adapter changed the output"
    assert ulps_apart(y_fast, y_stock) <= 1

    # the row-parallel layers' calls: add_shrink into a [slices, tokens, rank] fp32 buffer, then add_expand
    buffers = [torch.zeros(1, tokens, RANK, dtype=torch.float32) for _ in range(2)]
    for wrapper, buffer in zip((stock, fast), buffers, strict=True):
        wrapper.add_shrink(buffer, x, lora_a[:1], 1.0)
    torch.testing.assert_close(buffers[1], buffers[0], rtol=1e-6, atol=1e-6)
    outs = [base[:, :48].clone() for _ in range(2)]
    for wrapper, buffer, out in zip((stock, fast), buffers, outs, strict=True):
        wrapper.add_expand(out, buffer, lora_b[:1], (48,), offset_start=0, add_inputs=True)
    assert ulps_apart(outs[1], outs[0]) <= 1


def test_mixed_batches_and_the_base_model_take_vllms_path() -> None:
    for mapping in ([1, 1, 2, 2], [0, 0, 1], [0, 0, 0]):  # two adapters; base + adapter; base only
        stock, fast = wrappers(mapping)
        assert fast.single_slot is None, mapping
        lora_a, lora_b = stacked(torch.bfloat16, seed=3)
        x = torch.randn(len(mapping), HIDDEN).to(torch.bfloat16)
        y_stock, y_fast = (
            torch.zeros(len(mapping), sum(SLICES), dtype=torch.bfloat16),
            torch.zeros(len(mapping), sum(SLICES), dtype=torch.bfloat16),
        )
        stock.add_lora_linear(y_stock, x, lora_a, lora_b, 1.0, SLICES)
        fast.add_lora_linear(y_fast, x, lora_a, lora_b, 1.0, SLICES)
        assert fast.fast_calls == 0 and torch.equal(y_fast, y_stock), mapping  # vLLM's ops, bit for bit


def test_a_new_batch_mapping_replaces_the_slot() -> None:
    """vLLM updates one wrapper's mapping batch after batch: the fast path follows it (no stale slot)."""
    lora_a, lora_b = stacked(torch.bfloat16, seed=4)
    fast = SingleAdapterPunicaWrapperCPU(max_num_batched_tokens=256, max_batches=8, device="cpu")
    for mapping, slot in (([2] * 5, 1), ([1] * 9, 0), ([1, 2, 2], None), ([2] * 3, 1)):
        fast.update_metadata(LoRAMapping(mapping, mapping, is_prefill=True), [1, 2], MAX_LORAS, VOCAB)
        stock, _ = wrappers(mapping)
        assert fast.single_slot == slot, mapping
        x = torch.randn(len(mapping), HIDDEN).to(torch.bfloat16)
        y_stock, y_fast = (torch.zeros(len(mapping), sum(SLICES), dtype=torch.bfloat16) for _ in range(2))
        stock.add_lora_linear(y_stock, x, lora_a, lora_b, 1.0, SLICES)
        fast.add_lora_linear(y_fast, x, lora_a, lora_b, 1.0, SLICES)
        assert ulps_apart(y_fast, y_stock) <= 1, mapping


def test_per_expert_stacks_take_vllms_path() -> None:
    """A stacked weight that is not one [out, in] matrix per slot (e.g. experts on dim 1) is left to vLLM."""
    _, fast = wrappers([2] * 4)
    experts = torch.randn(MAX_LORAS, 3, RANK, HIDDEN)
    y = torch.zeros(4, RANK)
    try:
        fast._shrink_prefill(y, torch.randn(4, HIDDEN), experts, 1.0)
    except RuntimeError:
        pass  # vLLM's einsum refuses this layout; the point is that the fast path did not compute expert 0
    assert fast.fast_calls == 0


def test_the_plugin_installs_the_fast_path_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """What vLLM's start-up does: the plugin's register(), then the platform's wrapper looked up by name."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from orbit_runtime.rollout import vllm_cpu_lora, vllm_plugin

    original = CpuPlatform.__dict__["get_punica_wrapper"]
    monkeypatch.setenv("ORBIT_VLLM_CPU_MOE", "0")  # not what this test is about: keep vLLM's model registry as it is
    try:
        monkeypatch.setenv(vllm_cpu_lora.FAST_PATH_ENV, "0")
        vllm_plugin.register()
        assert resolve_obj_by_qualname(CpuPlatform.get_punica_wrapper()) is PunicaWrapperCPU
        monkeypatch.delenv(vllm_cpu_lora.FAST_PATH_ENV)
        vllm_plugin.register()
        assert resolve_obj_by_qualname(CpuPlatform.get_punica_wrapper()) is SingleAdapterPunicaWrapperCPU
        # an engine started later in the same process with it turned off (the suite starts in-process
        # engines before this test: register() has run here already) gets vLLM's own wrapper back
        monkeypatch.setenv(vllm_cpu_lora.FAST_PATH_ENV, "0")
        vllm_plugin.register()
        assert resolve_obj_by_qualname(CpuPlatform.get_punica_wrapper()) is PunicaWrapperCPU
    finally:
        CpuPlatform.get_punica_wrapper = original
