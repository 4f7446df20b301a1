"""The reference server as a child process, and its HTTP client (trainer.roles supervises it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import torch

from orbit_runtime.api_key import API_KEY_ENV, auth_headers
from orbit_runtime.processes import ManagedServer, free_port


class ReferenceClient:
    """HTTP client of `orbit_runtime.reference.server`."""

    def __init__(self, base_url: str, timeout_s: float = 300.0, api_key: str | None = None) -> None:
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s, headers=auth_headers(api_key))

    def logprobs(self, pairs: list[tuple[list[int], list[int]]], temperature: float = 1.0) -> list[torch.Tensor]:
        payload = {"sequences": [{"prompt_ids": p, "completion_ids": c} for p, c in pairs], "temperature": temperature}
        response = self._http.post("/v1/logprobs", json=payload)
        if response.status_code >= 400:
            raise RuntimeError(f"reference /v1/logprobs returned {response.status_code}: {response.text[:300]}")
        return [torch.tensor(x) for x in response.json()["logprobs"]]

    def healthy(self) -> bool:
        try:
            return self._http.get("/healthz", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self._http.close()


class ReferenceServer(ManagedServer):
    name = "reference server"

    def __init__(self, model_dir: Path, dtype: str, log_path: Path, micro_batch_tokens: int | None = None,
                 device: str = "cpu", host: str = "127.0.0.1", api_key: str | None = None) -> None:  # fmt: skip
        port = free_port(host)
        command = [sys.executable, "-m", "orbit_runtime.reference.server", "--model-dir", str(model_dir),
                   "--dtype", dtype, "--host", host, "--port", str(port), "--device", device]  # fmt: skip
        if micro_batch_tokens is not None:
            command += ["--micro-batch-tokens", str(micro_batch_tokens)]
        env = {**os.environ, **({API_KEY_ENV: api_key} if api_key else {})}
        super().__init__(command, port=port, host=host, env=env, log_path=log_path)
