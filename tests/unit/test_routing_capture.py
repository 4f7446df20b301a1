"""The CPU build's routed-experts bookkeeping (rollout/routing_capture.py): per request, rows of the
positions forwarded, emitted once each, in order, whatever the steps' shapes."""

from __future__ import annotations

import numpy as np
import pytest

from orbit_runtime.rollout.routing_capture import RequestRoutingLog, StepRows


def _rows(positions: list[int]) -> np.ndarray:
    """Rows whose value encodes the position, [n, layers=2, k=2]."""
    return np.array([[[p, p], [p, p]] for p in positions], dtype=np.uint8)


def _step(requests: dict[str, list[int]]) -> StepRows:
    ids = list(requests)
    counts = [len(v) for v in requests.values()]
    return StepRows(ids, np.array([v[0] for v in requests.values()]), np.concatenate([[0], np.cumsum(counts)]),
                    _rows([p for v in requests.values() for p in v]))  # fmt: skip


def test_prefill_then_decode_steps_emit_each_position_once():
    log = RequestRoutingLog((2, 2), np.uint8)
    log.record(_step({"a": [0, 1, 2], "b": [0, 1]}))
    start, rows = log.emit("a")
    assert start == 0 and rows[:, 0, 0].tolist() == [0, 1, 2]
    log.record(_step({"a": [3], "b": [2]}))  # b's prefill was chunked: it emits both steps together
    start, rows = log.emit("b")
    assert start == 0 and rows[:, 0, 0].tolist() == [0, 1, 2]
    start, rows = log.emit("a")
    assert start == 3 and rows[:, 0, 0].tolist() == [3]
    assert log.peek("a") is None


def test_a_preempted_request_recomputing_positions_records_them_once():
    log = RequestRoutingLog((2, 2), np.uint8)
    log.record(_step({"a": [0, 1, 2]}))
    log.emit("a")
    log.record(_step({"a": [0, 1, 2, 3]}))  # recomputed from scratch after a preemption, plus one new
    start, rows = log.emit("a")
    assert start == 3 and rows[:, 0, 0].tolist() == [3]


def test_a_position_never_forwarded_is_marked_not_fatal(caplog):
    log = RequestRoutingLog((2, 2), np.uint8)
    log.record(_step({"a": [0, 1]}))
    log.record(_step({"a": [5]}))
    start, rows = log.emit("a")
    assert start == 0 and rows[:, 0, 0].tolist() == [0, 1, 255, 255, 255, 5]  # every position has a row (vLLM asserts it)
    assert "prefix caching" in caplog.text


def test_a_request_whose_first_positions_were_never_forwarded_is_marked_too():
    log = RequestRoutingLog((2, 2), np.uint8)
    log.record(_step({"a": [2, 3]}))  # positions 0 and 1 came from a cached prefix
    start, rows = log.emit("a")
    assert start == 0 and rows[:, 0, 0].tolist() == [255, 255, 2, 3]


def test_finished_requests_are_forgotten():
    log = RequestRoutingLog((2, 2), np.uint8)
    log.record(_step({"a": [0]}))
    log.finish({"a", "unknown"})
    assert log.requests == {}


def test_the_cpu_server_turns_prefix_caching_off_and_the_capture_on_for_replay():
    from pathlib import Path

    from orbit_runtime.errors import OrbitError
    from orbit_runtime.rollout.server import ROUTING_ENV, VLLMServerConfig, is_cpu_build

    assert is_cpu_build()  # this suite runs vLLM's CPU build
    config = VLLMServerConfig(Path("model"), return_routed_experts=True)
    assert "--no-enable-prefix-caching" in config.command(8000) and config.environment()[ROUTING_ENV] == "1"
    assert "--no-enable-prefix-caching" not in VLLMServerConfig(Path("model")).command(8000)
    with pytest.raises(OrbitError, match="enable_prefix_caching"):
        VLLMServerConfig(Path("model"), return_routed_experts=True, enable_prefix_caching=True).command(8000)
