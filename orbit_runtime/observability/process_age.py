"""How long this process has been running, to the kernel's 10 ms tick.

psutil's create_time adds the process's start tick to the boot time, which Linux gives in whole
seconds (/proc/stat btime), so a duration measured from it is off by up to a second. Restart
timings (the resume record's `seconds_to_first_step`, benchmarks/recovery.py) are a few seconds
long, so they count from the start tick against the boot-time clock instead.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def process_age_seconds() -> float:
    """Seconds since this process started (Linux: /proc/self/stat; elsewhere psutil's create_time)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22, starttime: clock ticks after boot (fields[0] is field 3)
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, AttributeError):
        import psutil

        return time.time() - psutil.Process().create_time()
