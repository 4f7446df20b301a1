"""What a tracker logs, computed from what the run already writes (pure functions): the scalars of a
metrics.jsonl row, the flattened job spec as parameters, samples as a table."""

from __future__ import annotations

import json
import math
from typing import Any

from orbit_runtime.config.fingerprint import flatten_fields

MAX_PARAM_LENGTH = 6000  # MLflow's limit on a parameter value; longer values are left to job.json


def _scalars(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (int, float)):
        if math.isfinite(value):
            out[prefix] = float(value)
    elif isinstance(value, dict):
        for key, inner in value.items():
            _scalars(f"{prefix}/{key}", inner, out)


def row_metrics(row: dict) -> tuple[int, dict[str, float]] | None:
    """A metrics.jsonl row as (its step, {"<kind>/<field>": value}): every finite number in it, nested
    dicts flattened with "/" (e.g. step/reward_mean, eval/accuracy, step/routing_agreement_by_layer/2);
    None for a row without a step (nothing to plot it against)."""
    step, kind = row.get("step"), row.get("kind")
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(kind, str):
        return None
    out: dict[str, float] = {}
    for key, value in row.items():
        if key not in ("kind", "step", "time"):
            _scalars(f"{kind}/{key}", value, out)
    return step, out


def flat_params(spec: dict) -> dict[str, str]:
    """The job spec (model_dump(mode="json")) as {dotted.field: value as text}, for a tracker's parameters
    (lists and empty sections as JSON; values over MAX_PARAM_LENGTH left out: the whole spec is logged as
    job.json too)."""
    texts = {name: value if isinstance(value, str) else json.dumps(value)
             for name, value in flatten_fields(spec, keep_empty=True).items()}  # fmt: skip
    return {name: text for name, text in texts.items() if len(text) <= MAX_PARAM_LENGTH}


def sample_table(samples: list[dict]) -> tuple[list[str], list[list]]:
    """Sample rows (samples.jsonl's, or an evaluation's) as (columns, rows): the union of their fields in
    first-seen order, values that are not text or numbers as JSON text (an episode's messages)."""
    columns: list[str] = []
    for sample in samples:
        columns += [key for key in sample if key not in columns]

    def cell(value: Any) -> Any:
        return value if value is None or isinstance(value, (str, int, float, bool)) else json.dumps(value)

    return columns, [[cell(sample.get(column)) for column in columns] for sample in samples]
