"""Metrics of multi-turn episodes, on the learner's registry: episodes by how they ended, turns
per episode, time in the environment (steps and tool calls; the part that is not generation),
tool calls by status, and environment failures (an environment that raised: the episode scores
0, the run goes on)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from orbit_runtime.observability.metrics import LEARNER_REGISTRY

EPISODE_ENDINGS = ("done", "max_turns", "max_tokens", "turn_cut", "env_error")

EPISODES = Counter(
    "orbit_episodes_total", "Multi-turn episodes finished, by how they ended (done, max_turns, max_tokens, turn_cut, env_error).",
    ["ending"], registry=LEARNER_REGISTRY,
)  # fmt: skip
EPISODE_TURNS = Histogram(
    "orbit_episode_turns", "Model turns per episode.", buckets=(1, 2, 3, 4, 6, 8, 16, 32, 64), registry=LEARNER_REGISTRY,
)  # fmt: skip
ENVIRONMENT_STEP_SECONDS = Histogram(
    "orbit_environment_step_seconds", "Wall time of one environment step (its tool calls included).",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30), registry=LEARNER_REGISTRY,
)  # fmt: skip
TOOL_CALLS = Counter(
    "orbit_tool_calls_total", "Tool calls the model made, by tool and status (ok, error, timeout, bad_arguments, unknown_tool, malformed).",
    ["tool", "status"], registry=LEARNER_REGISTRY,
)  # fmt: skip
ENVIRONMENT_ERRORS = Counter(
    "orbit_environment_errors_total", "Environment steps that raised (the episode ends, truncated, with reward 0).",
    registry=LEARNER_REGISTRY,
)  # fmt: skip
for _ending in EPISODE_ENDINGS:
    EPISODES.labels(_ending)
