"""learner.pin_malloc_threshold with glibc itself: after a large free, glibc (left alone) serves the
next 8 MiB block from its heap, where freeing it keeps the memory; with the threshold pinned it is
mmapped, so freeing it gives the memory back. Each case in a fresh process (the threshold is per process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import ctypes, json, sys
from orbit_runtime.learner.allocator import pin_mmap_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
pinned = pin_mmap_threshold() if sys.argv[1] == "pin" else None
libc.free(libc.malloc(20 << 20))  # a large free: glibc raises its threshold to 20 MiB unless pinned
block = libc.malloc(8 << 20)
print(json.dumps({"pinned": pinned, "mmapped_bytes": libc.mallinfo2().hblkhd}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_a_pinned_threshold_keeps_a_block_glibc_would_heap_in_its_own_mapping():
    left_alone, pinned = _probe("default"), _probe("pin")
    assert left_alone["mmapped_bytes"] < 8 << 20  # the 8 MiB block came from the heap: its free would keep it
    assert pinned["pinned"] is True and pinned["mmapped_bytes"] >= 8 << 20  # mmapped: its free returns it
