"""The same workload under the three scheduling policies, side by side: aggregate throughput, and
TTFT and TPOT at p50/p90/p99. Pure Plotly from ``serving_data.RunSummary``s; no streamlit, no torch."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz.charts.serving_data import PERCENTILES, RunSummary

POLICY_NAMES = {"sequential": "one at a time", "static": "static batching", "continuous": "continuous batching"}
POLICY_COLOURS = {"sequential": "#868e96", "static": "#f08c00", "continuous": "#2f9e44"}


def _label(policy: str) -> str:
    return POLICY_NAMES.get(policy, policy)


def _v(x: float | None) -> float:
    return float("nan") if x is None else float(x)


def policy_comparison(runs: Mapping[str, RunSummary]) -> go.Figure:
    """Three panels: tokens/s per policy; TTFT percentiles; TPOT percentiles (ms), one bar group per
    percentile with a bar per policy. A figure that does not exist (a policy not run, no second
    token) is a gap, never 0."""
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.09,
                        subplot_titles=("Aggregate throughput (tokens/s)", "TTFT (ms)", "TPOT (ms)"))
    qs = [f"p{q}" for q in PERCENTILES]
    for policy, s in runs.items():
        colour = POLICY_COLOURS.get(policy, "#1c7ed6")
        tp = _v(s.throughput_tok_s)
        fig.add_trace(go.Bar(x=[_label(policy)], y=np.array([tp], dtype=np.float32), name=_label(policy),
                             marker_color=colour, legendgroup=policy, showlegend=False,
                             text=[f"{tp:,.1f}" if np.isfinite(tp) else "n/a"], textposition="outside"),
                      row=1, col=1)
        for col, values in ((2, s.ttft_ms), (3, s.tpot_ms)):
            ys = np.array([_v(v) for v in values], dtype=np.float32)
            fig.add_trace(go.Bar(x=qs, y=ys, name=_label(policy), marker_color=colour, legendgroup=policy,
                                 showlegend=col == 2), row=1, col=col)
    fig.update_layout(barmode="group", height=380, margin=dict(l=60, r=10, t=60, b=90),
                      legend=dict(orientation="h", yref="container", y=0.0, yanchor="bottom", x=0),
                      plot_bgcolor="white")
    fig.update_yaxes(rangemode="tozero", gridcolor="#e9ecef")
    tops = [_v(s.throughput_tok_s) for s in runs.values()]
    finite = [t for t in tops if np.isfinite(t)]
    if finite:  # room for the labels above the bars
        fig.update_yaxes(range=[0, max(finite) * 1.2], row=1, col=1)
    return fig
