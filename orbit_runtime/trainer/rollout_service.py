"""The rollout role as the learner sees it: a vLLM server that is restarted if it dies.

Every call to the engine goes through `call()`. If the request fails and the server process
is gone, the server is started again (at most `max_restarts` times over the run), the current
adapter version is loaded and verified on the new server, and the call is retried. A failure
while the server is alive is not a crash and is raised as is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

from orbit_runtime.observability import metrics
from orbit_runtime.rollout.client import RolloutClient
from orbit_runtime.rollout.server import VLLMServer, VLLMServerConfig
from orbit_runtime.sync.adapter_sync import AdapterSync

log = logging.getLogger(__name__)
T = TypeVar("T")


class RolloutDied(RuntimeError):
    """The rollout server died more often than the run allows."""


class RolloutService:
    def __init__(self, config: VLLMServerConfig, canary, tolerance: float, retries: int, max_restarts: int) -> None:
        self.config = config
        self.canary, self.tolerance, self.retries = canary, tolerance, retries
        self.max_restarts = max_restarts
        self.restarts = 0
        self.server: VLLMServer | None = None
        self.client: RolloutClient | None = None
        self.sync: AdapterSync | None = None
        self.sync_failures_before = 0  # canary failures on servers that died
        self.current: tuple[object, int, Path] | None = None  # (policy, version, path) last served

    def start(self) -> None:
        self.server = VLLMServer(self.config).start()
        self.client = RolloutClient(self.server.base_url)
        self.sync = AdapterSync(self.client, self.canary, self.tolerance, self.retries)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop()

    @property
    def served_name(self) -> str | None:
        return self.sync.served_name if self.sync else None

    @property
    def canary_failures(self) -> int:
        return self.sync_failures_before + (self.sync.failures if self.sync else 0)

    def _restart(self, reason: Exception) -> None:
        if self.restarts >= self.max_restarts:
            raise RolloutDied(
                f"rollout server died ({type(reason).__name__}: {reason}) and was already restarted "
                f"{self.restarts} time(s) (rollout.max_restarts); log {self.server.log_path}:\n{self.server.log_tail(20)}"
            ) from reason
        self.restarts += 1
        metrics.ROLLOUT_RESTARTS.inc()
        log.warning("rollout server is gone (%s); restarting (%d/%d)", reason, self.restarts, self.max_restarts)
        self.sync_failures_before += self.sync.failures
        self.stop()
        self.config.port = 0  # a fresh port: the old one may linger in TIME_WAIT
        self.start()
        if self.current is not None:
            policy, version, path = self.current
            self.sync.sync(policy, version, path)

    def call(self, fn: Callable[[RolloutClient], T], kind: str = "request") -> T:
        """Run FN against the engine, restarting a dead server and retrying. KIND labels its latency metric."""
        while True:
            try:
                with metrics.ROLLOUT_IN_FLIGHT.track_inprogress(), metrics.ROLLOUT_REQUEST_DURATION.labels(kind).time():
                    return fn(self.client)
            except (httpx.HTTPError, RuntimeError) as exc:
                if self.server.alive_after(grace_s=5.0):
                    raise
                self._restart(exc)

    def healthy(self) -> bool:
        """Does the engine answer its health check right now?"""
        client = self.client
        return client is not None and client.healthy()

    def publish(self, policy, version: int, path: Path):
        """Load and verify adapter VERSION (restarting a dead server on the way)."""
        result = self.call(lambda _client: self.sync.sync(policy, version, path), kind="sync")
        self.current = (policy, version, path)
        return result
