"""Shared fixtures: the demo model and its INT4 copy are built once per test session, locally."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from orbit_runtime.demo_model import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("models") / "demo", seed=0)


@pytest.fixture(scope="session")
def int4_dir(demo_dir: Path) -> Path:
    from orbit_runtime.int4.quantize import quantize_checkpoint
    from orbit_runtime.int4.schemes import W4A16Int

    dst = demo_dir.parent / "demo-int4"
    quantize_checkpoint(demo_dir, dst, W4A16Int(group_size=128))
    return dst
