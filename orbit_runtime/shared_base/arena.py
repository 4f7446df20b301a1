"""A sealed, read-only memory file holding named tensors: the base as both processes map it.

`build_arena` copies tensors into an anonymous memory file (`memfd_create`) and seals it
against writes, growth and shrinking (`F_SEAL_FUTURE_WRITE | F_SEAL_GROW | F_SEAL_SHRINK`,
once its one writable mapping is closed): from then on no process can map it writable or
write to it, not the rollout engine that made it, not the learner; every mapping of it is
read-only, so a stray in-place op faults instead of changing the base. `map_arena` maps the file read-only
and returns tensors that are views of that one mapping. Every process that maps the same
file shares the same physical pages (one copy; `/proc/PID/smaps` counts them once across
processes as proportional set size).
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
import torch

ALIGNMENT = 256  # bytes between tensors: aligned for any SIMD load the kernels do
F_SEAL_FUTURE_WRITE = 0x0010  # Linux >= 5.1; not in Python's fcntl module
# No new writable mapping, no write(), no resizing, no change to the seals. (F_SEAL_WRITE would
# also refuse while a read-only shared mapping exists, and the engine's views are one.)
SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.int32, torch.uint8, torch.int8, torch.int64,
                                                     torch.bfloat16, torch.float16, torch.float32)}  # fmt: skip


@dataclass(frozen=True)
class ArenaEntry:
    """Where one tensor lies in the arena."""

    name: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return DTYPES[self.dtype].itemsize * int(torch.Size(self.shape).numel())


@dataclass
class Arena:
    """An open, sealed arena: its file descriptor, size and table of contents."""

    fd: int
    size: int
    entries: list[ArenaEntry]

    @property
    def inode(self) -> int:
        """Identifies the memory file: equal in every process that holds it."""
        return os.fstat(self.fd).st_ino

    def table(self) -> list[dict]:
        return [asdict(e) for e in self.entries]

    def close(self) -> None:
        """Close the descriptor (once; a second call does nothing)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """TENSOR's bytes as a uint8 numpy view (contiguous CPU tensors: no copy)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def memcpy_clone(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU tensor made by one memcpy (numpy), not by a torch op. Hundreds of small
    torch copies each wake torch's intra-op thread pool; on a busy 2-core machine that turned
    an adapter's few MB into a second."""
    return torch.from_numpy(raw_bytes(tensor).copy()).view(tensor.dtype).view(tensor.shape)


def _aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[ArenaEntry], int]:
    entries, offset = [], 0
    for name, tensor in tensors:
        if tensor.device.type != "cpu":
            raise ValueError(f"{name}: the shared base holds CPU tensors only, not {tensor.device}")
        if str(tensor.dtype).removeprefix("torch.") not in DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be shared")
        entries.append(ArenaEntry(name, offset, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
        offset = _aligned(offset + tensor.nbytes)
    return entries, max(offset, ALIGNMENT)


def build_arena(tensors: Iterable[tuple[str, torch.Tensor]], label: str = "orbit-base", *,
                move: bool = False) -> tuple[Arena, MappedArena]:  # fmt: skip
    """Copy named CPU TENSORS into a new sealed memory file; returns it and its read-only mapping.

    MOVE: each tensor (typically a Parameter) becomes a view of the read-only mapping right
    after its copy (`tensor.data = view`), so its old storage is freed as the copy proceeds:
    the peak is the base plus one tensor, not two bases.
    """
    tensors = list(tensors)
    entries, size = _layout(tensors)
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        arena = Arena(fd, size, entries)
        mapped = _map(arena)
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as writable:
            target = np.frombuffer(writable, dtype=np.uint8)  # copies by memcpy (see memcpy_clone)
            for (_, tensor), entry in zip(tensors, entries, strict=True):
                if entry.nbytes:
                    target[entry.offset : entry.offset + entry.nbytes] = raw_bytes(tensor)
                if move:
                    tensor.data = mapped.tensors[entry.name]
            del target  # the writable mapping can close only once nothing views it
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        # A mapping made before the seal could still be made writable (mprotect); one made after it
        # cannot. The moved tensors move once more, onto the sealed mapping; the first one goes.
        mapped = _map(arena)
        if move:
            for (_, tensor), entry in zip(tensors, entries, strict=True):
                tensor.data = mapped.tensors[entry.name]
    except BaseException:
        os.close(fd)
        raise
    return arena, mapped


def is_sealed(fd: int) -> bool:
    """Can no process ever write, grow or shrink this memory file?"""
    return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS


@dataclass
class MappedArena:
    """The arena's tensors as views of one read-only mapping that starts at ADDRESS."""

    tensors: dict[str, torch.Tensor]
    address: int
    size: int

    def holds(self, tensor: torch.Tensor) -> bool:
        """Does TENSOR's memory lie inside this mapping (a view of it, not a copy)?"""
        start = tensor.data_ptr()
        return self.address <= start and start + tensor.nbytes <= self.address + self.size


def map_arena(arena: Arena) -> MappedArena:
    """The arena's tensors, as views of one read-only mapping of its file (sealed, or refused)."""
    if not is_sealed(arena.fd):
        raise ValueError("the shared base's memory file is not sealed against writes: refusing to map it")
    return _map(arena)


def _map(arena: Arena) -> MappedArena:
    mapping = mmap.mmap(arena.fd, arena.size, mmap.MAP_SHARED, mmap.PROT_READ)
    with warnings.catch_warnings():  # "the given buffer is not writable": that is the point
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mapping, dtype=torch.uint8)
    views = {}
    for entry in arena.entries:
        raw = flat[entry.offset : entry.offset + entry.nbytes]
        views[entry.name] = raw.view(DTYPES[entry.dtype]).view(entry.shape)
    return MappedArena(views, flat.data_ptr(), arena.size)


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """blake2b of every tensor's bytes, in name order: equal before and after a run iff nothing wrote."""
    hasher = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        tensor = tensors[name]
        hasher.update(name.encode())
        if tensor.numel():
            hasher.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return hasher.hexdigest()
