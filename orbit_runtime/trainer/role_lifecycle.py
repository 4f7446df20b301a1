"""Starting and stopping the Trainer's roles: the rollout server (vLLM) and the reference, and
processes.json, which names their pids and URLs for operators and tests.

A part of Trainer (trainer/loop.py), kept apart because it is one concern: it reads the trainer's
spec, policy, state, rollout, reference, shared_base, metrics_server, recorder and startup_seconds,
and it uses Trainer's _adapter_source and _say.
"""

from __future__ import annotations

import os
import time

from orbit_runtime.observability import metrics


class RoleLifecycle:
    """Trainer's methods that start and stop its roles (see the module docstring)."""

    def start_roles(self) -> None:
        """Start (or reach) the rollout server, calibrate the canary, serve a resumed adapter again, start the reference."""
        started = time.monotonic()
        if not self.rollout.started:  # colocated: started with the policy
            self.rollout.start()
        self.startup_seconds["rollout_start"] = time.monotonic() - started  # vLLM's start, or reaching a running one
        started = time.monotonic()
        floor = self.rollout.calibrate(self.policy, self.spec.model.dtype)
        tolerance = self.rollout.sync.tolerance
        self._say(f"canary noise floor {floor:.2e} mean |dlogp| ({self.spec.model.dtype}, base model on both engines); "
                  f"tolerance {tolerance:.2e}" + (" (sync.tolerance)" if self.spec.sync.tolerance else " (calibrated)"))  # fmt: skip
        if self.state.adapter_version > 0:  # resumed: serve the checkpoint's adapter version again
            source, _ = self._adapter_source(self.state.adapter_version)
            self.rollout.publish(self.policy, self.state.adapter_version, source)
        self.startup_seconds["resync"] = time.monotonic() - started  # the canary's noise floor and the adapter served again
        self.reference.start()
        metrics.ROLLOUT_UP.set(1)
        self.rollout.watch_health(self._probe_stop)
        self.write_processes()

    def write_processes(self) -> None:
        """processes.json: pids and URLs of the roles, for operators and tests."""
        self._restarts_written = (self.rollout.restarts, self.reference.restarts)
        roles: dict = {
            "learner": {"pid": os.getpid(), **({"metrics_url": self.metrics_server.url} if self.metrics_server else {})}
        }
        for name, role in (("rollout", self.rollout), ("reference", self.reference)):
            if role.server is not None and role.server.pid is not None:
                roles[name] = {"pid": role.server.pid, "url": role.server.base_url, "restarts": role.restarts}
        self.recorder.write_processes(roles)

    def stop_roles(self) -> None:
        """Stop the roles (colocated: check first that the shared base is still intact)."""
        if self.shared_base is not None and self.rollout.started:
            self.shared_base.final_check()
        self._probe_stop.set()
        self.rollout.stop()
        self.reference.stop()
