"""Plotly figures for the Live server page: a server's KV usage, queues and throughput over time.

Plain numbers in (seconds since the first reading, and the values read), go.Figure out; no streamlit.
A value the server did not report is None and is drawn as a gap, never as 0.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

HEIGHT = 460  # fixed: Streamlit otherwise resizes charts on every rerun


def _arr(values: Sequence[float | None]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float32)


def server_timeline(t: Sequence[float], usage: Sequence[float | None], running: Sequence[float | None],
                    waiting: Sequence[float | None], tok_s: Sequence[float | None],
                    title: str = "") -> go.Figure:
    """Three stacked panels over time: KV cache usage (%), running and waiting requests, tokens/s."""
    x = _arr(t)
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("KV cache usage (% of the pool)", "Requests running and waiting",
                                        "Generated tokens per second (between readings)"))
    fig.add_trace(go.Scatter(x=x, y=_arr(usage) * 100, mode="lines+markers", name="KV usage %",
                             line=dict(color="#1c7ed6")), row=1, col=1)
    fig.add_trace(go.Scatter(x=x, y=_arr(running), mode="lines+markers", name="running",
                             line=dict(color="#2b8a3e", shape="hv")), row=2, col=1)
    fig.add_trace(go.Scatter(x=x, y=_arr(waiting), mode="lines+markers", name="waiting",
                             line=dict(color="#e8590c", shape="hv")), row=2, col=1)
    fig.add_trace(go.Scatter(x=x, y=_arr(tok_s), mode="lines+markers", name="tokens/s",
                             line=dict(color="#5f3dc4")), row=3, col=1)
    fig.update_yaxes(range=[0, 100], ticksuffix="%", row=1, col=1)
    fig.update_yaxes(rangemode="tozero", tickformat=",d", row=2, col=1)
    fig.update_yaxes(rangemode="tozero", row=3, col=1)
    fig.update_xaxes(title_text="seconds since the first reading", row=3, col=1)
    # The legend sits right of the panels: above them it would meet the first panel's title.
    fig.update_layout(height=HEIGHT, margin=dict(l=60, r=20, t=50 if title else 30, b=50),
                      legend=dict(orientation="v", y=1.0, x=1.01, yanchor="top"), title=title or None)
    return fig


def latency_bars(rows: Sequence[tuple[str, float | None, float | None, float | None]]) -> go.Figure:
    """TTFT and inter-token latency percentiles (ms): rows of (name, p50, p90, p99)."""
    fig = go.Figure()
    for i, (q, color) in enumerate((("p50", "#1c7ed6"), ("p90", "#f59f00"), ("p99", "#c92a2a"))):
        ys = _arr([r[1 + i] for r in rows])
        fig.add_trace(go.Bar(x=[r[0] for r in rows], y=ys, name=q, marker_color=color,
                             text=[f"{v:,.1f}" if np.isfinite(v) else "n/a" for v in ys], textposition="outside"))
    fig.update_layout(height=320, barmode="group", yaxis_title="milliseconds", margin=dict(l=60, r=20, t=30, b=40),
                      legend=dict(orientation="h", y=1.12, x=0))
    return fig
