"""Stage 1 of the colocated placement, on a real vLLM server (CPU build): one base in memory.

The learner maps the engine's own weight tensors (the same memory file, checked in both
processes' /proc/PID/maps), computes an INT4 linear with vLLM's kernel on them bitwise
equal to what vLLM's layer computes, and its input gradient matches an independent
reference: the compressed-tensors checkpoint on disk, dequantized by Orbit's own code.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
import torch

from orbit_runtime.int4.packing import dequantize_int4
from orbit_runtime.learner.colocated_base import SharedInt4Projection, build_colocated_base
from orbit_runtime.rollout.client import RolloutClient
from orbit_runtime.rollout.server import VLLMServer, VLLMServerConfig
from orbit_runtime.shared_base.arena import is_sealed
from orbit_runtime.shared_base.attach import attach_shared_base

from .conftest import API_KEY

pytestmark = pytest.mark.vllm

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def colocated_engine(request, int4_dir, tmp_path_factory):
    """A colocated-mode vLLM server and the learner's attachment to its base."""
    log = tmp_path_factory.mktemp("logs") / f"vllm-colocated-{request.param}.log"
    config = VLLMServerConfig(Path(int4_dir), dtype=request.param, max_lora_rank=8, log_path=log, api_key=API_KEY,
                              colocated=True)  # fmt: skip
    with VLLMServer(config) as server:
        client = RolloutClient(server.base_url, api_key=API_KEY)
        # the engine generates before anything of Orbit's ran in its worker (bf16 on AMX: the plugin's enable_amx)
        assert len(client.generate([[5, 6, 7]], n=2, max_tokens=4, seed=0)[0]) == 2
        attached = attach_shared_base(client, timeout_s=120)
        yield request.param, client, attached, server
        attached.close()
        client.close()


def _memfd_inodes(pid: int) -> set[int]:
    """Inodes of the memfd mappings named orbit-base in process PID."""
    inodes = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and "memfd:orbit-base" in fields[5]:
            inodes.add(int(fields[4]))
    return inodes


def vllm_output(client: RolloutClient, name: str, rows: int, seed: int) -> tuple[torch.Tensor, int]:
    """vLLM's output of linear NAME on a seeded input, and the number of threads its worker computed it with."""
    (result,) = client.collective_rpc("orbit_linear_output", name, str(rows), str(seed))
    raw = torch.frombuffer(bytearray(base64.b64decode(result["data"])), dtype=torch.uint8)
    return raw.view(DTYPES[result["dtype"]]).view(result["shape"]), result["threads"]


def test_the_learner_maps_the_engines_own_weight_pages(colocated_engine):
    _, _, attached, server = colocated_engine
    worker = attached.meta["pid"]
    assert worker != os.getpid()
    assert attached.arena.inode in _memfd_inodes(worker), "vLLM's worker does not map the shared memory file"
    assert attached.arena.inode in _memfd_inodes(os.getpid()), "the learner does not map the shared memory file"
    assert is_sealed(attached.arena.fd)
    packed = attached.tensors["model.layers.0.self_attn.qkv_proj.weight_packed"]
    assert attached.mapped.holds(packed) and packed.dtype == torch.int32
    # the engine keeps serving from the moved weights
    assert RolloutClient.healthy(RolloutClient(server.base_url, api_key=API_KEY))


@pytest.mark.parametrize("name", ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"])
def test_the_learners_int4_linear_is_vllms_output_bitwise(colocated_engine, name):
    dtype_name, client, attached, _ = colocated_engine
    key = f"model.layers.0.{name}"
    shared = attached.tensors
    projection = SharedInt4Projection(key, shared[key + ".weight_packed"], shared[key + ".weight_scale"],
                                      shared.get(key + ".bias"), attached.meta["isa_hint"], consumers=1)  # fmt: skip
    expected, worker_threads = vllm_output(client, key, rows=7, seed=3)
    x = torch.randn(7, projection.in_features, generator=torch.Generator().manual_seed(3)).to(DTYPES[dtype_name])
    own_threads = torch.get_num_threads()
    torch.set_num_threads(worker_threads)  # the kernel may split its sums by thread: the same split as the worker's
    try:
        got = projection.output_for(x)
    finally:
        torch.set_num_threads(own_threads)
    differ = (got != expected).sum().item()
    assert differ == 0, (f"{differ} of {got.numel()} outputs differ (max |diff| {(got.float() - expected.float()).abs().max():.3g}; "
                         f"{worker_threads} threads; {projection!r}; CPU flags "
                         f"{sorted({f for f in Path('/proc/cpuinfo').read_text().split() if f.startswith(('avx512', 'amx'))})})")  # fmt: skip


def test_the_input_gradient_matches_the_checkpoint_dequantized(colocated_engine, int4_dir):
    """dX from the colocated backward (dequantized from vLLM's layout) vs dY @ W with W from the
    compressed-tensors checkpoint on disk (Orbit's own dequantization: an independent path)."""
    from safetensors.torch import load_file

    dtype_name, _, attached, _ = colocated_engine
    dtype = DTYPES[dtype_name]
    disk = load_file(Path(int4_dir) / "model.safetensors")
    key = "model.layers.0.mlp.down_proj"
    shared = attached.tensors
    projection = SharedInt4Projection(key, shared[key + ".weight_packed"], shared[key + ".weight_scale"], None,
                                      attached.meta["isa_hint"], consumers=1)  # fmt: skip
    weight = dequantize_int4(disk[key + ".weight_packed"], disk[key + ".weight_scale"], projection.in_features, torch.float32)
    x = torch.randn(5, projection.in_features, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    grad_y = torch.randn(5, projection.out_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    projection.output_for(x).backward(grad_y)
    reference = grad_y.float() @ weight
    tolerance = {"bfloat16": 2e-2, "float16": 2e-3}[dtype_name]
    torch.testing.assert_close(x.grad.float(), reference, rtol=tolerance, atol=tolerance)
    # and the forward uses the same W the backward dequantizes
    torch.testing.assert_close(projection.dequantized_weight(), weight, rtol=0, atol=0)


def test_the_whole_learner_base_is_built_on_views_of_the_shared_pages(colocated_engine, int4_dir):
    dtype_name, _, attached, _ = colocated_engine
    model = build_colocated_base(Path(int4_dir), DTYPES[dtype_name], attached.tensors, attached.meta["isa_hint"])
    outside = {n for n, t in [*model.named_parameters(), *model.named_buffers()] if not attached.mapped.holds(t)}
    assert outside and all("rotary_emb" in n for n in outside), outside  # only the rotary tables are the learner's own
    assert not any(p.requires_grad for p in model.parameters())
