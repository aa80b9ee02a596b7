"""The serving page's figures, from a run's records: a timeline per request, the block pool, each
step's tokens against the budget, the queues, KV usage by blocks and by tokens written, the
prefix-cache hit rate and the latency percentiles. The three policies side by side are in
``serving_compare.py``.

Pure Plotly over ``engine/serving/records.py``'s dataclasses (the arithmetic in
``serving_data.py``); no streamlit, no torch. Float data goes out as float32 arrays, heights are
fixed, margins preset (docs/ARCHITECTURE.md, "Plotly figures").
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go

from kvviz.charts import serving_data as sd
from kvviz.charts.server import latency_bars

if TYPE_CHECKING:
    from kvviz.engine.serving.records import RequestRecord, StepRecord

# The timeline's colours, by ``serving_data`` state code (waiting, prefill, decode, idle running, preempted).
STATE_COLOURS = ("#ced4da", "#1c7ed6", "#2f9e44", "#94d82d", "#e03131")
FREE, CACHED, SHARED = "#dee2e6", "#868e96", "#7048e8"
OWNERS = ("#1c7ed6", "#f08c00", "#2f9e44", "#e8590c", "#0c8599", "#d6336c", "#5c940d", "#9c36b5",
          "#1864ab", "#a61e4d")
LEGEND_BELOW = dict(orientation="h", yref="container", y=0.0, yanchor="bottom", x=0)
LEGEND_NAMES = ("waiting", "prefill chunk", "decode", "running, idle", "preempted")
HEIGHT = 340


def _f32(values: np.ndarray | Sequence[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def _discrete_scale(colours: Sequence[str]) -> list[list[object]]:
    """A heatmap colourscale mapping integer codes 0..n-1 (zmin 0, zmax n-1) to flat colours."""
    n = len(colours)
    scale: list[list[object]] = []
    for i, c in enumerate(colours):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return scale


def timeline(steps: Sequence[StepRecord], request_ids: Sequence[str], upto: int | None = None) -> go.Figure:
    """One row per request, one column per step: waiting, a prefill chunk, a decode, running but not
    scheduled, preempted (until its recompute); blank before arrival and after the finish (an ✕).
    ``upto``: a dashed line at that step (the replay's)."""
    z = sd.request_states(steps, request_ids)
    x = _f32([s.step for s in steps])
    n = len(STATE_COLOURS)
    fig = go.Figure(go.Heatmap(
        z=z, x=x, y=list(request_ids), zmin=-0.5, zmax=n - 0.5, colorscale=_discrete_scale(STATE_COLOURS),
        showscale=False, xgap=1 if len(steps) <= 120 else 0, ygap=1 if len(request_ids) <= 40 else 0,
        customdata=np.array([[sd.STATE_NAMES[int(v)] if np.isfinite(v) else "" for v in row] for row in z],
                            dtype=object),
        hovertemplate="%{y} · step %{x}: %{customdata}<extra></extra>"))
    # A legend for the heatmap's colours: one invisible point per state (short names: a half-width
    # chart holds them on two rows; the hover says each in full).
    for name, colour in zip(LEGEND_NAMES, STATE_COLOURS):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name, showlegend=True,
                                 marker=dict(symbol="square", size=12, color=colour)))
    done = sd.finish_points(steps)
    if done:
        fig.add_trace(go.Scatter(x=_f32([d[0] for d in done]), y=[d[1] for d in done], mode="markers",
                                 name="finished", marker=dict(symbol="x-thin", size=9, line=dict(width=2, color="#212529")),
                                 hovertemplate="%{y} finished at step %{x}<extra></extra>"))
    if upto is not None:
        fig.add_vline(x=upto, line=dict(color="#212529", dash="dash", width=1))
    rows = max(len(request_ids), 1)
    fig.update_layout(
        title=dict(text="Each request's life, step by step",
                   subtitle=dict(text="a row per request, a column per scheduler step")),
        xaxis=dict(title="scheduler step", showgrid=False, ticklabeloverflow="allow"),
        yaxis=dict(autorange="reversed", type="category", showgrid=False, ticklabeloverflow="allow",
                   showticklabels=rows <= 40),
        height=min(760, max(360, 250 + 16 * rows)), margin=dict(l=70, r=10, t=70, b=130), plot_bgcolor="white",
        legend=LEGEND_BELOW)
    return fig


def _columns(n: int) -> int:
    """Blocks per grid row: 16 up to 128 blocks, 32 up to 512, 64 beyond (a cell stays a few px wide)."""
    return 16 if n <= 128 else 32 if n <= 512 else 64


def pool_grid(step: StepRecord, request_ids: Sequence[str], block_size: int) -> go.Figure:
    """The pool after one step, a cell per block: coloured by the request that holds it (the palette
    cycles by the request's place in ``request_ids``), shared (ref > 1) purple, cached (ref 0, hashed,
    evictable) grey, free pale. The hover names the owners."""
    n = len(step.block_state)
    cols = _columns(n)
    rows = max(1, -(-n // cols))
    place = {r: i for i, r in enumerate(request_ids)}
    # codes: 0 free, 1 cached, 2 shared, 3.. an owner's colour
    colours = (FREE, CACHED, SHARED, *OWNERS)
    z = np.full((rows, cols), np.nan, dtype=np.float32)
    hover = np.full((rows, cols), "", dtype=object)
    for b, state in enumerate(step.block_state):
        owners = step.block_owner[b] if b < len(step.block_owner) else ()
        if state == "shared" or len(owners) > 1:
            code, label = 2, "shared by " + ", ".join(owners)
        elif owners:
            code, label = 3 + place.get(owners[0], 0) % len(OWNERS), f"held by {owners[0]}"
        elif state == "cached":
            code, label = 1, "cached (ref 0, evictable)"
        elif state == "used":
            code, label = 3, "used"
        else:
            code, label = 0, "free"
        z[b // cols, b % cols] = code
        hover[b // cols, b % cols] = f"block {b}: {label}"
    fig = go.Figure(go.Heatmap(
        z=z, zmin=-0.5, zmax=len(colours) - 0.5, colorscale=_discrete_scale(colours), showscale=False,
        xgap=2 if n <= 128 else 1, ygap=2 if n <= 128 else 1, customdata=hover,
        hovertemplate="%{customdata}<extra></extra>"))
    for name, colour in (("free", FREE), ("cached", CACHED), ("shared", SHARED),
                         ("held (a colour per request)", OWNERS[0])):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker=dict(symbol="square", size=12, color=colour,
                                             line=dict(width=1, color="#868e96"))))
    fig.update_layout(
        title=dict(text=f"Block pool after step {step.step}",
                   subtitle=dict(text=f"{n} blocks of {block_size} tokens · {step.blocks_used} used, "
                                      f"{step.blocks_cached} cached, {step.blocks_free} free")),
        xaxis=dict(visible=False, range=[-0.5, cols - 0.5]),
        yaxis=dict(visible=False, autorange="reversed"),
        height=max(300, 180 + max(10, min(26, 400 // rows)) * rows), margin=dict(l=10, r=10, t=70, b=90),
        plot_bgcolor="white", legend=LEGEND_BELOW)
    return fig


def _step_marker(fig: go.Figure, upto: int | None) -> None:
    if upto is not None:
        fig.add_vline(x=upto, line=dict(color="#212529", dash="dash", width=1))


def _lines_layout(fig: go.Figure, title: str, subtitle: str, y_title: str, **yaxis: object) -> go.Figure:
    fig.update_layout(title=dict(text=title, subtitle=dict(text=subtitle)), height=HEIGHT,
                      xaxis=dict(title="scheduler step", ticklabeloverflow="allow"),
                      yaxis=dict(title=y_title, rangemode="tozero", ticklabeloverflow="allow", **yaxis),
                      # t=90: the subtitle clears a "100%" tick at the top of the axis (1366 px, issue 36's check)
                      margin=dict(l=70, r=10, t=90, b=100), legend=LEGEND_BELOW, plot_bgcolor="white")
    fig.update_xaxes(showgrid=True, gridcolor="#e9ecef")
    fig.update_yaxes(showgrid=True, gridcolor="#e9ecef")
    return fig


def step_composition(steps: Sequence[StepRecord], upto: int | None = None) -> go.Figure:
    """Each step's scheduled tokens, prefill chunks and decodes stacked, against the token budget."""
    s = sd.series(steps, 1)
    fig = go.Figure()
    fig.add_trace(go.Bar(x=_f32(s["step"]), y=_f32(s["prefill"]), name="prefill tokens", marker_color="#1c7ed6"))
    fig.add_trace(go.Bar(x=_f32(s["step"]), y=_f32(s["decode"]), name="decode tokens", marker_color="#2f9e44"))
    fig.add_trace(go.Scatter(x=_f32(s["step"]), y=_f32(s["budget"]), name="token budget", mode="lines",
                             line=dict(color="#c92a2a", dash="dash", shape="hv")))
    fig.update_layout(barmode="stack", bargap=0.1)
    _step_marker(fig, upto)
    return _lines_layout(fig, "Tokens per step", "prefill chunks and decodes share one budget", "tokens")


def queues(steps: Sequence[StepRecord], upto: int | None = None) -> go.Figure:
    """Requests running and waiting after each step; a red mark where a step preempted one."""
    s = sd.series(steps, 1)
    x = _f32(s["step"])
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=_f32(s["running"]), name="running", mode="lines",
                             line=dict(color="#2f9e44", shape="hv")))
    fig.add_trace(go.Scatter(x=x, y=_f32(s["waiting"]), name="waiting", mode="lines",
                             line=dict(color="#e8590c", shape="hv")))
    hit = s["preempted"] > 0
    if hit.any():
        fig.add_trace(go.Scatter(x=x[hit], y=_f32(s["preempted"][hit]), name="preempted this step",
                                 mode="markers", marker=dict(color="#e03131", symbol="triangle-down", size=10)))
    _step_marker(fig, upto)
    return _lines_layout(fig, "Queues", "after each step", "requests", tickformat=",d")


def kv_usage(steps: Sequence[StepRecord], block_size: int, upto: int | None = None) -> go.Figure:
    """KV usage in % of the pool: by blocks held (what vLLM's "KV cache usage" reports) and by K/V
    rows actually written; the band between them is the last blocks' unfilled slots."""
    s = sd.series(steps, block_size)
    x = _f32(s["step"])
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=_f32(s["usage_tokens_pct"]), name="by tokens written", mode="lines",
                             line=dict(color="#1c7ed6", shape="hv")))
    fig.add_trace(go.Scatter(x=x, y=_f32(s["usage_blocks_pct"]), name="by blocks held (vLLM's usage)",
                             mode="lines", fill="tonexty", fillcolor="rgba(240,140,0,0.25)",
                             line=dict(color="#f08c00", shape="hv"),
                             customdata=_f32(s["waste_tokens"]),
                             hovertemplate="step %{x}: %{y:.1f}% of blocks; %{customdata:.0f} slots held "
                                           "but empty<extra></extra>"))
    _step_marker(fig, upto)
    return _lines_layout(fig, "KV usage", "shaded: slots in held blocks not written yet (last-block waste)",
                         "% of the pool", range=[0, 100], ticksuffix="%")


def prefix_hit_rate(steps: Sequence[StepRecord], upto: int | None = None) -> go.Figure:
    """The prefix cache's hit rate so far: hit tokens / queried prompt tokens, cumulative (vLLM's
    prefix_cache_hits over prefix_cache_queries)."""
    s = sd.series(steps, 1)
    fig = go.Figure(go.Scatter(x=_f32(s["step"]), y=_f32(s["hit_rate_pct"]), mode="lines",
                               name="hit rate", line=dict(color="#7048e8", shape="hv")))
    _step_marker(fig, upto)
    last = steps[-1] if steps else None
    sub = (f"{last.prefix_hit_tokens:,} of {last.prefix_query_tokens:,} prompt tokens found cached"
           if last is not None and last.prefix_query_tokens else "no prompt looked up yet")
    return _lines_layout(fig, "Prefix-cache hit rate", sub, "% of queried tokens", range=[0, 100], ticksuffix="%")


def latency_percentiles(requests: Mapping[str, RequestRecord] | Sequence[RequestRecord]) -> go.Figure:
    """TTFT, TPOT (inter-token) and end-to-end latency, p50/p90/p99 in ms."""
    reqs = list(requests.values()) if isinstance(requests, Mapping) else list(requests)
    rows = [(name, *sd.percentiles(getattr(r, attr) for r in reqs))
            for name, attr in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("end to end", "e2e_ms"))]
    fig = latency_bars(rows)  # type: ignore[arg-type]
    # Whole milliseconds, small: three bars a group in a half-width chart (one decimal ran together).
    fig.update_traces(text=None, texttemplate="%{y:,.0f}", textfont_size=11)
    fig.update_layout(title=dict(text="Latency percentiles"), margin=dict(l=70, r=10, t=80, b=40),
                      legend=dict(orientation="h", y=1.02, yanchor="bottom", x=1, xanchor="right"))
    return fig
