"""vllm_cpu_idle: vLLM's shared-memory queue readers sleep on the notification instead of busy-polling.

A real SpinCondition pair (vLLM's class, a real zmq socket): right after a read, vLLM's reader
returns at once from `wait` (it spins, calling it again and again); with the cap at 0 it sleeps
until the writer notifies, or until the timeout."""

from __future__ import annotations

import threading
import time

import pytest

shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast", reason="needs vLLM")

from orbit_runtime.rollout import vllm_cpu_idle  # noqa: E402


@pytest.fixture
def pair(tmp_path, monkeypatch):
    """(reader, writer) SpinConditions on one notification socket, with vLLM's own `wait`; the
    process's `wait` restored afterwards. An earlier test in this process may have loaded Orbit's
    vLLM plugin, which installs the cap: the stock method is taken from under it."""
    import zmq

    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", vllm_cpu_idle.stock_wait())
    context = zmq.Context()
    address = f"ipc://{tmp_path / 'notify'}"
    writer = shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address=address)
    time.sleep(0.2)  # the SUB socket's subscription reaches the PUB side
    yield reader, writer
    context.destroy(linger=0)


def seconds_waiting(reader, timeout_ms: int) -> float:
    reader.record_read()
    started = time.monotonic()
    reader.wait(timeout_ms=timeout_ms)
    return time.monotonic() - started


def test_vllms_reader_spins_after_a_read_and_the_capped_one_sleeps_until_notified(pair) -> None:
    reader, writer = pair
    assert seconds_waiting(reader, timeout_ms=300) < 0.05  # vLLM's: a yield, then back to polling the buffer
    vllm_cpu_idle.install(0.0)
    assert seconds_waiting(reader, timeout_ms=300) >= 0.25  # capped: asleep on the socket, nothing was written
    threading.Timer(0.05, writer.notify).start()
    waited = seconds_waiting(reader, timeout_ms=5000)
    assert 0.04 <= waited < 2.0  # a write's notification wakes it


def test_installing_twice_wraps_vllms_wait_once(pair) -> None:
    stock = shm_broadcast.SpinCondition.wait
    vllm_cpu_idle.install(0.5)
    vllm_cpu_idle.install(0.0)
    assert shm_broadcast.SpinCondition.wait.__orbit_stock__ is stock
    reader, _ = pair
    assert seconds_waiting(reader, timeout_ms=300) >= 0.25  # the last cap holds


def test_the_window_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(vllm_cpu_idle.IDLE_SPIN_ENV, raising=False)
    assert vllm_cpu_idle.idle_spin_seconds() == 0.0
    monkeypatch.setenv(vllm_cpu_idle.IDLE_SPIN_ENV, "1")
    assert vllm_cpu_idle.idle_spin_seconds() == 1.0  # vLLM's own behaviour
    for bad in ("soon", "-1"):
        monkeypatch.setenv(vllm_cpu_idle.IDLE_SPIN_ENV, bad)
        with pytest.raises(ValueError, match=vllm_cpu_idle.IDLE_SPIN_ENV):
            vllm_cpu_idle.idle_spin_seconds()
