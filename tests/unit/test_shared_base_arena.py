"""The sealed arena and its transport, across real processes."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from orbit_runtime.shared_base.arena import Arena, build_arena, digest, is_sealed, map_arena
from orbit_runtime.shared_base.transport import ArenaReceiver, TransportError, send_arena


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "packed": torch.randint(-(2**31), 2**31 - 1, (4, 64), dtype=torch.int32, generator=generator),
        "scale": torch.rand(2, 32, generator=generator).to(torch.bfloat16),
        "norm": torch.ones(33, dtype=torch.float16),
        "empty": torch.empty(0, 8),
    }


def test_moving_makes_each_tensor_a_view_of_the_arena_with_the_same_values():
    tensors = _tensors()
    params = {k: torch.nn.Parameter(v.clone(), requires_grad=False) for k, v in tensors.items()}
    arena, mapped = build_arena(params.items(), move=True)
    for name, param in params.items():
        assert torch.equal(param, tensors[name])
        assert mapped.holds(param.data) or param.numel() == 0
    assert digest(mapped.tensors) == digest(tensors)
    arena.close()


def test_nobody_can_write_the_sealed_arena():
    arena, _ = build_arena(_tensors().items())
    assert is_sealed(arena.fd)
    with pytest.raises(PermissionError):
        mmap.mmap(arena.fd, arena.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(PermissionError):
        os.pwrite(arena.fd, b"x", 0)
    with pytest.raises(PermissionError):
        os.ftruncate(arena.fd, arena.size * 2)
    arena.close()


def test_an_in_place_write_to_a_mapped_view_faults_instead_of_changing_the_base():
    """The learner's views are read-only pages: `add_` on one kills the process (SIGSEGV) and the
    bytes stay as they were."""
    code = textwrap.dedent("""
        import os, sys, torch
        from orbit_runtime.shared_base.arena import build_arena
        arena, mapped = build_arena([("w", torch.zeros(64))])
        sys.stdout.write(str(arena.fd) + "\\n"); sys.stdout.flush()
        mapped.tensors["w"].add_(1.0)
        print("WROTE")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == -11, (result.returncode, result.stdout, result.stderr[-500:])
    assert "WROTE" not in result.stdout


def _send_from_child(path: str) -> None:
    arena, _ = build_arena(_tensors().items())
    send_arena(path, arena, {"pid": os.getpid()})


def test_the_arena_crosses_processes_as_a_descriptor_with_its_table():
    receiver = ArenaReceiver()
    child = multiprocessing.get_context("spawn").Process(target=_send_from_child, args=(receiver.path,))
    child.start()
    try:
        arena, meta = receiver.receive(timeout_s=60)
    finally:
        receiver.close()
    child.join(30)
    assert meta["pid"] == child.pid and child.exitcode == 0
    received = map_arena(arena)  # the sender is gone: the pages live on in the descriptor
    assert digest(received.tensors) == digest(_tensors())
    assert isinstance(arena, Arena)
    arena.close()


def test_a_receiver_nobody_sends_to_says_so():
    receiver = ArenaReceiver()
    with pytest.raises(TransportError, match="no process sent"):
        receiver.receive(timeout_s=0.2)
    receiver.close()
    assert not receiver.directory.exists()


def test_an_unsealed_memory_file_is_refused():
    fd = os.memfd_create("not-sealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    with pytest.raises(ValueError, match="not sealed"):
        map_arena(Arena(fd, 4096, []))
    os.close(fd)


def _mprotect_writable(tensor: torch.Tensor) -> int:
    """mprotect(PROT_READ | PROT_WRITE) on the pages under TENSOR: 0 if the kernel allowed it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    length = (tensor.data_ptr() + tensor.nbytes - start + page - 1) // page * page
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.mprotect(ctypes.c_void_p(start), ctypes.c_size_t(length), mmap.PROT_READ | mmap.PROT_WRITE)


def test_no_mapping_of_the_sealed_arena_can_be_made_writable_again():
    """Neither the moved tensors (the engine's) nor a later mapping (the learner's) can be mprotect-ed writable."""
    params = {"w": torch.nn.Parameter(torch.zeros(4096), requires_grad=False)}
    arena, _ = build_arena(params.items(), move=True)
    assert _mprotect_writable(params["w"].data) != 0
    assert _mprotect_writable(map_arena(arena).tensors["w"]) != 0
    arena.close()
    arena.close()  # closing twice is harmless (a restart path may)
