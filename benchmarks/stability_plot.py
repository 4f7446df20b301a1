"""The README's stability plot, drawn from benchmarks/results/stability.json (benchmarks/stability.py).

Two panels per scheme x correction: held-out accuracy at each evaluation and the train-rollout
mismatch (mean |dlogp| of the sampled tokens) at each step, each the mean over the seeds found
with the min-max band. plotly draws it; the system's Chromium (Debian's, as the report test
uses, through playwright) renders it to PNG, since a README shows images, not scripts.

    python benchmarks/stability_plot.py [--json benchmarks/results/stability.json] [--png benchmarks/results/stability.png]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CHROMIUM = "/usr/bin/chromium"  # `make test-tools` installs it
COLOURS = {"A-tis": "#1f77b4", "A-none": "#6baed6", "B-tis": "#d62728", "B-none": "#fc9272"}


def figure(result: dict):
    """The plotly figure of RESULT (stability.json): accuracy and mismatch, mean and min-max band per group."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("held-out accuracy (quickstart, 30 prompts)",
                                                        "train-rollout mismatch, mean |Δlogp| per step"))  # fmt: skip
    for name, group in result["groups"].items():
        colour, seeds = COLOURS.get(name, "#444"), len(group["seeds"])
        label = f"{name} ({seeds} seed{'s' if seeds != 1 else ''})"
        by_step = sorted((int(step), s) for step, s in group["heldout_by_step"].items())
        mismatch = group["per_step"]["mismatch_mean_abs"]
        panels = [(1, [s for s, _ in by_step], [s for _, s in by_step]), (2, list(range(1, len(mismatch) + 1)), mismatch)]
        for col, x, stats in panels:
            band_x = x + x[::-1]
            band_y = [s["max"] for s in stats] + [s["min"] for s in stats][::-1]
            fig.add_trace(go.Scatter(x=band_x, y=band_y, fill="toself", fillcolor=colour, opacity=0.15, line={"width": 0},
                                     hoverinfo="skip", showlegend=False), row=1, col=col)  # fmt: skip
            fig.add_trace(go.Scatter(x=x, y=[s["mean"] for s in stats], mode="lines+markers", name=label,
                                     line={"color": colour}, legendgroup=name, showlegend=col == 1), row=1, col=col)  # fmt: skip
    fig.update_xaxes(title_text="RL step")
    fig.update_yaxes(title_text="accuracy", tickformat=".0%", row=1, col=1)
    fig.update_yaxes(title_text="nats (log scale)", type="log", exponentformat="power", row=1, col=2)
    env = result.get("environment", {})
    fig.update_layout(template="plotly_white", width=1100, height=420, margin={"l": 60, "r": 20, "t": 70, "b": 50},
                      title={"text": f"A: learner on vLLM's INT4 base · B: learner on 16-bit weights · "
                                     f"{result['runs_found']} runs, {env.get('cpu', '?')} ({env.get('cpu_cores', '?')} cores), "
                                     f"commit {str(env.get('commit', '?'))[:10]}", "font": {"size": 13}})  # fmt: skip
    return fig


def render_png(fig, png: Path) -> None:
    """FIG as PNG at PNG: the HTML (plotly.js inline, offline) screenshotted by headless Chromium."""
    import plotly.io as pio
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "stability.html"
        html.write_text(pio.to_html(fig, include_plotlyjs=True, full_html=True, div_id="plot", config={"staticPlot": True}))
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": fig.layout.width + 20, "height": fig.layout.height + 20})
            page.goto(html.as_uri())
            page.wait_for_function("document.querySelectorAll('#plot .main-svg').length > 0", timeout=30_000)
            page.locator("#plot").screenshot(path=str(png))
            browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=RESULTS / "stability.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "stability.png")
    args = parser.parse_args()
    result = json.loads(args.json.read_text())
    if not result.get("groups"):
        raise SystemExit(f"{args.json}: no finished runs to plot")
    render_png(figure(result), args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
