"""Give freed activation memory back to the OS: pin glibc's mmap threshold.

glibc serves allocations above its mmap threshold (128 KiB) with mmap and returns them to the OS
on free, but after a large free it raises the threshold (up to 32 MiB) so that later blocks of
that size come from the heap, where a free keeps them. A training step frees and reallocates
per-layer temporaries of tens of MiB, so the learner's resident memory grows to what the
allocator retains, not what tensors hold (benchmarks/memory.py measures the learner's step peak
both ways; the README's table has the figures). Pinning it (mallopt's
M_MMAP_THRESHOLD, which also turns the dynamic adjustment off; the same as starting the process
with MALLOC_MMAP_THRESHOLD_=4194304) costs mmap/munmap calls and page faults for the blocks above
it; the benchmark records the step time both ways.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)
M_MMAP_THRESHOLD = -3  # <malloc.h>
# Blocks from 4 MiB up are mmapped and given back on free: a step's big temporaries (a layer's
# activations, tens of MiB and more at RL sizes) go back to the OS, while the many small ones are
# reused from the heap. Pinned at glibc's own starting value (128 KiB) instead, every block above
# 128 KiB is a fresh mmap and page faults: measured on the quickstart's model (2 AVX2 cores),
# its update took 2.1 s at 128 KiB, 2.1 s at 1 MiB, 1.1-1.4 s at 4 MiB, 1.0-1.2 s left to glibc.
DEFAULT_THRESHOLD = 4 << 20


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
