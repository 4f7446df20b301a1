"""Publish each adapter version atomically and load it into the rollout engine, verified.

Publishing writes the PEFT adapter into a temporary directory and renames it to
`<run>/adapters/v<N>`: a reader sees a complete version or none. Loading uses a name never
used before (`orbit-adapter-v<N>`, then `-retry<k>`), because vLLM caches adapters by name.

Verification scores a fixed canary batch with both engines (vLLM's `prompt_logprobs`, the
prefill path). A fresh name alone does not prove fresh weights, so the check is
discriminating: the served log-probs must be within `tolerance` of version N's expectations
AND closer to N's than to N-1's (both distances are recorded). The tolerance comes from the
noise floor of this dtype and machine, measured when the engine starts (`noise_floor`: the
base model scored by both engines, where nothing but arithmetic differs). When N and N-1
are themselves closer than NOISE_MULTIPLE noise floors (late in a decaying schedule), no
check can tell them apart: the sync says so (a warning and
`orbit_sync_canary_inconclusive_total`) and passes on the tolerance alone. On failure the
new name is unloaded again (never served) and the load retried; after the last retry the
step fails with SyncError. The previously verified version stays served until a new one
passes.

The learner's side of the canary is computed once per version, when the version is
published (`canary_expectations`), and kept with it: re-verifying a version later (after the
rollout server restarted) compares against what THAT version scored, not against the
learner's current weights, which may already be a newer version.

`decode_canary` checks the path the loss uses: vLLM samples a short seeded continuation of
each canary prompt (decode log-probs, as in a rollout) and the learner recomputes them.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from orbit_runtime.algorithms.mismatch import MismatchStats, measure_mismatch
from orbit_runtime.atomic_dir import atomic_directory
from orbit_runtime.observability import metrics
from orbit_runtime.rollout.client import RolloutClient, adapter_name
from orbit_runtime.sync.memory_adapter import InMemoryAdapter, unstage

log = logging.getLogger(__name__)

Canary = list[tuple[list[int], list[int]]]

NOISE_MULTIPLE = 3.0  # tolerance and the smallest N vs N-1 separation a check can resolve, in noise floors
NOISE_MARGIN = 5e-3  # ... and the tolerance is at least the floor plus this (the LoRA path adds its own rounding)


class SyncError(RuntimeError):
    """The rollout engine would not serve the learner's adapter within tolerance."""


def adapter_dir(adapters_root: Path, version: int) -> Path:
    """Where adapter version N lives (the one place that names it)."""
    return Path(adapters_root) / f"v{version}"


def publish_adapter(policy, adapters_root: Path, version: int, dtype: torch.dtype | None = None) -> tuple[Path, int]:
    """Save the adapter as version VERSION atomically (in DTYPE: the one vLLM serves); returns (directory, bytes written)."""
    final = adapter_dir(adapters_root, version)
    with atomic_directory(final) as staging:
        policy.save_adapter(staging, dtype)
    size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
    return final, size


def prune_adapters(adapters_root: Path, newest: int, keep: int) -> None:
    """Delete published versions older than the newest KEEP (the served one and its successor)."""
    for old in range(1, newest - keep + 1):
        shutil.rmtree(adapter_dir(adapters_root, old), ignore_errors=True)


def canary_expectations(policy, canary: Canary, *, base: bool = False) -> list[torch.Tensor]:
    """The learner's log-probs of the canary (T=1, dropout off): what the rollout must reproduce.
    BASE: with the adapter disabled (what vLLM's base model must reproduce)."""
    with policy.scoring(), policy.adapter_disabled() if base else contextlib.nullcontext():
        return [t.float().cpu() for t in policy.completion_logprobs(canary)]


def mean_abs_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Mean |a - b| over all tokens of all canary sequences."""
    return float(torch.cat([(x - y).abs() for x, y in zip(a, b, strict=True)]).mean())


def calibrated_tolerance(noise_floor: float) -> float:
    """The canary tolerance for a measured noise floor: max(NOISE_MULTIPLE x floor, floor + NOISE_MARGIN)."""
    return max(NOISE_MULTIPLE * noise_floor, noise_floor + NOISE_MARGIN)


@dataclass(frozen=True)
class CanaryCheck:
    """One canary comparison of the served log-probs with version N's and N-1's expectations."""

    to_expected: float  # mean |served - expected(N)|
    to_previous: float | None  # mean |served - expected(N-1)|; None: N-1 unknown (first sync after a resume)
    separation: float | None  # mean |expected(N) - expected(N-1)|
    tolerance: float
    resolution: float  # the smallest separation this check resolves (NOISE_MULTIPLE noise floors)

    @property
    def conclusive(self) -> bool:
        """Do N and N-1 differ by more than the noise, so a stale adapter would show?"""
        return self.separation is not None and self.separation >= self.resolution

    @property
    def passed(self) -> bool:
        closer_to_new = not self.conclusive or self.to_expected < self.to_previous  # type: ignore[operator]
        return self.to_expected <= self.tolerance and closer_to_new

    @property
    def verdict(self) -> str:
        """verified | inconclusive (N and N-1 within the noise) | unchecked (no N-1 to compare) | failed."""
        if not self.passed:
            return "failed"
        if self.separation is None:
            return "unchecked"
        return "verified" if self.conclusive else "inconclusive"


def check_canary(expected: list[torch.Tensor], previous: list[torch.Tensor] | None, served: list[torch.Tensor],
                 tolerance: float, noise_floor: float | None) -> CanaryCheck:  # fmt: skip
    """Compare SERVED with EXPECTED (version N) and PREVIOUS (version N-1). Without a measured
    NOISE_FLOOR the resolution is half the tolerance."""
    resolution = NOISE_MULTIPLE * noise_floor if noise_floor is not None else tolerance / 2
    return CanaryCheck(
        to_expected=mean_abs_difference(expected, served),
        to_previous=None if previous is None else mean_abs_difference(previous, served),
        separation=None if previous is None else mean_abs_difference(expected, previous),
        tolerance=tolerance,
        resolution=resolution,
    )


@dataclass(frozen=True)
class SyncResult:
    version: int
    served_name: str
    seconds: float
    canary_mean_abs_dlogp: float  # served vs version N, prefill path
    attempts: int
    canary_previous_mean_abs_dlogp: float | None = None  # served vs version N-1
    canary_separation: float | None = None  # version N vs N-1 (what a stale adapter would show)
    canary_verdict: str = "unchecked"
    canary_tolerance: float | None = None
    decode: MismatchStats | None = None  # vLLM's decode log-probs vs the learner's on a seeded continuation
    expected_seconds: float | None = None  # the learner's canary log-probs of version N (before the load)
    decode_seconds: float | None = None  # the decode canary: vLLM samples, the learner scores


class AdapterSync:
    """Loads published adapter versions into one vLLM server and verifies them on a canary batch.

    TOLERANCE: the fixed `sync.tolerance`, or None to calibrate it from the noise floor
    (`measure_noise_floor`, which the rollout role runs when the engine starts)."""

    def __init__(self, client: RolloutClient, canary: Canary, tolerance: float | None, retries: int) -> None:
        self.client = client
        self.canary = canary
        self.fixed_tolerance = tolerance
        self.retries = retries
        self.noise_floor: float | None = None
        self.served_name: str | None = None
        self.failures = 0  # canary verifications that failed on this server
        self._in_memory: set[str] = set()  # names loaded from memory (placement colocated)

    def _unload(self, name: str) -> None:
        """Unload NAME from vLLM (and, if it came from memory, drop its staged tensors)."""
        self.client.unload_adapter(name)
        if name in self._in_memory:
            self._in_memory.discard(name)
            unstage(self.client, name)

    @property
    def tolerance(self) -> float:
        if self.fixed_tolerance is not None:
            return self.fixed_tolerance
        if self.noise_floor is None:
            raise RuntimeError("the canary tolerance is calibrated: measure_noise_floor() first")
        return calibrated_tolerance(self.noise_floor)

    def rollout_canary(self, name: str) -> list[torch.Tensor]:
        scores = self.client.score_many([p + c for p, c in self.canary], model=name)  # one request: one forward
        return [torch.tensor(row[len(p) - 1 :]) for (p, _), row in zip(self.canary, scores, strict=True)]

    def measure_noise_floor(self, base_expected: list[torch.Tensor]) -> float:
        """Mean |dlogp| of vLLM's base model vs the learner's base (BASE_EXPECTED, adapter off) on the
        canary: the arithmetic noise of this dtype and machine, with no adapter to be stale."""
        self.noise_floor = mean_abs_difference(base_expected, self.rollout_canary(self.client.base_model))
        metrics.SYNC_CANARY_NOISE_FLOOR.set(self.noise_floor)
        metrics.SYNC_CANARY_TOLERANCE.set(self.tolerance)
        return self.noise_floor

    def sync(self, version: int, path: Path | InMemoryAdapter, expected: list[torch.Tensor],
             previous: list[torch.Tensor] | None = None) -> SyncResult:  # fmt: skip
        """Serve adapter VERSION from PATH (a published directory, or an InMemoryAdapter), verified against EXPECTED (its canary_expectations) and,
        to tell it from a stale adapter, PREVIOUS (version N-1's)."""
        started = time.monotonic()
        check: CanaryCheck | None = None
        for attempt in range(self.retries + 1):
            name = self.client.fresh_name(adapter_name(version))  # never a name vLLM has cached weights for
            if isinstance(path, InMemoryAdapter):  # placement colocated: no files
                path.load(self.client, name)
                self._in_memory.add(name)
            else:
                self.client.load_adapter(name, path)
            check = check_canary(expected, previous, self.rollout_canary(name), self.tolerance, self.noise_floor)
            if check.passed:
                old, self.served_name = self.served_name, name
                if old is not None:
                    self._unload(old)
                if check.verdict == "inconclusive":
                    metrics.SYNC_CANARY_INCONCLUSIVE.inc()
                    log.warning(
                        "adapter v%d: the canary cannot tell it from v%d (they differ by %.2e, the check resolves %.2e): "
                        "served on its fresh name alone", version, version - 1, check.separation, check.resolution,
                    )  # fmt: skip
                return SyncResult(version, name, time.monotonic() - started, check.to_expected, attempt + 1,
                                  check.to_previous, check.separation, check.verdict, check.tolerance)  # fmt: skip
            self.failures += 1
            metrics.SYNC_CANARY_FAILURES.inc()
            self._unload(name)  # never leave an unverified adapter loaded
        assert check is not None
        stale = check.conclusive and not check.to_expected < check.to_previous  # type: ignore[operator]
        why = (
            f"closer to v{version - 1}'s log-probs ({check.to_previous:.4f}) than to v{version}'s ({check.to_expected:.4f}): "
            "the rollout serves a stale adapter"
            if stale
            else f"differ from the learner's by {check.to_expected:.4f} (tolerance {check.tolerance:.4f})"
        )
        raise SyncError(
            f"adapter v{version} from {path if isinstance(path, Path) else 'memory'}: rollout canary log-probs {why} after {self.retries + 1} attempts; "
            f"still serving {self.served_name or 'the base model'}"
        )


def decode_canary(client: RolloutClient, policy, prompts: list[list[int]], model: str, *, tokens: int,
                  temperature: float, seed: int) -> MismatchStats:  # fmt: skip
    """vLLM samples TOKENS seeded tokens after each canary prompt under MODEL (decode log-probs, as in a
    rollout); the learner (POLICY, at the served version) scores the same tokens at TEMPERATURE."""
    groups = client.generate(prompts, model=model, n=1, max_tokens=tokens, temperature=temperature,
                             seed=[seed + i for i in range(len(prompts))], ignore_eos=True)  # fmt: skip
    completions = [g[0] for g in groups]
    with policy.scoring():
        learner = policy.completion_logprobs([(c.prompt_ids, c.token_ids) for c in completions], temperature=temperature)
    return measure_mismatch([row.float().cpu() for row in learner], [torch.tensor(c.logprobs) for c in completions])
