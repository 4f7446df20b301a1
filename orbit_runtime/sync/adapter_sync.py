"""Publish each adapter version atomically and load it into the rollout engine, verified.

Publishing writes the PEFT adapter into a temporary directory and renames it to
`<run>/adapters/v<N>`: a reader sees a complete version or none. Loading uses a name never
used before (`orbit-adapter-v<N>`, then `-retry<k>`), because vLLM caches adapters by name.
Verification scores a fixed canary batch with both engines; if the rollout's log-probs are
not within tolerance of the learner's, the new name is unloaded again (never served) and the
load is retried; after the last retry the step fails with SyncError. The previously verified
version stays served until a new one passes.

The learner's side of the canary is computed once per version, when the version is
published (`canary_expectations`), and kept with it: re-verifying a version later (after the
rollout server restarted) compares against what THAT version scored, not against the
learner's current weights, which may already be a newer version.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from orbit_runtime.atomic_dir import atomic_directory
from orbit_runtime.observability import metrics
from orbit_runtime.rollout.client import RolloutClient, adapter_name

Canary = list[tuple[list[int], list[int]]]


class SyncError(RuntimeError):
    """The rollout engine would not serve the learner's adapter within tolerance."""


def adapter_dir(adapters_root: Path, version: int) -> Path:
    """Where adapter version N lives (the one place that names it)."""
    return Path(adapters_root) / f"v{version}"


def publish_adapter(policy, adapters_root: Path, version: int) -> tuple[Path, int]:
    """Save the adapter as version VERSION atomically; returns (directory, bytes written)."""
    final = adapter_dir(adapters_root, version)
    with atomic_directory(final) as staging:
        policy.save_adapter(staging)
    size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
    return final, size


def prune_adapters(adapters_root: Path, newest: int, keep: int) -> None:
    """Delete published versions older than the newest KEEP (the served one and its successor)."""
    for old in range(1, newest - keep + 1):
        shutil.rmtree(adapter_dir(adapters_root, old), ignore_errors=True)


def canary_expectations(policy, canary: Canary) -> list[torch.Tensor]:
    """The learner's log-probs of the canary (T=1, dropout off): what the rollout must reproduce."""
    with policy.scoring():
        return [t.float().cpu() for t in policy.completion_logprobs(canary)]


@dataclass(frozen=True)
class SyncResult:
    version: int
    served_name: str
    seconds: float
    canary_mean_abs_dlogp: float
    attempts: int


class AdapterSync:
    """Loads published adapter versions into one vLLM server and verifies them on a canary batch."""

    def __init__(self, client: RolloutClient, canary: Canary, tolerance: float, retries: int) -> None:
        self.client = client
        self.canary = canary
        self.tolerance = tolerance
        self.retries = retries
        self.served_name: str | None = None
        self.failures = 0  # canary verifications that failed on this server

    def rollout_canary(self, name: str) -> list[torch.Tensor]:
        return [torch.tensor(self.client.score(p + c, model=name)[len(p) - 1 :]) for p, c in self.canary]

    def sync(self, version: int, path: Path, expected: list[torch.Tensor]) -> SyncResult:
        """Serve adapter VERSION from PATH, verified against EXPECTED (its canary_expectations)."""
        started = time.monotonic()
        last_delta = float("nan")
        for attempt in range(self.retries + 1):
            name = adapter_name(version) if attempt == 0 else f"{adapter_name(version)}-retry{attempt}"
            self.client.load_adapter(name, path)
            got = self.rollout_canary(name)
            last_delta = float(torch.cat([(a - b).abs() for a, b in zip(expected, got, strict=True)]).mean())
            if last_delta <= self.tolerance:
                previous, self.served_name = self.served_name, name
                if previous is not None:
                    self.client.unload_adapter(previous)
                return SyncResult(version, name, time.monotonic() - started, last_delta, attempt + 1)
            self.failures += 1
            metrics.SYNC_CANARY_FAILURES.inc()
            self.client.unload_adapter(name)  # never leave an unverified adapter loaded
        raise SyncError(
            f"adapter v{version} from {path}: rollout canary log-probs differ from the learner's by "
            f"{last_delta:.4f} (tolerance {self.tolerance}) after {self.retries + 1} attempts; "
            f"still serving {self.served_name or 'the base model'}"
        )
