"""The environment a job's `environment` section names: built-in tools, a `verifiers` environment, or
an Orbit Environment of the user's own. Errors name the field."""

from __future__ import annotations

from orbit_runtime.config.environment import EnvironmentSpec
from orbit_runtime.dotted_path import load_callable
from orbit_runtime.environments.base import Environment
from orbit_runtime.environments.tools import ToolEnvironment, load_tool
from orbit_runtime.errors import OrbitError


def load_environment(spec: EnvironmentSpec, job=None) -> Environment:
    """The Environment of SPEC (JOB: the whole job spec, for settings an environment shares with it)."""
    if spec.type == "bfcl":
        from orbit_runtime.environments.bfcl import BfclEnvironment

        return BfclEnvironment()
    if spec.type == "tools":
        return ToolEnvironment([load_tool(name) for name in spec.tools], spec.system_prompt, spec.tool_timeout_s,
                               workers=spec.concurrency)  # fmt: skip
    made = load_callable(spec.load, "environment.load")(**spec.kwargs)  # type: ignore[arg-type]
    if spec.type == "python":
        if not isinstance(made, Environment):
            raise OrbitError(f"environment.load {spec.load!r} returned a {type(made).__name__}, not an "
                             "orbit_runtime.environments.base.Environment")  # fmt: skip
        return made
    from orbit_runtime.environments.verifiers_adapter import VerifiersEnvironment

    return VerifiersEnvironment(made, tool_timeout_s=spec.tool_timeout_s)
