"""The README's stability plot draws what stability.json says (benchmarks/stability_plot.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.benchmark_module import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _module():
    return load_benchmark("stability_plot")


def test_each_group_is_drawn_with_its_means_and_band() -> None:
    result = json.loads((ROOT / "benchmarks" / "results" / "stability.json").read_text())
    fig = _module().figure(result)
    for name, group in result["groups"].items():
        lines = [t for t in fig.data if t.legendgroup == name]
        accuracy, mismatch = lines  # one mean line per panel
        steps = sorted(group["heldout_by_step"], key=int)
        assert list(accuracy.x) == [int(s) for s in steps]
        assert list(accuracy.y) == [group["heldout_by_step"][s]["mean"] for s in steps]
        assert list(mismatch.y) == [s["mean"] for s in group["per_step"]["mismatch_mean_abs"]]
        assert accuracy.name.startswith(f"{name} ({len(group['seeds'])} seed")
    bands = [t for t in fig.data if t.fill == "toself"]
    assert len(bands) == 2 * len(result["groups"])  # the min-max band under every line
    assert (ROOT / "benchmarks" / "results" / "stability.png").exists(), "run benchmarks/stability_plot.py"
