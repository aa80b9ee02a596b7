"""Plotly figures for the KV memory calculator: plain numbers in, go.Figure out.

No streamlit and no torch: the page computes bytes with kvviz.calculator and hands them here, so the
same figures can be rebuilt in a notebook or a test. Byte counts arrive as exact ints and are
converted to GiB (float32, as every chart in kvviz sends) only for plotting; hover text shows GB too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import plotly.graph_objects as go

from kvviz.units import GB, GIB, fmt_usd
HEIGHT = 420  # fixed: Streamlit otherwise resizes charts on every rerun
_CAPACITY_COLORS = ("#c92a2a", "#e8590c", "#5f3dc4", "#2b8a3e")


@dataclass(frozen=True)
class Curve:
    """One line of the memory-vs-context chart."""

    label: str
    contexts: tuple[int, ...]  # tokens
    bytes: tuple[int, ...]  # memory at each context
    model: str = ""  # with dtype: the chart colours by model and dashes by dtype, one legend line each
    dtype: str = ""


# Distinct hues for the models compared (a legend of similar blues cannot be read), one dash per dtype.
MODEL_COLORS = ("#1c7ed6", "#e8590c", "#2b8a3e", "#ae3ec9", "#f59f00", "#0ca678", "#d6336c", "#495057")
DTYPE_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")


def _plain(text: str) -> str:
    """Plotly renders a subset of HTML in titles, names and hover text; model names can come from an
    imported config.json, so they are shown as text, never as markup."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _gib(values: Sequence[int | float]) -> np.ndarray:
    return np.asarray([v / GIB for v in values], dtype=np.float32)


def _gb(values: Sequence[int | float]) -> np.ndarray:
    return np.asarray([v / GB for v in values], dtype=np.float32)


def _tokens_label(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


def tick_label(v: float) -> str:
    """A log-axis label people read at a glance: 1, 10, 100, 1k, 10k, 1M; 0.5, 0.01 below one."""
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if v >= size:
            return f"{v / size:g}{unit}"
    return f"{v:g}"


def log_ticks(values: Sequence[float]) -> tuple[list[float], list[str]]:
    """Tick values and labels for a log axis over ``values``: every power of ten, and 2 and 5 in
    each decade when the data spans less than two decades (Plotly's own labels there are bare
    digits, "9 | 1 | 2 3 4 ... | 10", which no one reads as 0.9, 1, 2, ...)."""
    pos = [float(v) for v in values if v is not None and np.isfinite(v) and v > 0]
    if not pos:
        return [], []
    lo, hi = int(np.floor(np.log10(min(pos)))), int(np.ceil(np.log10(max(pos))))
    steps = (1, 2, 5) if max(pos) / min(pos) < 100 else (1,)
    vals = [m * 10.0**k for k in range(lo, max(hi, lo + 1) + 1) for m in steps]
    vals = [float(f"{v:.6g}") for v in vals]  # 0.30000000000000004 -> 0.3
    return vals, [tick_label(v) for v in vals]


def _log_axes(fig: go.Figure, xs: Sequence[float] | None, ys: Sequence[float] | None) -> None:
    """Both axes log, each labelled 1, 10, 100, 1k... (``None``: keep that axis's own ticks)."""
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    for update, values in ((fig.update_xaxes, xs), (fig.update_yaxes, ys)):
        if values is not None:
            vals, text = log_ticks(values)
            update(tickmode="array", tickvals=vals, ticktext=text)


def _layout(fig: go.Figure, title: str, x_title: str, y_title: str, subtitle: str = "") -> go.Figure:
    """Title (a short one: a half-width chart at 1366 px holds about 45 characters), with the
    settings it was drawn for as a subtitle under it."""
    head = dict(text=_plain(title), subtitle=dict(text=_plain(subtitle))) if subtitle else _plain(title)
    fig.update_layout(title=head, height=HEIGHT, margin=dict(l=60, r=20, t=80 if subtitle else 60, b=50),
                      hovermode="closest", template="plotly_white", font=dict(size=15, color="#212529"))
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text=y_title)
    return fig


def memory_vs_context(curves: Sequence[Curve], capacities: Sequence[tuple[str, int]] = (), log_axes: bool = False,
                      title: str = "KV cache vs context length") -> go.Figure:
    """One line per (model, dtype); dashed horizontal lines for GPU capacities (label, bytes)."""
    fig = go.Figure()
    models = list(dict.fromkeys(c.model for c in curves if c.model))
    dtypes = list(dict.fromkeys(c.dtype for c in curves if c.dtype))
    # Several models and dtypes: colour = model, dash = dtype, and a legend of models + dtypes
    # (3 models x 4 dtypes: 7 lines, not 12), each line still named in its hover.
    grouped = len(models) > 1 and len(dtypes) > 1 and all(c.model and c.dtype for c in curves)
    for i, c in enumerate(curves):
        style: dict = {}
        if grouped:
            color = MODEL_COLORS[models.index(c.model) % len(MODEL_COLORS)]
            style = dict(line=dict(color=color, dash=DTYPE_DASHES[dtypes.index(c.dtype) % len(DTYPE_DASHES)]),
                         marker=dict(color=color, size=5), showlegend=False)
        else:
            style = dict(line=dict(color=MODEL_COLORS[i % len(MODEL_COLORS)]))
        fig.add_trace(go.Scatter(
            x=np.asarray(c.contexts, dtype=np.float32), y=_gib(c.bytes), customdata=_gb(c.bytes),
            name=_plain(c.label), mode="lines+markers", **style,
            hovertemplate="%{x:,} tokens: %{y:.3f} GiB (%{customdata:.3f} GB)<extra>" + _plain(c.label) + "</extra>"))
    if grouped:  # legend-only entries: one per model (its colour), one per dtype (its dash, in grey)
        for j, m in enumerate(models):
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=_plain(m), hoverinfo="skip",
                                     line=dict(color=MODEL_COLORS[j % len(MODEL_COLORS)], width=4)))
        for j, d in enumerate(dtypes):
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=_plain(d), hoverinfo="skip",
                                     line=dict(color="#495057", dash=DTYPE_DASHES[j % len(DTYPE_DASHES)], width=2.5)))
    xs = sorted({x for c in curves for x in c.contexts}) or [1]
    for i, (label, cap) in enumerate(capacities):
        # A trace, not add_hline: shape annotations on log axes are placed in log units and would
        # blow the autorange up; a two-point line works on both axis types and shows in the legend.
        fig.add_trace(go.Scatter(
            x=np.asarray([xs[0], xs[-1]], dtype=np.float32), y=_gib([cap, cap]), name=label, mode="lines",
            line=dict(dash="dash", color=_CAPACITY_COLORS[i % len(_CAPACITY_COLORS)]),
            hovertemplate=f"{_plain(label)}: %{{y:.2f}} GiB<extra></extra>"))
    _layout(fig, title, "context length (tokens)", "memory (GiB)")
    ticks = [x for x in xs if x & (x - 1) == 0]  # the powers of two, labelled 1K, 2K, ... 1M
    fig.update_xaxes(tickvals=ticks, ticktext=[_tokens_label(x) for x in ticks])
    if log_axes:
        _log_axes(fig, None, [float(v) / GIB for c in curves for v in c.bytes] + [cap / GIB for _, cap in capacities])
    return fig


def weights_and_kv_by_batch(batches: Sequence[int], weights_bytes: int, kv_bytes: Sequence[int],
                            capacity: tuple[str, int] | None = None,
                            title: str = "Weights + KV cache vs batch size") -> go.Figure:
    """Stacked bars: the weights (constant) under the KV cache (grows with the batch)."""
    x = [str(b) for b in batches]  # categorical: evenly spaced bars for 1, 2, 4, ... 256
    w = [weights_bytes] * len(batches)
    fig = go.Figure([
        go.Bar(x=x, y=_gib(w), customdata=_gb(w), name="weights",
               hovertemplate="batch %{x}: weights %{y:.2f} GiB (%{customdata:.2f} GB)<extra></extra>"),
        go.Bar(x=x, y=_gib(kv_bytes), customdata=_gb(kv_bytes), name="KV cache",
               hovertemplate="batch %{x}: KV %{y:.2f} GiB (%{customdata:.2f} GB)<extra></extra>"),
    ])
    fig.update_layout(barmode="stack", legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0))
    fig.update_xaxes(type="category")  # digits would otherwise become a numeric axis
    if capacity is not None:
        fig.add_hline(y=capacity[1] / GIB, line_dash="dash", line_color=_CAPACITY_COLORS[0],
                      annotation_text=_plain(capacity[0]), annotation_position="top left")
    _layout(fig, title, "batch size (requests)", "memory (GiB)")
    # The legend's row sits on the plot's top edge: a row more of top margin keeps the title above it
    # (at 1366 px they overprinted).
    fig.update_layout(margin_t=fig.layout.margin.t + 28)
    return fig


def attention_variants(variants: Sequence[tuple[str, int]], title: str = "Same shape, different attention") -> go.Figure:
    """One bar per attention kind (label, KV bytes), labelled with its size."""
    labels = [_plain(v[0]) for v in variants]
    vals = [v[1] for v in variants]
    fig = go.Figure(go.Bar(
        x=labels, y=_gib(vals), customdata=_gb(vals), text=[f"{b / GIB:.3g} GiB" for b in vals],
        textposition="outside", hovertemplate="%{x}: %{y:.3f} GiB (%{customdata:.3f} GB)<extra></extra>"))
    top = max(vals) / GIB if vals else 1.0
    fig.update_yaxes(range=[0, top * 1.15 if top > 0 else 1])  # room for the text above the tallest bar
    return _layout(fig, title, "attention kind", "KV cache (GiB)")


# The per-layer strip and the cost charts (calculator round 2).
KIND_COLORS = {"full": "#1c7ed6", "mla": "#1c7ed6", "sliding": "#37b24d", "chunked": "#f59f00", "linear": "#ae3ec9"}
STRIP_HEIGHT = 260  # fixed, like HEIGHT: one short row of bars


@dataclass(frozen=True)
class LayerBar:
    """One layer of the strip: its kind, what it holds at the context, and the bytes that takes."""

    index: int
    kind: str  # full, mla, sliding, chunked, linear
    label: str  # e.g. "sliding (window 512)"
    tokens: int  # tokens held per sequence (0 for linear)
    bytes: int  # KV (or, for linear layers, state) bytes, all sequences


def layer_strip(bars: Sequence[LayerBar], title: str = "What each layer holds") -> go.Figure:
    """One bar per layer, coloured by kind, as tall as the bytes it holds: the layout at a glance."""
    fig = go.Figure()
    for kind in dict.fromkeys(b.kind for b in bars):
        sel = [b for b in bars if b.kind == kind]
        what = "state" if kind == "linear" else "KV"
        fig.add_trace(go.Bar(
            x=np.asarray([b.index for b in sel], dtype=np.float32), y=_gib([b.bytes for b in sel]),
            customdata=np.asarray([[b.tokens, b.bytes / GB] for b in sel], dtype=np.float32),
            text=[_plain(b.label) for b in sel], name=_plain(kind), marker_color=KIND_COLORS.get(kind, "#868e96"),
            hovertemplate="layer %{x}: %{text}<br>holds %{customdata[0]:,} tokens per sequence<br>"
                          f"{what} %{{y:.4f}} GiB (%{{customdata[1]:.4f}} GB)<extra></extra>"))
    fig.update_layout(barmode="overlay", bargap=0.1, legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0))
    _layout(fig, title, "layer", "memory (GiB)")
    fig.update_layout(height=STRIP_HEIGHT)
    return fig


@dataclass(frozen=True)
class CostSeries:
    """One line of the cost charts: the roofline at each batch, for one KV dtype."""

    label: str
    batches: tuple[int, ...]
    usd_per_million: tuple[float, ...]  # empty when no price is set
    tokens_per_s: tuple[float, ...]


def cost_vs_batch(series: Sequence[CostSeries], title: str = "Cost per 1M output tokens vs batch",
                  subtitle: str = "") -> go.Figure:
    """$ per 1M output tokens falls with the batch while the weights dominate each step."""
    fig = go.Figure()
    for s in series:
        if s.usd_per_million:
            fig.add_trace(go.Scatter(
                x=np.asarray(s.batches, dtype=np.float32), y=np.asarray(s.usd_per_million, dtype=np.float32),
                name=_plain(s.label), mode="lines+markers", text=[fmt_usd(u) for u in s.usd_per_million],
                hovertemplate="batch %{x:,}: %{text} per 1M tokens<extra>" + _plain(s.label) + "</extra>"))
    _layout(fig, title, "batch size (requests)", "$ per 1M output tokens", subtitle)
    _log_axes(fig, [b for s in series for b in s.batches], [u for s in series for u in s.usd_per_million])
    return fig


def tokens_per_s_vs_batch(series: Sequence[CostSeries], title: str = "Decode tokens/s vs batch",
                          subtitle: str = "") -> go.Figure:
    """Roofline throughput: grows almost linearly with the batch until the KV reads rival the weights."""
    fig = go.Figure()
    for s in series:
        fig.add_trace(go.Scatter(
            x=np.asarray(s.batches, dtype=np.float32), y=np.asarray(s.tokens_per_s, dtype=np.float32),
            name=_plain(s.label), mode="lines+markers",
            hovertemplate="batch %{x:,}: %{y:,.0f} tokens/s<extra>" + _plain(s.label) + "</extra>"))
    _layout(fig, title, "batch size (requests)", "tokens/s (upper bound)", subtitle)
    _log_axes(fig, [b for s in series for b in s.batches], [t for s in series for t in s.tokens_per_s])
    return fig
