"""The pod's role commands: `orbit rollout`, `orbit reference`, `orbit learner` (and the init
container's `orbit prepare-base`, in cli.py). Each runs ONE role in the foreground, with the
same code `orbit train` uses when it starts the roles itself as child processes:

    orbit rollout CONFIG     vLLM on the base with runtime LoRA loading (exec: signals reach vLLM)
    orbit reference CONFIG   the reference log-prob server
    orbit learner CONFIG     the RL loop against the rollout and reference URLs (no child processes);
                             resumes from the newest checkpoint of its config when there is one

The learner finds the rollout and reference at ports 8000 and 8001 of its own bind address
(the pod IP in a pod; see orbit_operator.pod), or at ORBIT_ROLLOUT_URL / ORBIT_REFERENCE_URL;
the shared adapter directory is ORBIT_ADAPTERS_DIR.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from orbit_runtime.base_lease import enter_base
from orbit_runtime.errors import OrbitError
from orbit_runtime.redaction import mask_all, redact, secret_values

ConfigArg = Annotated[Path, typer.Argument(help="Job config (the pod's ConfigMap, /etc/orbit/job.yaml).")]


def register(app: typer.Typer, fail, configure_logging) -> None:
    """Add the role commands to APP (FAIL prints one error line and exits)."""

    def load(config: Path):
        from orbit_runtime.config import load_job_spec

        try:
            return load_job_spec(config)
        except OrbitError as exc:
            fail(exc)

    @app.command()
    def rollout(
        config: ConfigArg,
        host: Annotated[str, typer.Option(help="Address to bind (the pod IP for the kubelet's probes).")] = "0.0.0.0",
        port: Annotated[int, typer.Option(help="Port (the pod's `rollout` port).")] = 8000,
    ) -> None:
        """Run vLLM (the rollout role) on the config's base, in the foreground."""
        from orbit_runtime.trainer.roles import rollout_server_config

        spec = load(config)
        server = rollout_server_config(spec, log_path=None)  # its own GPUs in a pod: vLLM's defaults unless the spec says
        server.host = host
        if not (Path(server.model_dir) / "config.json").is_file():
            fail(OrbitError(f"{server.model_dir}: not a model directory (no config.json); did prepare-base run?"))
        take_base(Path(server.model_dir), fail)  # the lease is inherited by vLLM: the node's cache-cleanup leaves the base alone
        command = server.command(port)
        os.execvpe(command[0], command, server.environment())

    @app.command()
    def reference(
        config: ConfigArg,
        host: Annotated[str, typer.Option(help="Address to bind.")] = "0.0.0.0",
        port: Annotated[int, typer.Option(help="Port (the pod's `reference` port).")] = 8001,
        device: Annotated[str | None, typer.Option(help="auto, cpu or cuda (default: the config's learner.device).")] = None,
    ) -> None:
        """Run the reference log-prob server on the config's base, in the foreground."""
        from orbit_runtime.reference.server import main as reference_main

        spec = load(config)
        take_base(Path(spec.model.path), fail)
        args = ["--model-dir", spec.model.path, "--dtype", spec.model.learner_dtype or spec.model.dtype, "--host", host,
                "--port", str(port), "--device", device or spec.learner.device]  # fmt: skip
        if spec.learner.micro_batch_tokens is not None:
            args += ["--micro-batch-tokens", str(spec.learner.micro_batch_tokens)]
        reference_main(args)

    @app.command()
    def learner(
        config: ConfigArg,
        rollout_url: Annotated[str | None, typer.Option(envvar="ORBIT_ROLLOUT_URL", help="The rollout role (default: port 8000 at --host).")] = None,
        reference_url: Annotated[str | None, typer.Option(envvar="ORBIT_REFERENCE_URL", help="The reference role, reference.mode: server (default: port 8001 at --host).")] = None,
        adapters_dir: Annotated[Path | None, typer.Option(envvar="ORBIT_ADAPTERS_DIR", help="Where adapter versions are published for the rollout to load.")] = None,
        wait_seconds: Annotated[float, typer.Option(help="How long to wait for a role to answer (at start, or after it restarted).")] = 600.0,
        host: Annotated[str | None, typer.Option(help="Address for /metrics, /healthz and /status (default: the config's metrics.host).")] = None,
        termination_log: Annotated[Path | None, typer.Option(help="Write the final /status JSON here when the run ends or is stopped "
                                                                  "(the pod's terminationMessagePath: the operator reads it).")] = None,
    ) -> None:  # fmt: skip
        """Run the RL loop (the learner role) against running rollout and reference servers; resumes
        from the newest checkpoint of this config. Exit 0 when done; non-zero with one line otherwise."""
        from orbit_runtime.sync.adapter_sync import SyncError
        from orbit_runtime.trainer.loop import Trainer
        from orbit_runtime.trainer.on_policy import OffPolicy
        from orbit_runtime.trainer.roles import ExternalRoles, RoleDied

        spec = load(config)
        take_base(Path(spec.model.path), fail, termination_log)  # for the pod's whole life: its sidecars' restarts find the base
        if host is not None:
            spec.metrics.host = host
        rollout_url = rollout_url or http_url(host or "127.0.0.1", 8000)  # the pod's other containers: same IP
        reference_url = reference_url or http_url(host or "127.0.0.1", 8001)
        configure_logging()
        external = ExternalRoles(rollout_url=rollout_url, reference_url=reference_url if spec.reference.mode == "server" else None,
                                 adapters_dir=adapters_dir, wait_s=wait_seconds)  # fmt: skip
        trainer = None
        try:
            trainer = Trainer(spec, resume=False, external=external)  # loads the base, restores a checkpoint: may fail too
            summary = trainer.run()
        except OffPolicy as exc:  # the operator reads why from the last /status (phase failed, reason OffPolicy)
            write_termination_message(termination_log, trainer.status())
            fail(exc)
        except (OrbitError, SyncError, RoleDied) as exc:
            write_failure_message(termination_log, str(exc))  # redacted here, not the kubelet's copy of the log
            fail(exc)
        except OSError as exc:
            write_failure_message(termination_log, f"{type(exc).__name__}: {exc}")
            fail(OrbitError(f"{type(exc).__name__}: {exc}"))
        except KeyboardInterrupt as stop:
            if trainer is not None:
                write_termination_message(termination_log, trainer.status())
            signum = stop.args[0] if stop.args and isinstance(stop.args[0], int) else 2
            raise typer.Exit(code=128 + signum) from None
        except Exception as exc:  # a bug or an out-of-memory: the traceback goes to the log, its end (masked) here
            import traceback

            write_failure_message(termination_log, "".join(traceback.format_exception(exc))[-3000:])
            raise
        write_termination_message(termination_log, trainer.status())
        typer.echo(json.dumps(summary))


def take_base(model_dir: Path, fail, termination_log: Path | None = None) -> int | None:
    """A role's first step: hold the lease on the base it mounted and check that it is the base this pod's
    prepare-base prepared (orbit_runtime.base_lease.enter_base); one error line and exit otherwise."""
    try:
        return enter_base(model_dir)
    except OrbitError as exc:
        write_failure_message(termination_log, str(exc))
        fail(exc)


def http_url(host: str, port: int) -> str:
    """http://HOST:PORT, with an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def write_termination_message(path: Path | None, status: dict) -> None:
    """The learner's last /status, for the operator once nothing serves it any more (Kubernetes puts
    the file into the container's `state.terminated.message`, at most 4 KiB). Never fails the run."""
    # masked before it is dumped: JSON escapes would hide a value with quotes or non-ASCII characters
    _write_termination_log(path, json.dumps(mask_all(status, secret_values()), separators=(",", ":"))[:4096])


def write_failure_message(path: Path | None, message: str) -> None:
    """Why the learner failed, redacted (every value of the job's Secrets, orbit_runtime.redaction), as the
    termination message: the kubelet's fallback would otherwise copy the raw end of the log there."""
    _write_termination_log(path, redact(f"error: {message}")[-4096:])


def _write_termination_log(path: Path | None, text: str) -> None:
    """Write TEXT to PATH (None: no termination log); a failure to write is said, never raised."""
    if path is None:
        return
    try:
        path.write_text(text)
    except OSError as exc:
        typer.echo(f"could not write the termination message {path}: {exc}", err=True)
