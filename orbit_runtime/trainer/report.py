"""The run report: one self-contained HTML file with line charts (inline SVG, no JS, no deps)."""

from __future__ import annotations

import html
import json
import math

WIDTH, HEIGHT, PAD = 520, 220, 40


def _chart(title: str, series: dict[str, list[tuple[float, float]]]) -> str:
    points = [p for values in series.values() for p in values if math.isfinite(p[1])]
    if not points:
        return f"<div class='chart'><h3>{html.escape(title)}</h3><p>no data</p></div>"
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

    def sx(x: float) -> float:
        return PAD + (x - x0) / (x1 - x0) * (WIDTH - 2 * PAD)

    def sy(y: float) -> float:
        return HEIGHT - PAD - (y - y0) / (y1 - y0) * (HEIGHT - 2 * PAD)

    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    parts = [
        f"<line x1='{PAD}' y1='{HEIGHT - PAD}' x2='{WIDTH - PAD}' y2='{HEIGHT - PAD}' stroke='#999'/>",
        f"<line x1='{PAD}' y1='{PAD}' x2='{PAD}' y2='{HEIGHT - PAD}' stroke='#999'/>",
        f"<text x='{PAD}' y='{HEIGHT - 8}' font-size='11'>step {x0:g}</text>",
        f"<text x='{WIDTH - PAD - 50}' y='{HEIGHT - 8}' font-size='11'>step {x1:g}</text>",
        f"<text x='2' y='{PAD}' font-size='11'>{y1:.3g}</text>",
        f"<text x='2' y='{HEIGHT - PAD}' font-size='11'>{y0:.3g}</text>",
    ]
    for i, (label, values) in enumerate(series.items()):
        color = colors[i % len(colors)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in values if math.isfinite(y))
        parts.append(f"<polyline fill='none' stroke='{color}' stroke-width='2' points='{coords}'/>")
        parts.append(
            f"<text x='{WIDTH - PAD - 140}' y='{PAD + 14 * i}' font-size='11' fill='{color}'>{html.escape(label)}</text>"
        )
    svg = f"<svg width='{WIDTH}' height='{HEIGHT}' xmlns='http://www.w3.org/2000/svg'>{''.join(parts)}</svg>"
    return f"<div class='chart'><h3>{html.escape(title)}</h3>{svg}</div>"


def _eval_samples(evals: list[dict]) -> str:
    """A few greedy held-out completions per evaluation: what the model actually writes."""
    rows = []
    for row in evals:
        for sample in row.get("samples", []):
            cells = (row["step"], sample["prompt"], sample["completion"], sample.get("answer"), f"{sample['score']:g}")
            rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    if not rows:
        return ""
    head = "<tr><th>step</th><th>prompt</th><th>completion</th><th>answer</th><th>score</th></tr>"
    return f"<h2>Held-out samples</h2><table>{head}{''.join(rows)}</table>"


def render_report(name: str, steps: list[dict], evals: list[dict], summary: dict) -> str:
    """HTML with reward, held-out accuracy, mismatch and sync-latency curves, plus the summary."""

    def series(key: str, rows: list[dict]) -> list[tuple[float, float]]:
        return [(row["step"], float(row[key])) for row in rows if row.get(key) is not None]

    charts = [
        _chart("Training reward (mean)", {"reward": series("reward_mean", steps)}),
        _chart(
            "Held-out accuracy ± standard error",
            {
                "accuracy": series("accuracy", evals),
                "+1 s.e.": [
                    (x, y + (r.get("accuracy_stderr") or 0.0)) for (x, y), r in zip(series("accuracy", evals), evals, strict=True)
                ],
                "-1 s.e.": [
                    (x, y - (r.get("accuracy_stderr") or 0.0)) for (x, y), r in zip(series("accuracy", evals), evals, strict=True)
                ],
            },
        ),  # fmt: skip
        _chart("Held-out reward", {"reward": series("reward_mean", evals)}),
        _chart(
            "Train-rollout mismatch, mean |dlogp|",
            {
                "batch (decode)": series("mismatch_mean_abs", steps),
                "canary prefill": series("canary_mean_abs_dlogp", steps),
                "canary decode": series("canary_decode_mean_abs_dlogp", steps),
            },
        ),
        _chart("Adapter sync latency (s)", {"sync": series("sync_seconds", steps)}),
        _chart("Step time (s)", {"step": series("step_seconds", steps)}),
        _chart("Loss", {"loss": series("loss", steps)}),
    ]
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Orbit run {html.escape(name)}</title>
<style>body{{font-family:sans-serif;margin:24px}} .chart{{display:inline-block;margin:8px}}
pre{{background:#f6f6f6;padding:12px}} td,th{{border:1px solid #ddd;padding:4px 8px;text-align:left;white-space:pre-wrap}}
table{{border-collapse:collapse}}</style></head>
<body><h1>Orbit run: {html.escape(name)}</h1>
<pre>{html.escape(json.dumps(summary, indent=2))}</pre>
{"".join(charts)}
{_eval_samples(evals)}
</body></html>
"""
