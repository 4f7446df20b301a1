"""Orbit's methods inside each vLLM worker (`--worker-extension-cls`, driven by `collective_rpc`).

Thin on purpose: each method unpacks its string arguments (vLLM's HTTP `/collective_rpc`
passes strings only) and calls Orbit's own modules with the worker's model. The route is
reachable only with the run's API key (the middleware in `api_key.py`), and vLLM exposes it
only with VLLM_SERVER_DEV_MODE=1, which Orbit sets for colocated runs alone.
"""

from __future__ import annotations

import base64
import logging

log = logging.getLogger(__name__)


class OrbitWorkerExtension:
    """Mixed into vLLM's worker class; `self.model_runner.model` is the engine's model."""

    _orbit_shared = None  # SharedWeights, once the base has been moved into the arena
    _orbit_adapters = None  # MemoryAdapters, once the learner staged a version

    def orbit_share_base(self, socket_path: str) -> dict:
        """Move the model's weights into the shared arena (first call) and send it to SOCKET_PATH."""
        from orbit_runtime.shared_base.transport import send_arena
        from orbit_runtime.shared_base.vllm_weights import share_model_weights

        if self._orbit_shared is None:
            self._orbit_shared = share_model_weights(self.model_runner.model)
            log.info("orbit: the base now lives in one sealed arena of %d bytes", self._orbit_shared.arena.size)
        meta = self._orbit_shared.meta()
        send_arena(socket_path, self._orbit_shared.arena, meta)
        return meta

    def orbit_stray_parameters(self) -> list:
        """Names of the model's parameters no longer on the shared pages (empty: vLLM computes from them)."""
        from orbit_runtime.shared_base.vllm_weights import stray_parameters

        if self._orbit_shared is None:
            return []
        return stray_parameters(self.model_runner.model, self._orbit_shared)

    def orbit_unstage_adapter(self, name: str) -> dict:
        """Forget adapter version NAME's staged tensors (the learner unloaded it)."""
        dropped = self._orbit_adapters is not None and self._orbit_adapters.unstage(name)
        return {"name": name, "dropped": dropped}

    def orbit_stage_adapter(self, socket_path: str, name: str) -> dict:
        """Fetch adapter version NAME's tensors from the learner's offer at SOCKET_PATH and keep them
        for vLLM's loader (`MEMORY_PREFIX + name`)."""
        from orbit_runtime.rollout.memory_adapters import MemoryAdapters
        from orbit_runtime.shared_base.transport import fetch_arena

        if self._orbit_adapters is None:
            self._orbit_adapters = MemoryAdapters(self.model_runner.lora_manager)
        arena, meta = fetch_arena(socket_path)
        try:
            count = self._orbit_adapters.stage(name, arena, meta["config"])
        finally:
            arena.close()
        return {"name": name, "tensors": count}

    def orbit_linear_output(self, name: str, rows: str, seed: str) -> dict:
        """vLLM's kernel output of INT4 linear NAME on a seeded input (for the learner's bitwise check)."""
        import torch

        from orbit_runtime.shared_base.vllm_weights import linear_output

        y = linear_output(self.model_runner.model, name, int(rows), int(seed)).contiguous()
        data = base64.b64encode(y.view(-1).view(torch.uint8).numpy().tobytes()).decode()
        return {"dtype": str(y.dtype).removeprefix("torch."), "shape": list(y.shape), "data": data,
                "threads": torch.get_num_threads()}  # fmt: skip
