"""The run report: one self-contained HTML file (report.html) with the run's curves drawn by plotly.

plotly.js is embedded once, so the file opens offline in any browser. The charts read the rows of
metrics.jsonl (a resumed run's rows include those its checkpoint carried, so its history is one):
reward with its spread across the samples, held-out accuracy with its standard error, the
train-rollout mismatch and the canary, importance weights and clipping, KL to the reference, the
adapter sync's latency, where each step's time went, memory, then a few held-out completions per
evaluation, the summary and the job's config.
"""

from __future__ import annotations

import html
import json

TIMING_SUFFIX = "_s"  # step-row fields that time a phase of the step: generate_s, reward_s, train_s, sync_s, ...
GIB = 1 << 30


def _series(rows: list[dict], key: str, scale: float = 1.0) -> tuple[list, list]:
    points = [(row["step"], row[key] / scale) for row in rows if isinstance(row.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def _lines(title: str, rows: list[dict], keys: dict[str, str], *, y_title: str = "", log_y: bool = False, scale: float = 1.0):
    """A figure with one line per KEYS entry ({field: legend}); None when no row has any of them."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for key, label in keys.items():
        xs, ys = _series(rows, key, scale)
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=label))
    if not fig.data:
        return None
    fig.update_layout(title=title, xaxis_title="step", yaxis_title=y_title)
    if log_y:
        fig.update_yaxes(type="log")
    return fig


def _reward(steps: list[dict]):
    """Mean training reward with a band of ± one standard deviation across the step's samples."""
    import plotly.graph_objects as go

    xs, mean = _series(steps, "reward_mean")
    if not xs:
        return None
    std = [row.get("reward_std") or 0.0 for row in steps if isinstance(row.get("reward_mean"), (int, float))]
    fig = go.Figure([
        go.Scatter(x=xs, y=[m + s for m, s in zip(mean, std, strict=True)], mode="lines", line={"width": 0}, showlegend=False, hoverinfo="skip"),
        go.Scatter(x=xs, y=[m - s for m, s in zip(mean, std, strict=True)], mode="lines", line={"width": 0}, fill="tonexty",
                   fillcolor="rgba(31,119,180,0.2)", name="± 1 std across samples"),
        go.Scatter(x=xs, y=mean, mode="lines+markers", name="mean reward", line={"color": "#1f77b4"}),
    ])  # fmt: skip
    fig.update_layout(title="Training reward", xaxis_title="step", yaxis_title="reward")
    return fig


def _heldout(evals: list[dict]):
    """Held-out accuracy with error bars of one standard error (and held-out reward, if it differs)."""
    import plotly.graph_objects as go

    rows = [row for row in evals if isinstance(row.get("accuracy"), (int, float))]
    if not rows:
        return None
    fig = go.Figure(go.Scatter(
        x=[r["step"] for r in rows], y=[r["accuracy"] for r in rows], mode="lines+markers", name="accuracy",
        error_y={"type": "data", "array": [r.get("accuracy_stderr") or 0.0 for r in rows], "visible": True},
    ))  # fmt: skip
    fig.update_layout(title=f"Held-out accuracy ± 1 standard error ({rows[-1].get('examples', '?')} prompts)",
                      xaxis_title="step", yaxis_title="accuracy", yaxis_range=[0, 1.02])  # fmt: skip
    return fig


def _step_time(steps: list[dict]):
    """Stacked bars: the seconds of each timed phase of every step, and the rest of the step."""
    import plotly.graph_objects as go

    phases = [k for k in dict.fromkeys(k for row in steps for k in row) if k.endswith(TIMING_SUFFIX) and k != "step_seconds"]
    if not steps or not phases:
        return None
    xs = [row["step"] for row in steps]
    fig = go.Figure([go.Bar(x=xs, y=[row.get(p) or 0.0 for row in steps], name=p.removesuffix(TIMING_SUFFIX)) for p in phases])
    other = [max(row.get("step_seconds", 0.0) - sum(row.get(p) or 0.0 for p in phases), 0.0) for row in steps]
    fig.add_trace(go.Bar(x=xs, y=other, name="other"))
    fig.update_layout(title="Step time by phase", barmode="stack", xaxis_title="step", yaxis_title="seconds")
    return fig


def _figures(steps: list[dict], evals: list[dict]) -> list:
    figures = [
        _reward(steps),
        _heldout(evals),
        _lines("Train-rollout mismatch (mean |Δ log p| per token)", steps, {
            "mismatch_mean_abs": "batch, mean", "mismatch_max_abs": "batch, max", "mismatch_k3_kl": "batch, k3 KL",
            "canary_mean_abs_dlogp": "canary prefill", "canary_decode_mean_abs_dlogp": "canary decode",
            "canary_tolerance": "canary tolerance"}, y_title="|Δ log p|", log_y=True),  # fmt: skip
        _lines("Importance weights and clipping", steps, {
            "is_weight_mean": "mean IS weight", "is_over_cap_fraction": "share over the cap",
            "mis_rejected_fraction": "share rejected (MIS)", "clip_fraction": "PPO clip share",
            "dual_clip_fraction": "dual-clip share"}),  # fmt: skip
        _lines("KL to the reference", steps, {"kl": "KL"}),
        _lines("Loss and gradient norm", steps, {"loss": "loss", "policy_loss": "policy loss", "grad_norm": "grad norm"}),
        _lines("Adapter sync latency", steps, {"sync_seconds": "sync"}, y_title="seconds"),
        _step_time(steps),
        _lines("Memory", steps, {"peak_rss_bytes": "peak RSS", "rss_at_step_start_bytes": "RSS at step start",
                                 "cuda_peak_allocated_bytes": "CUDA peak allocated",
                                 "cuda_peak_reserved_bytes": "CUDA peak reserved"}, y_title="GiB", scale=GIB),  # fmt: skip
        _lines("Throughput", steps, {"tokens_per_second": "generated tokens / s"}),
    ]
    return [f for f in figures if f is not None]


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
    return f"<h2>Held-out samples</h2><table id='heldout-samples'>{head}{''.join(rows)}</table>"


def render_report(name: str, steps: list[dict], evals: list[dict], summary: dict, config: dict | None = None) -> str:
    """The report's HTML (see the module docstring); CONFIG: the job spec as JSON."""
    import plotly.io as pio

    charts = []
    for i, fig in enumerate(_figures(steps, evals)):
        fig.update_layout(template="plotly_white", width=620, height=340, margin={"l": 60, "r": 20, "t": 50, "b": 50})
        # plotly.js once, inline (offline); every chart a div of class chart
        div = pio.to_html(fig, include_plotlyjs=(i == 0), full_html=False, div_id=f"chart-{i}",
                          config={"displaylogo": False, "responsive": False})  # fmt: skip
        charts.append(f"<div class='chart'>{div}</div>")
    config_html = f"<h2>Config</h2><pre>{html.escape(json.dumps(config, indent=2))}</pre>" if config else ""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Orbit run {html.escape(name)}</title>
<style>body{{font-family:sans-serif;margin:24px}} .chart{{display:inline-block;margin:8px;vertical-align:top}}
pre{{background:#f6f6f6;padding:12px}} td,th{{border:1px solid #ddd;padding:4px 8px;text-align:left;white-space:pre-wrap}}
table{{border-collapse:collapse}}</style></head>
<body><h1>Orbit run: {html.escape(name)}</h1>
<p>{len(steps)} steps, {len(evals)} evaluations. Charts: {len(charts)}.</p>
<div id="charts">{"".join(charts)}</div>
{_eval_samples(evals)}
<h2>Summary</h2><pre>{html.escape(json.dumps(summary, indent=2))}</pre>
{config_html}
</body></html>
"""
