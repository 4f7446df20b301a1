"""Adapter sync without files (placement colocated): the learner's LoRA tensors reach vLLM in memory.

`InMemoryAdapter` is one version's tensors and config, copied out of the learner when the
version is made (so re-serving it after an engine restart serves exactly that version).
Loading it stages the tensors in the engine's worker through a sealed arena
(`rollout/memory_adapters.py`), then asks vLLM to load the version by name as usual: the
same `load_lora_adapter`, fresh names, canary verification and unloading as a file-based
version, without the safetensors write and read.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from orbit_runtime.rollout.client import RolloutClient
from orbit_runtime.rollout.memory_adapters import MEMORY_PREFIX
from orbit_runtime.shared_base.arena import build_arena
from orbit_runtime.shared_base.transport import ArenaOffer

STAGE_METHOD, UNSTAGE_METHOD = "orbit_stage_adapter", "orbit_unstage_adapter"  # OrbitWorkerExtension's methods


def unstage(client: RolloutClient, name: str) -> None:
    """Drop adapter NAME's staged tensors in the engine's worker (after vLLM unloaded it)."""
    client.collective_rpc(UNSTAGE_METHOD, name)


@dataclass(frozen=True, repr=False)
class InMemoryAdapter:
    """One adapter version as `Policy.adapter_export` gives it."""

    def __repr__(self) -> str:
        return f"InMemoryAdapter({len(self.tensors)} tensors, {self.nbytes} bytes)"

    tensors: dict[str, torch.Tensor]
    config: dict

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def load(self, client: RolloutClient, name: str, timeout_s: float = 120.0) -> None:
        """Stage the tensors in the engine's worker, then have vLLM load them as adapter NAME."""
        arena, _ = build_arena(self.tensors.items(), label="orbit-adapter")
        offer = ArenaOffer()
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="offer-adapter") as pool:
                sent = pool.submit(offer.send, arena, {"config": self.config}, timeout_s)
                try:
                    client.collective_rpc(STAGE_METHOD, offer.path, name, timeout_s=timeout_s)
                except BaseException:
                    offer.close()  # the worker will not come: stop waiting for it
                    raise
                sent.result(timeout=timeout_s)
        finally:
            offer.close()
            arena.close()
        client.load_adapter(name, MEMORY_PREFIX + name)
