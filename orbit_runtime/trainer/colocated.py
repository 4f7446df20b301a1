"""placement: colocated, as the RL loop sees it: the learner's hold on the rollout engine's base.

`ColocatedBase.attach` receives the engine's arena (`shared_base/attach.py`) and checks it:
sealed, one worker, and one INT4 linear computed by the learner bitwise equal to the
engine's own output for the same input (same kernel, same bytes). After the engine
restarts, `reattach` does the same with the new engine, refuses a base whose bytes differ
from the first one's (digest), points the learner's views at the new pages and lets the
old ones go. `unchanged` re-digests the base at the end of the run: nothing wrote to it.
"""

from __future__ import annotations

import base64
import logging
import time
from pathlib import Path

import torch

from orbit_runtime.errors import OrbitError
from orbit_runtime.learner.colocated_base import SharedInt4Projection, rebind_colocated_base
from orbit_runtime.observability import metrics
from orbit_runtime.shared_base.attach import AttachedBase, attach_shared_base

log = logging.getLogger(__name__)

CHECK_LINEAR = "model.layers.0.self_attn.qkv_proj"  # the INT4 linear compared bitwise at each attach
CHECK_ROWS, CHECK_SEED = 4, 1234


def _decode(result: dict) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(base64.b64decode(result["data"])), dtype=torch.uint8)
    return raw.view(getattr(torch, result["dtype"])).view(result["shape"])


class ColocatedBase:
    """The learner's attachment to the engine of ROLLOUT (a RolloutRole) for the base at MODEL_DIR."""

    def __init__(self, rollout, model_dir: Path, timeout_s: float = 300.0) -> None:
        self.rollout, self.model_dir, self.timeout_s = rollout, Path(model_dir), timeout_s
        self.attached: AttachedBase | None = None
        self.first_digest: str | None = None
        self.attaches = 0
        self.engine_on_shared_pages: bool | None = None  # at the end of the run (final_check)

    def _receive(self) -> AttachedBase:
        """The engine's base, mapped here; refused if its bytes differ from the first attach's."""
        started = time.monotonic()
        attached = self.rollout.call(lambda client: attach_shared_base(client, self.timeout_s), kind="attach")
        digest = attached.digest()
        if self.first_digest is None:
            self.first_digest = digest
        elif digest != self.first_digest:
            attached.close()
            raise OrbitError(
                "the restarted rollout engine serves another base than the run started with (its weights' digest "
                f"{digest} != {self.first_digest}): model.path changed under the run"
            )
        self.attaches += 1
        metrics.SHARED_BASE_BYTES.set(attached.arena.size)
        metrics.SHARED_BASE_ATTACHES.inc()
        metrics.SHARED_BASE_ATTACH_DURATION.observe(time.monotonic() - started)
        return attached

    def attach(self) -> AttachedBase:
        """The first attach (the policy is built on what it returns, then `commit`ted with verify)."""
        return self._receive()

    def commit(self, attached: AttachedBase, model: torch.nn.Module) -> None:
        """MODEL now computes on ATTACHED: verify it, then keep it (closing the previous one)."""
        self.verify(model)
        previous, self.attached = self.attached, attached
        if previous is not None and previous is not attached:
            previous.close()

    def verify(self, model: torch.nn.Module) -> None:
        """The engine computes from the shared pages, and MODEL's CHECK_LINEAR equals the engine's own
        output bitwise (OrbitError if either does not hold)."""
        projection = next((m for m in model.modules() if isinstance(m, SharedInt4Projection) and m.key == CHECK_LINEAR), None)
        if projection is None:
            raise OrbitError(f"the learner's model has no {CHECK_LINEAR}")
        (stray,) = self.rollout.call(lambda client: client.collective_rpc("orbit_stray_parameters"), kind="attach")
        if stray:
            raise OrbitError(f"the rollout engine no longer computes from the shared base: {stray[:3]} were replaced")
        (result,) = self.rollout.call(
            lambda client: client.collective_rpc("orbit_linear_output", CHECK_LINEAR, str(CHECK_ROWS), str(CHECK_SEED)),
            kind="attach",
        )
        expected = _decode(result)
        x = torch.randn(CHECK_ROWS, projection.in_features, generator=torch.Generator().manual_seed(CHECK_SEED))
        with torch.no_grad():
            ours = projection.compute(x.to(expected.dtype))
        if not torch.equal(ours, expected):
            raise OrbitError(
                f"the learner's {CHECK_LINEAR} differs from the rollout engine's by up to "
                f"{(ours.float() - expected.float()).abs().max():.3e}: they do not compute with the same kernel and bytes"
            )

    def reattach(self, model: torch.nn.Module) -> None:
        """The engine restarted: attach to its new base, rebind MODEL's views, verify, drop the old pages."""
        attached = self._receive()  # may restart the engine once more (and run this hook inside)
        count = rebind_colocated_base(model, attached.tensors)
        self.commit(attached, model)
        log.info("re-attached to the restarted rollout engine's base (%d tensors, %d bytes)", count, attached.arena.size)

    def final_check(self) -> None:
        """Before the engine stops: does it still compute from the shared pages? (kept for the summary)"""
        try:  # not supervised: an engine that died at the end is not restarted to be asked
            (stray,) = self.rollout.client.collective_rpc("orbit_stray_parameters", timeout_s=30)
        except Exception as exc:  # the engine is gone: not known
            log.warning("could not ask the rollout engine whether it computes from the shared base: %s", exc)
            return
        self.engine_on_shared_pages = not stray

    def unchanged(self) -> bool | None:
        """Is the base byte for byte what it was at the first attach? None before any attach."""
        if self.attached is None or self.first_digest is None:
            return None
        return self.attached.digest() == self.first_digest

    def close(self) -> None:
        if self.attached is not None:
            self.attached.close()


def load_colocated(spec, rollout, device: torch.device, dtype: str):
    """Start the rollout engine, attach to its base and build the policy on it, verified; the
    restart hook re-attaches. Returns (policy, ColocatedBase). The engine is stopped on failure."""
    from orbit_runtime.learner.model import load_colocated_policy

    if device.type != "cpu":
        raise OrbitError(f"placement colocated: the learner runs on the CPU in this version, learner.device resolved to {device}")
    rollout.start()
    try:
        shared = ColocatedBase(rollout, Path(spec.model.path))
        attached = shared.attach()
        policy = load_colocated_policy(Path(spec.model.path), spec.adapter, attached.tensors, attached.meta["isa_hint"],
                                       dtype=dtype, lora_rounding=spec.learner.lora_rounding)  # fmt: skip
        shared.commit(attached, policy.model)
    except BaseException:
        rollout.stop()
        raise
    rollout.after_restart_hooks.append(lambda: shared.reattach(policy.model))
    return policy, shared
