"""Fixtures for the end-to-end tests: the emulated API server (tests/kube/emulator/) and a
test node that runs its pods as sandboxed processes (tests/e2e/node.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.node import ProcessNode
from tests.kube.emulator import KubeEmulator, kube, kube_server  # noqa: F401


@pytest.fixture
def node(kube: KubeEmulator, tmp_path: Path) -> Iterator[ProcessNode]:  # noqa: F811
    """A node running the emulator's pods, stopped (its processes ended) at the end of the test."""
    with ProcessNode(kube, tmp_path / "node") as running:
        yield running
