"""pytest fixtures (import them into a conftest.py: ``from tests.kube.emulator import kube, kube_server``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .resources import ORBIT_CRD
from .server import KubeEmulator

# --- pytest fixtures (import them into a conftest.py: ``from tests.kube.emulator import kube, kube_server``) ----


@pytest.fixture
def kube_server() -> Iterator[KubeEmulator]:
    """A bare emulator (built-in resources only), stopped at the end of the test."""
    with KubeEmulator() as emulator:
        yield emulator


@pytest.fixture
def kube(kube_server: KubeEmulator, tmp_path: Path) -> KubeEmulator:
    """The emulator with the RLTrainingJob CRD loaded and a kubeconfig at ``kube.kubeconfig`` (in tmp_path)."""
    kube_server.load_crd(ORBIT_CRD)
    kube_server.write_kubeconfig(tmp_path / "kubeconfig")
    return kube_server
