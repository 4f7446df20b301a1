"""process_age_seconds is exact to the kernel's tick, where psutil's create_time can be a second off."""

import subprocess
import sys
import time

from orbit_runtime.observability.process_age import process_age_seconds


def test_a_child_knows_when_it_started():
    before = time.time()
    child = subprocess.run(
        [sys.executable, "-c", "import time; from orbit_runtime.observability.process_age import process_age_seconds as a; "
         "print(time.time() - a())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    started = float(child.stdout)
    assert before - 0.05 <= started <= before + 0.5, (before, started)  # spawned right after `before`


def test_age_grows_with_the_wall_clock():
    first = process_age_seconds()
    time.sleep(0.3)
    assert 0.28 <= process_age_seconds() - first <= 0.4 and first > 0
