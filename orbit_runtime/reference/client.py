"""Reference log-probs from the reference server, or from the learner's own base (shared)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Protocol

import httpx
import torch

from orbit_runtime.processes import ManagedServer, free_port


class ReferenceBackend(Protocol):
    def logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]: ...


class SharedReference:
    """Local mode: the learner's base with the adapter disabled (no second model copy)."""

    def __init__(self, policy) -> None:
        self.policy = policy

    def logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        with torch.no_grad(), self.policy.adapter_disabled():
            return [t.float() for t in self.policy.completion_logprobs(pairs)]


class ReferenceClient:
    """HTTP client of `orbit_runtime.reference.server`."""

    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s)

    def logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        payload = {"sequences": [{"prompt_ids": p, "completion_ids": c} for p, c in pairs]}
        response = self._http.post("/v1/logprobs", json=payload)
        if response.status_code >= 400:
            raise RuntimeError(f"reference /v1/logprobs returned {response.status_code}: {response.text[:300]}")
        return [torch.tensor(x) for x in response.json()["logprobs"]]

    def close(self) -> None:
        self._http.close()


class ReferenceServer(ManagedServer):
    name = "reference server"

    def __init__(self, model_dir: Path, dtype: str, log_path: Path, host: str = "127.0.0.1") -> None:
        port = free_port(host)
        command = [sys.executable, "-m", "orbit_runtime.reference.server", "--model-dir", str(model_dir),
                   "--dtype", dtype, "--host", host, "--port", str(port)]  # fmt: skip
        super().__init__(command, port=port, host=host, env=dict(os.environ), log_path=log_path)
