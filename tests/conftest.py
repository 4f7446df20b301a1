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


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on a loopback port: a real HTTP S3 endpoint (see tests/s3_endpoint.py)."""
    from moto.server import ThreadedMotoServer

    from tests.s3_endpoint import S3Endpoint

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield S3Endpoint(f"http://{host}:{port}")
    server.stop()


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """This process talks to moto: endpoint and test credentials in the environment."""
    for key, value in s3_endpoint.env().items():
        monkeypatch.setenv(key, value)
    return s3_endpoint
