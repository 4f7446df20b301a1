"""Model configs shipped with Orbit (`models/*.json`), by name: `orbit plan deepseek-v3`, and the
`base.architecture` field with which the operator can plan a job before any pod exists.

Each file holds the planner's fields of a public model's `config.json`, written by hand
from its model card; the tests check parameter counts against the published totals.
"""

from __future__ import annotations

import json
from importlib import resources

from orbit_runtime.plan.architecture import Architecture, PlanError, parse_architecture


def names() -> list[str]:
    """Catalog names, sorted (file names without .json)."""
    folder = resources.files("orbit_runtime.plan") / "models"
    return sorted(entry.name.removesuffix(".json") for entry in folder.iterdir() if entry.name.endswith(".json"))


def catalog_config(name: str) -> dict:
    """The config.json contents of catalog entry NAME; PlanError lists the known names."""
    if name not in names():
        raise PlanError(f"{name!r} is not a model in Orbit's catalog; known: {', '.join(names())}")
    return json.loads((resources.files("orbit_runtime.plan") / "models" / f"{name}.json").read_text())


def catalog_architecture(name: str) -> Architecture:
    return parse_architecture(catalog_config(name), f"catalog:{name}")
