"""Give freed activation memory back to the OS: pin glibc's mmap threshold.

glibc serves allocations above its mmap threshold (128 KiB) with mmap and returns them to the OS
on free, but after a large free it raises the threshold (up to 32 MiB) so that later blocks of
that size come from the heap, where a free keeps them. A training step frees and reallocates
per-layer temporaries of tens of MiB, so the learner's resident memory grows to what the
allocator retains, not what tensors hold (benchmarks/memory.py measures the learner's step peak
both ways; the README's table has the figures). Pinning it (mallopt's
M_MMAP_THRESHOLD, which also turns the dynamic adjustment off; the same as starting the process
with MALLOC_MMAP_THRESHOLD_=131072) costs mmap/munmap calls for those blocks; the benchmark
records the step time both ways.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)
M_MMAP_THRESHOLD = -3  # <malloc.h>
DEFAULT_THRESHOLD = 128 * 1024  # glibc's own starting value


def pin_mmap_threshold(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at THRESHOLD bytes for this process; False where it is not glibc (musl, macOS)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, threshold) == 1
    if not done:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d) failed: the learner's memory may grow with glibc's dynamic threshold", threshold)
    return done
