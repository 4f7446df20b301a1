"""On-policy as a guarantee: the run stops when the learner no longer trains the policy that sampled.

Each committed step is checked on two decode-path figures: the step's mean |learner -
rollout| log-prob over its sampled tokens (the mismatch the loss corrects for) and the
sync's decode canary (a seeded continuation vLLM sampled from the version just served).
With `algorithm.max_mismatch` set, exceeding it for `algorithm.max_mismatch_steps`
consecutive steps raises OffPolicy after the step is committed, so the run's checkpoint is
that step's and intact. `auto` calibrates the bound from the run itself: AUTO_MULTIPLE x the
largest figure of its first CALIBRATION_STEPS steps (no bound while calibrating). The bound
and the streak are written into every step row, so a resumed run continues them.
"""

from __future__ import annotations

from dataclasses import dataclass

from orbit_runtime.errors import OrbitError
from orbit_runtime.observability import metrics

CALIBRATION_STEPS = 5
AUTO_MULTIPLE = 4.0
ALERT_DEFAULT_BOUND = 0.05  # what orbit_learner_mismatch_bound_abs_logprob says (and the alert uses) while no bound is set


class OffPolicy(OrbitError):
    """The train-rollout mismatch stayed above algorithm.max_mismatch: training would be off-policy."""

    reason = "OffPolicy"


def step_figure(row: dict) -> float:
    """The larger of the step's batch mismatch and its decode canary (a step row's fields)."""
    decode = row.get("canary_decode_mean_abs_dlogp")
    return max(row["mismatch_mean_abs"], decode if decode is not None else 0.0)


@dataclass
class OnPolicyGuard:
    """Checks each step row against the bound (None: off, or still calibrating when AUTO)."""

    bound: float | None
    steps_allowed: int
    auto: bool = False
    consecutive: int = 0
    last: float | None = None

    @classmethod
    def from_spec(cls, max_mismatch: float | str | None, steps_allowed: int) -> OnPolicyGuard:
        auto = max_mismatch == "auto"
        return cls(bound=None if auto else max_mismatch, steps_allowed=steps_allowed, auto=auto)  # type: ignore[arg-type]

    def restore(self, steps: list[dict]) -> None:
        """Continue a resumed run's streak under the same bound. `auto` continues the calibrated
        bound; a bound the spec has since changed (or switched off) starts a fresh streak, so a
        run stopped OffPolicy can be resumed with a looser bound."""
        if steps:
            last = steps[-1]
            stored = last.get("mismatch_bound")
            if self.auto:
                self.bound = stored
            if stored is not None and stored == self.bound:
                self.consecutive = last.get("off_policy_steps", 0)
            self.last = step_figure(last)
        self.export()

    def export(self) -> None:
        """The bound the alert rules compare with: ours, or ALERT_DEFAULT_BOUND while there is none."""
        metrics.LEARNER_MISMATCH_BOUND.set(self.bound if self.bound is not None else ALERT_DEFAULT_BOUND)
        metrics.LEARNER_OFF_POLICY_STEPS.set(self.consecutive)

    def check(self, row: dict, calibration_rows: list[dict]) -> tuple[dict, OffPolicy | None]:
        """The on-policy fields of ROW (the step just committed; CALIBRATION_ROWS: the run's step rows so
        far, ROW included), and the OffPolicy error to raise once the row is recorded, if the streak
        reached steps_allowed."""
        figure = self.last = step_figure(row)
        if self.auto and self.bound is None and len(calibration_rows) >= CALIBRATION_STEPS:
            self.bound = AUTO_MULTIPLE * max(step_figure(r) for r in calibration_rows[:CALIBRATION_STEPS])
        elif self.bound is not None:
            self.consecutive = self.consecutive + 1 if figure > self.bound else 0
        self.export()
        fields = {"mismatch_bound": self.bound, "off_policy_steps": self.consecutive}
        if self.bound is not None and self.consecutive >= self.steps_allowed:
            return fields, OffPolicy(
                f"step {row['step']}: the train-rollout mismatch ({figure:.4g} mean |dlogp|, the larger of the batch's "
                f"{row['mismatch_mean_abs']:.4g} and the decode canary's) exceeded algorithm.max_mismatch ({self.bound:.4g}) "
                f"for {self.consecutive} consecutive steps (algorithm.max_mismatch_steps); stopped rather than train "
                "off-policy. The checkpoint of this step is kept; compare model.dtype with model.learner_dtype, the base "
                "the rollout serves, and the vLLM version"
            )
        return fields, None

    def health(self) -> dict:
        """The `/status` document's `onPolicy` part."""
        state = "off" if self.bound is None and not self.auto else ("calibrating" if self.bound is None else "ok")
        if self.bound is not None and self.consecutive:
            state = "exceeded"
        return {"state": state, "bound": self.bound, "lastMismatch": self.last, "consecutiveSteps": self.consecutive,
                "allowedSteps": self.steps_allowed}  # fmt: skip
