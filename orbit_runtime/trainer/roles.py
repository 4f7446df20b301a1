"""The roles the learner drives, as it sees them: the rollout engine (vLLM) and the reference
policy (its own server process, or the learner's base with the adapter off).

Every request to a role server goes through `call()`. If it fails and the server process is
gone, or still runs but fails its health check (vLLM shutting down after its engine died), the
server is started again (at most `max_restarts` times over the run) and the request is
retried; a failure while the server runs and answers is not a crash and is raised as is.
After a rollout restart, the adapter version that was being served is loaded again and
verified against the canary expectations kept for THAT version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import torch

from orbit_runtime.config.precision import vllm_dtype
from orbit_runtime.config.spec import NOISE_FLOOR_CEILING, JobSpec
from orbit_runtime.learner.micro_batches import NO_LIMITS, MicroBatchLimits, logprobs_in_micro_batches
from orbit_runtime.observability import metrics
from orbit_runtime.processes import ManagedServer
from orbit_runtime.reference.client import ReferenceClient, ReferenceServer
from orbit_runtime.rollout.client import RolloutClient
from orbit_runtime.rollout.server import VLLMServer, VLLMServerConfig
from orbit_runtime.sync.adapter_sync import AdapterSync, Canary, SyncError, SyncResult, canary_expectations, decode_canary

log = logging.getLogger(__name__)
T = TypeVar("T")


SHARED_GPU_MEMORY_UTILIZATION = 0.5  # vLLM's share of a GPU the learner also uses, unless the spec says otherwise


def rollout_server_config(spec: JobSpec, log_path: Path, learner_device: torch.device | None = None) -> VLLMServerConfig:
    """How the job's vLLM server is started: model, dtype, LoRA rank, lengths and the GPU settings.

    With the learner on CUDA and rollout.gpu_memory_utilization unset, vLLM gets
    SHARED_GPU_MEMORY_UTILIZATION instead of its 0.9: it would otherwise claim the GPU the
    learner needs for activations.
    """
    rollout = spec.rollout
    utilization = rollout.gpu_memory_utilization
    if utilization is None and learner_device is not None and learner_device.type == "cuda":
        utilization = SHARED_GPU_MEMORY_UTILIZATION
    return VLLMServerConfig(Path(spec.model.path), dtype=vllm_dtype(spec.model.dtype), max_lora_rank=spec.adapter.rank,
                            colocated=spec.placement == "colocated",
                            max_model_len=rollout.max_model_len, kv_cache_gib=rollout.kv_cache_gib, seed=spec.schedule.seed,
                            log_path=log_path, gpu_memory_utilization=utilization,
                            tensor_parallel_size=rollout.tensor_parallel_size,
                            enable_prefix_caching=rollout.enable_prefix_caching, max_num_seqs=rollout.max_num_seqs,
                            enforce_eager=rollout.enforce_eager, return_routed_experts=spec.moe.routing_replay)  # fmt: skip


@dataclass(frozen=True)
class ExternalRoles:
    """In a pod the roles are containers: the learner reaches them at URLs and publishes adapters
    into the volume the rollout reads. Unset: `orbit train` starts them as child processes."""

    rollout_url: str | None = None
    reference_url: str | None = None
    adapters_dir: Path | None = None
    wait_s: float = 600.0  # how long to wait for a role to answer (at start, or after it restarted)


class RoleDied(RuntimeError):
    """A role server died more often than the run allows."""


class SupervisedRole:
    """A role server restarted when it dies. Subclasses build the server and its client.

    With a URL the server is external (a container of the pod, restarted by the kubelet): it is
    waited for, never started; when it stops answering, the role waits for it to come back (at
    most `wait_s`), counts a restart, restores its state (`_after_restart`) and retries."""

    role = "role"

    def __init__(self, max_restarts: int, restarts_metric, url: str | None = None, wait_s: float = 600.0) -> None:
        self.max_restarts = max_restarts
        self.restarts = 0
        self.server: ManagedServer | None = None
        self.url, self.wait_s = url, wait_s
        self._restarts_metric = restarts_metric

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def healthy(self) -> bool:
        raise NotImplementedError

    def _after_restart(self) -> None:
        """Bring a fresh server back to the state the run expects (e.g. the served adapter)."""

    def lost_state(self) -> bool:
        """Has an external server restarted between two requests (it answers, but without what we gave it)?"""
        return False

    def wait_until_up(self) -> None:
        """Wait (at most wait_s) until the external server answers its health check."""
        deadline = time.monotonic() + self.wait_s
        while not self.healthy():
            if time.monotonic() > deadline:
                raise RoleDied(f"{self.role} at {self.url} did not answer its health check within {self.wait_s:.0f}s")
            time.sleep(1.0)

    def _count_restart(self, reason: Exception) -> None:
        if self.restarts >= self.max_restarts:
            where = f"at {self.url}" if self.url else f"log {self.server.log_path}:\n{self.server.log_tail(20)}"
            raise RoleDied(
                f"{self.role} server died ({type(reason).__name__}: {reason}) and was already restarted "
                f"{self.restarts} time(s) ({self.role}.max_restarts); {where}"
            ) from reason
        self.restarts += 1
        self._restarts_metric.inc()

    def _restart(self, reason: Exception) -> None:
        self._count_restart(reason)
        log.warning("%s server is gone (%s); restarting (%d/%d)", self.role, reason, self.restarts, self.max_restarts)
        self._recover()

    def _reconnect(self, reason: Exception) -> None:
        self._count_restart(reason)
        log.warning("%s at %s is not answering (%s); waiting for it to come back (%d/%d)", self.role, self.url, reason,
                    self.restarts, self.max_restarts)  # fmt: skip
        self._recover()  # a fresh client (the new server has none of the old one's adapters), once it answers

    def _recover(self) -> None:
        """A new server (or the external one back), then the run's state on it; each phase timed."""
        started = time.monotonic()
        self.stop()
        self.start()
        resync = time.monotonic()
        self._after_restart()
        metrics.ROLE_RECOVERY_DURATION.labels(self.role, "restart").observe(resync - started)
        metrics.ROLE_RECOVERY_DURATION.labels(self.role, "resync").observe(time.monotonic() - resync)

    def supervised(self, fn: Callable[[], T]) -> T:
        """Run FN, restarting (or waiting for) a dead server and retrying; a child server counts as dead
        when it has exited or fails its health check. A request the server closed without an answer
        (httpx.RemoteProtocolError: typically a keep-alive connection the server dropped just as the
        request went out) is sent again once before the server is suspected."""
        resent = False
        while True:
            try:
                return fn()
            except (httpx.HTTPError, RuntimeError) as exc:
                if isinstance(exc, RoleDied):
                    raise
                if isinstance(exc, httpx.RemoteProtocolError) and not resent:
                    resent = True
                    log.warning("%s closed a request without an answer (%s); sending it again", self.role, exc)
                    metrics.ROLE_REQUESTS_RESENT.labels(self.role).inc()
                    continue
                if self.url is not None:
                    if self.healthy() and not self.lost_state():  # it answers, as we left it: a real error
                        raise
                    try:
                        self._reconnect(exc)
                    except RoleDied:
                        raise
                    except (httpx.HTTPError, RuntimeError) as again:  # died again while being restored: next round
                        log.warning("%s failed again while being restored (%s)", self.role, again)
                    continue
                if self.server is None:
                    raise
                # a child that still runs and answers its health check: the request itself failed. One that
                # runs but does not answer (vLLM shutting down after its engine died) is as good as dead
                if self.server.alive_after(grace_s=5.0) and self.healthy():
                    raise
                self._restart(exc)


@dataclass(frozen=True)
class DecodeCanary:
    """The decode-path check at each sync: TOKENS seeded tokens sampled at TEMPERATURE per canary prompt."""

    tokens: int = 8
    temperature: float = 1.0
    seed: int = 0


class RolloutRole(SupervisedRole):
    """vLLM with verified adapter versions.

    TOLERANCE None: calibrated from the noise floor, which `calibrate` measures (the base
    model scored by both engines) before the first adapter is served."""

    role = "rollout"

    def __init__(self, config: VLLMServerConfig, canary: Canary, tolerance: float | None, retries: int, max_restarts: int,
                 url: str | None = None, wait_s: float = 600.0, decode: DecodeCanary | None = None) -> None:  # fmt: skip
        super().__init__(max_restarts, metrics.ROLLOUT_RESTARTS, url, wait_s)
        self.config = config
        self.canary, self.tolerance, self.retries = canary, tolerance, retries
        self.decode = decode
        self.noise_floor: float | None = None
        self._base_expected: list[torch.Tensor] | None = None
        self.client: RolloutClient | None = None
        self.sync: AdapterSync | None = None
        self.failures_before = 0  # canary failures on servers that died
        self.current: tuple[int, Path] | None = None  # (version, path) served
        self.after_restart_hooks: list[Callable[[], None]] = []  # run first after a restart (colocated: re-attach the base)
        self._expected: dict[int, list[torch.Tensor]] = {}  # canary expectations per published version

    def start(self) -> None:
        if self.url is not None:  # the pod's rollout container
            self.client = RolloutClient(self.url, api_key=self.config.api_key)
            self.wait_until_up()
        else:
            self.config.port = 0  # a fresh port: an old one may linger in TIME_WAIT
            self.server = VLLMServer(self.config).start()
            self.client = RolloutClient(self.server.base_url, api_key=self.config.api_key)
        self.sync = AdapterSync(self.client, self.canary, self.tolerance, self.retries)
        self.sync.noise_floor = self.noise_floor  # a restarted engine: the same dtype and machine

    def calibrate(self, policy, dtype: str) -> float:
        """Measure the canary's noise floor: POLICY's base (adapter off) vs vLLM's base model. Above the
        DTYPE's ceiling the engines do not compute the same model: SyncError, before any adapter."""
        self._base_expected = canary_expectations(policy, self.canary, base=True)
        floor = self.noise_floor = self.call(lambda _client: self.sync.measure_noise_floor(self._base_expected), kind="sync")
        ceiling = NOISE_FLOOR_CEILING[dtype]
        if floor > ceiling:
            raise SyncError(
                f"the rollout's base model differs from the learner's by {floor:.4f} mean |dlogp| on the canary before any "
                f"adapter (at most {ceiling} is arithmetic noise in {dtype}): vLLM serves another base or another dtype than "
                "the learner computes (model.path, model.dtype, model.learner_dtype)"
            )
        return floor

    def stop(self) -> None:
        if self.sync is not None:
            self.failures_before += self.sync.failures
            self.sync.failures = 0
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop()

    @property
    def started(self) -> bool:
        return self.sync is not None

    def _after_restart(self) -> None:
        for hook in self.after_restart_hooks:
            hook()
        if self.current is not None:
            version, path = self.current
            self.sync.sync(version, path, self._expected[version])

    def lost_state(self) -> bool:
        """The adapter we serve is gone from vLLM: the kubelet restarted it between two requests."""
        if self.current is None or self.sync is None or self.sync.served_name is None:
            return False
        try:
            return self.sync.served_name not in self.client.served_models()
        except (httpx.HTTPError, ValueError, KeyError):
            return True

    @property
    def served_name(self) -> str | None:
        return self.sync.served_name if self.sync else None

    @property
    def canary_failures(self) -> int:
        return self.failures_before + (self.sync.failures if self.sync else 0)

    def call(self, fn: Callable[[RolloutClient], T], kind: str = "request") -> T:
        """FN(client) against the engine (restarting it if it died); KIND labels the latency metric."""

        def attempt() -> T:
            with metrics.ROLLOUT_IN_FLIGHT.track_inprogress(), metrics.ROLLOUT_REQUEST_DURATION.labels(kind).time():
                return fn(self.client)

        return self.supervised(attempt)

    def watch_health(self, stop: threading.Event, interval_s: float = 5.0) -> None:
        """Keep orbit_rollout_up current between steps (a step may take minutes), until STOP is set."""

        def probe() -> None:
            while not stop.wait(interval_s):
                try:
                    up = self.healthy()
                except Exception:  # a client closed by a restart in between: down for this probe
                    up = False
                metrics.ROLLOUT_UP.set(1 if up else 0)

        threading.Thread(target=probe, name="rollout-probe", daemon=True).start()

    def healthy(self) -> bool:
        """Does the engine answer its health check right now?"""
        client = self.client
        return client is not None and client.healthy()

    @contextlib.contextmanager
    def kv_cache_released(self) -> Iterator[bool]:
        """While the learner updates: the engine frees its KV cache (colocated, GPU) and gets it back
        afterwards, before the next rollout. Yields whether anything was released (never on CPU)."""
        if not self.config.releases_kv_cache:
            yield False
            return
        self.call(lambda client: client.release_kv_cache(), kind="sleep")
        metrics.ROLLOUT_KV_CACHE_RELEASED.set(1)
        try:
            yield True
        finally:
            self.call(lambda client: client.wake_kv_cache(), kind="wake")
            metrics.ROLLOUT_KV_CACHE_RELEASED.set(0)

    def publish(self, policy, version: int, path: Path) -> SyncResult:
        """Serve adapter VERSION (POLICY's current weights, published at PATH), verified on the canary
        against this version and the one before (the base model before v1), then on the decode path."""
        t = time.monotonic()
        expected = canary_expectations(policy, self.canary)
        expected_s = time.monotonic() - t
        self._expected[version] = expected
        previous = self._expected.get(version - 1, self._base_expected if version == 1 else None)
        result = self.call(lambda _client: self.sync.sync(version, path, expected, previous), kind="sync")
        result = dataclasses.replace(result, expected_seconds=expected_s)
        self.current = (version, path)
        self._expected = {v: e for v, e in self._expected.items() if v >= version}
        if self.decode is not None:
            d = self.decode
            prompts = [prompt for prompt, _ in self.canary]
            t = time.monotonic()
            try:  # a measurement: the version is verified and served, its failure must not fail the step
                stats = self.call(lambda client: decode_canary(client, policy, prompts, self.served_name, tokens=d.tokens,
                                                               temperature=d.temperature, seed=d.seed), kind="canary")  # fmt: skip
            except (httpx.HTTPError, RuntimeError) as exc:
                if isinstance(exc, RoleDied):
                    raise
                log.warning("adapter v%d: the decode canary failed (%s: %s); not measured this step", version,
                            type(exc).__name__, exc)  # fmt: skip
                metrics.SYNC_CANARY_DECODE_FAILURES.inc()
            else:
                result = dataclasses.replace(result, decode=stats)
            result = dataclasses.replace(result, decode_seconds=time.monotonic() - t)
        return result


class ReferenceRole(SupervisedRole):
    """Reference log-probs. shared: the learner's base with the adapter off (no process);
    server: the reference server, supervised like the rollout."""

    role = "reference"

    def __init__(self, mode: str, policy, model_dir: Path, dtype: str, log_path: Path, max_restarts: int,
                 limits: MicroBatchLimits = NO_LIMITS, url: str | None = None, wait_s: float = 600.0,
                 api_key: str | None = None) -> None:  # fmt: skip
        super().__init__(max_restarts, metrics.REFERENCE_RESTARTS, url, wait_s)
        self.api_key = api_key
        self.mode = mode
        self.policy = policy
        self.limits = limits  # shared mode scores in the learner's micro-batches, on its device
        self.model_dir, self.dtype, self.log_path = model_dir, dtype, log_path
        self.client: ReferenceClient | None = None

    def healthy(self) -> bool:
        return self.client is not None and self.client.healthy()

    def start(self) -> None:
        if self.mode != "server":
            return
        if self.url is not None:  # the pod's reference container
            self.client = ReferenceClient(self.url, api_key=self.api_key)
            self.wait_until_up()
            return
        device = self.policy.device.type  # the reference server runs where the learner runs
        self.server = ReferenceServer(self.model_dir, self.dtype, self.log_path, self.limits.max_tokens, device,
                                      api_key=self.api_key).start()  # fmt: skip
        self.client = ReferenceClient(self.server.base_url, api_key=self.api_key)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop()

    def logprobs(self, pairs: Canary, temperature: float) -> list[torch.Tensor]:
        """Per-token reference log-probs of each completion at the sampling TEMPERATURE."""
        if self.mode != "server":
            with self.policy.scoring(), self.policy.adapter_disabled():
                rows = logprobs_in_micro_batches(self.policy, pairs, self.limits, temperature)
            return [row.float().cpu() for row in rows]
        return self.supervised(lambda: self.client.logprobs(pairs, temperature))
