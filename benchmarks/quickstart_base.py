"""The quickstart's base as `make demo` builds it, for the benchmarks that run the quickstart's job."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def build_quickstart_base(work: Path, quiet: bool = False) -> tuple[Path, Path]:
    """WORK/base (the demo model after its 400-step warm-up, 16-bit) and WORK/base-int4 (its INT4 copy);
    built once: an existing INT4 copy is reused."""
    dense, int4 = work / "base", work / "base-int4"
    if not (int4 / "config.json").exists():
        orbit = [sys.executable, "-m", "orbit_runtime.cli"]
        for command in (["demo-model", str(dense), "--warmup-steps", "400", "--overwrite"],
                        ["quantize", str(dense), str(int4), "--overwrite"]):  # fmt: skip
            subprocess.run([*orbit, *command], check=True, capture_output=quiet)
    return dense, int4
