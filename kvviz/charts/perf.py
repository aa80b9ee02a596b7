"""Pure Plotly builders for the race, prefill/decode and batching views (no streamlit import).

Inputs are Runs (one per cache mode) or the tables of ``measure.stats.aggregate`` (columns
series, x, median, min, max, n). Every figure has a title naming what was measured where,
axis labels with units, a fixed height, and min-max spread wherever there were repeats.
Arrays go out as float32: half the bytes of float64 in the browser message.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvviz.charts.style import wrap_words
from kvviz.units import MIB, fmt_bytes
from kvviz.measure.stats import MODE_LABELS, Fit, MachineProbe, per_step_ratios, rolling_median

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from kvviz.engine.generation.events import Run

HEIGHT = 380
# A half-width chart at 1366 px holds about 62 characters of subtitle (72 measured past its edge: "… · s").
SUBTITLE_CHARS = 58
SUBTITLE_LINE_PX = 24  # the subtitle's line height: the top margin grows this per extra line
# Below the plot: tick labels, the axis title and a legend of up to two rows (three modes at 440 px).
LEGEND_BOTTOM = 112
SMOOTH = 9  # steps in the rolling median drawn over noisy per-step timings
MODE_COLORS = {"static": "#1f77b4", "concat": "#9467bd", "none": "#d62728"}
PHASE_COLORS = {"prefill": "#ff7f0e", "decode": "#2ca02c"}
SERIES_COLORS = {
    "same prompt": "#1f77b4", "different prompts": "#ff7f0e",
    "short question": "#2ca02c", "long document": "#8c564b",
}
FONT = dict(size=14)


def f32(a: Sequence[float] | np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def where(run: "Run") -> str:
    """'model · device · dtype': the subtitle every run-based chart carries."""
    return f"{run.model} · {run.device} · {run.dtype}"


def _layout(fig: go.Figure, title: str, subtitle: str, x: str, y: str, height: int = HEIGHT) -> go.Figure:
    """These charts sit two to a row: at 1366 px one is about 440 px wide, so the subtitle wraps at
    SUBTITLE_CHARS (the top margin grows a line for each extra one) and the legend sits at the
    figure's bottom edge, under the x axis's title, never on it."""
    lines = wrap_words(subtitle, SUBTITLE_CHARS)
    fig.update_layout(
        # Pinned to the figure's top: Plotly centres an unpinned title in the top margin, so a taller
        # margin moved a wrapped subtitle down onto the top tick label instead of making room.
        title=dict(text=title, subtitle=dict(text="<br>".join(lines)), x=0.0, xanchor="left",
                   y=1.0, yref="container", yanchor="top", pad=dict(t=12)),
        height=height, template="plotly_white", font=FONT,
        margin=dict(l=70, r=20, t=80 + SUBTITLE_LINE_PX * (len(lines) - 1), b=LEGEND_BOTTOM),
        legend=dict(orientation="h", yref="container", yanchor="bottom", y=0.0, xanchor="left", x=0.0),
        hovermode="x unified",
    )
    fig.update_xaxes(title_text=x)
    fig.update_yaxes(title_text=y)
    return fig


def _log_axes(fig: go.Figure, x: bool = False, y: bool = True, **sel: int) -> None:
    """Log scale with labels at powers of ten only (the 2s and 5s in between crowd the axis)."""
    if x:
        fig.update_xaxes(type="log", dtick=1, **sel)
    if y:
        fig.update_yaxes(type="log", dtick=1, **sel)


def _runs_where(runs: Mapping[str, "Run"]) -> str:
    first = next(iter(runs.values()), None)
    return where(first) if first is not None else ""


def _ordered(runs: Mapping[str, "Run"]) -> list[tuple[str, "Run"]]:
    order = {m: i for i, m in enumerate(MODE_COLORS)}
    return sorted(runs.items(), key=lambda kv: order.get(kv[0], 99))


def _mode_line(fig: go.Figure, mode: str, x: np.ndarray, y: np.ndarray, **kw: object) -> None:
    fig.add_trace(go.Scatter(x=f32(x), y=f32(y), mode="lines", name=MODE_LABELS.get(mode, mode),
                             line=dict(color=MODE_COLORS.get(mode), width=2), **kw))


# --- race: per-step charts from the three runs ----------------------------------------------

def _raw_and_trend(fig: go.Figure, mode: str, steps: np.ndarray, y: np.ndarray) -> None:
    """Every step as a faint line, and its rolling median bold (the legend entry)."""
    c = MODE_COLORS.get(mode)
    fig.add_trace(go.Scatter(x=f32(steps), y=f32(y), mode="lines", line=dict(color=c, width=1), opacity=0.35,
                             showlegend=False, hoverinfo="skip", legendgroup=mode))
    _mode_line(fig, mode, steps, rolling_median(y, SMOOTH), legendgroup=mode)


def race_latency(runs: Mapping[str, "Run"], height: int = HEIGHT) -> go.Figure:
    """Per-step latency: recomputation grows with t, a cached step stays flat."""
    fig = go.Figure()
    for mode, run in _ordered(runs):
        steps = np.arange(len(run.events))
        _raw_and_trend(fig, mode, steps, np.array([e.latency_ms for e in run.events]))
    fig = _layout(fig, "Per-step latency (forward + sampling)", _runs_where(runs) +
                  f" · faint: every step · bold: rolling median of {SMOOTH} · step 0 is the prefill",
                  "step (new token index)", "latency (ms)", height)
    fig.update_yaxes(rangemode="tozero")
    return fig


def race_cumulative(runs: Mapping[str, "Run"], height: int = HEIGHT) -> go.Figure:
    fig = go.Figure()
    for mode, run in _ordered(runs):
        steps = np.arange(len(run.events))
        _mode_line(fig, mode, steps, np.cumsum([e.latency_ms for e in run.events]) / 1000.0)
    return _layout(fig, "Cumulative generation time", _runs_where(runs) + " · sum of measured step latencies",
                   "step (new token index)", "time so far (s)", height)


def race_tokens(runs: Mapping[str, "Run"], height: int = HEIGHT) -> go.Figure:
    """Tokens fed through the model per step: 1 with a cache, the whole sequence without."""
    fig = go.Figure()
    for mode, run in _ordered(runs):
        steps = np.arange(len(run.events))
        _mode_line(fig, mode, steps, [e.input_len for e in run.events],
                   line_shape="hv" if mode != "none" else "linear")
    # Both caches feed 1 token per step, so their lines coincide: dash the second one to show it.
    for tr in fig.data:
        if tr.name == MODE_LABELS["concat"]:
            tr.line.dash = "dash"
    cached = [r for m, r in runs.items() if m != "none" and len(r.events) > 1]
    if cached:
        fig.add_annotation(x=len(cached[0].events) - 1, y=1, text="cached: 1 token per step", showarrow=False,
                           xanchor="right", yanchor="bottom", font=dict(color=MODE_COLORS["static"], size=13))
    # "every token so far", not "all t": on screen a lone "t" read as cut-off text.
    return _layout(fig, "Tokens processed per step", _runs_where(runs) + " · cached: 1 after the prefill; no cache: "
                   "every token so far", "step (new token index)", "tokens fed per step", height)


def _giga(flops: float) -> str:
    """A total in G FLOPs in at most five characters ("9.86", "69.7", "1,234"): three bars share a
    third of a half-width chart, about 45 px each, so their labels must not be wider."""
    g = flops / 1e9
    return f"{g:,.0f}" if g >= 999.5 else f"{g:.3g}"


def race_flops(runs: Mapping[str, "Run"], height: int = HEIGHT) -> go.Figure:
    """Analytic FLOPs per step (log scale) next to the total over the run (linear: the bars compare
    totals, each labelled with its value, so the panel needs no tick labels)."""
    # What each panel shows is its axis title, not a subplot title: those sit on the plot's top
    # edge, where a wrapped subtitle reaches at 1366 px.
    fig = make_subplots(rows=1, cols=2, column_widths=[0.62, 0.38], horizontal_spacing=0.1)
    top = 0.0
    for mode, run in _ordered(runs):
        name = MODE_LABELS.get(mode, mode)
        steps = np.arange(len(run.events))
        fig.add_trace(go.Scatter(x=f32(steps), y=f32([e.flops for e in run.events]), mode="lines", name=name,
                                 line=dict(color=MODE_COLORS.get(mode), width=2,
                                           dash="dash" if mode == "concat" else None),
                                 legendgroup=mode), row=1, col=1)
        total = float(sum(e.flops for e in run.events))
        top = max(top, total)
        fig.add_trace(go.Bar(x=[mode], y=f32([total]), marker_color=MODE_COLORS.get(mode), name=name,
                             legendgroup=mode, showlegend=False, text=[_giga(total)],
                             hovertemplate=f"{name}: %{{y:.4s}} FLOPs<extra></extra>",
                             textposition="outside", cliponaxis=False, textfont=dict(size=13)), row=1, col=2)
    fig = _layout(fig, "Analytic FLOPs (matmuls only)", _runs_where(runs) + " · counted by "
                  "kvviz.engine.generation.flops · G = 10⁹ FLOPs", "", "", height)
    fig.update_xaxes(title_text="step (new token index)", row=1, col=1)
    fig.update_yaxes(title_text="FLOPs per step", row=1, col=1)
    _log_axes(fig, row=1, col=1)
    # Room above the tallest bar for its label; no tick labels (each bar says its total).
    fig.update_yaxes(showticklabels=False, range=[0, top * 1.18 or 1], row=1, col=2)
    fig.update_xaxes(title_text="run total (G)", tickangle=0, tickfont=dict(size=12), row=1, col=2)
    fig.update_layout(margin=dict(t=fig.layout.margin.t + 24), uniformtext=dict(minsize=12, mode="show"))
    fig.update_layout(hovermode="closest")
    return fig


def race_speedup(runs: Mapping[str, "Run"], cached: str = "static", uncached: str = "none",
                 height: int = HEIGHT) -> go.Figure:
    """Measured speedup (uncached / cached latency) at each step next to the FLOP ratio."""
    fig = go.Figure()
    if cached in runs and uncached in runs:
        steps, speed, ratio = per_step_ratios(runs[cached], runs[uncached])
        fig.add_trace(go.Scatter(x=f32(steps), y=f32(ratio), mode="lines", name="theoretical (FLOP ratio)",
                                 line=dict(color="#7f7f7f", width=2, dash="dash")))
        fig.add_trace(go.Scatter(x=f32(steps), y=f32(speed), mode="lines", line=dict(color=MODE_COLORS[cached], width=1),
                                 opacity=0.35, showlegend=False, hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=f32(steps), y=f32(rolling_median(speed, SMOOTH)), mode="lines",
                                 name=f"measured (latency ratio, rolling median of {SMOOTH})",
                                 line=dict(color=MODE_COLORS[cached], width=2.5)))
        fig.add_hline(y=1.0, line=dict(color="#bbbbbb", width=1))
        # Placed by hand: add_hline's own annotation lands at 10^1 on a log axis.
        fig.add_annotation(x=1.0, xref="paper", y=0.0, text="break-even (1×)", showarrow=False, xanchor="right",
                           yanchor="top", font=dict(color="#888888", size=12))
    fig = _layout(fig, f"Speedup of the {MODE_LABELS.get(cached, cached)} over {MODE_LABELS.get(uncached, uncached)}",
                  _runs_where(runs) + " · per step, log scale", "step (new token index)", "speedup (×)", height)
    _log_axes(fig)
    return fig


def cache_bytes(runs: Mapping[str, "Run"], height: int = HEIGHT) -> go.Figure:
    """Bytes allocated vs bytes used, for each cache, over the run."""
    fig = go.Figure()
    for mode in ("static", "concat"):
        if mode not in runs:
            continue
        run = runs[mode]
        steps = np.arange(len(run.events))
        c = MODE_COLORS[mode]
        label = MODE_LABELS[mode]
        fig.add_trace(go.Scatter(x=f32(steps), y=f32([e.cache_bytes_allocated / MIB for e in run.events]),
                                 mode="lines", name=f"{label}: allocated", line=dict(color=c, width=3)))
        fig.add_trace(go.Scatter(x=f32(steps), y=f32([e.cache_bytes_used / MIB for e in run.events]), mode="lines",
                                 name=f"{label}: used", line=dict(color=c, width=2, dash="dot")))
    fig = _layout(fig, "KV cache bytes: allocated vs used", _runs_where(runs) +
                  " · static preallocates the whole context; concat holds exactly what is used",
                  "step (new token index)", "MiB", height)
    fig.update_yaxes(rangemode="tozero")
    return fig


def cache_copied(runs: Mapping[str, "Run"], height: int = HEIGHT) -> go.Figure:
    """Cumulative bytes the cache wrote: O(T) in place (static) vs O(T^2) re-copied (concat)."""
    fig = go.Figure()
    totals = []
    for mode in ("static", "concat"):
        if mode not in runs:
            continue
        run = runs[mode]
        steps = np.arange(len(run.events))
        total = run.events[-1].cache_bytes_copied if run.events else 0
        verb = "in place, O(T)" if mode == "static" else "torch.cat copies, O(T²)"
        _mode_line(fig, mode, steps, [e.cache_bytes_copied / MIB for e in run.events])
        fig.data[-1].name = f"{MODE_LABELS[mode]}: {verb}"  # short: a legend entry wider than the chart is cut
        totals.append(f"{mode} {fmt_bytes(total)}")
    fig = _layout(fig, "Bytes written by the cache (cumulative)", _runs_where(runs) +
                  (" · in total: " + ", ".join(totals) if totals else ""),
                  "step (new token index)", "MiB written so far", height)
    fig.update_yaxes(rangemode="tozero")
    return fig


# --- sweeps: tables of medians with min-max spread ---------------------------------------------

def _errors(df: "pd.DataFrame", scale: float = 1.0) -> dict[str, object]:
    """Asymmetric min-max error bars around the median (``scale`` converts units)."""
    med = df["median"].to_numpy(np.float64)
    return dict(type="data", symmetric=False, array=f32((df["max"].to_numpy(np.float64) - med) * scale),
                arrayminus=f32((med - df["min"].to_numpy(np.float64)) * scale), thickness=1.5, width=4)


def _color(series: str) -> str | None:
    return MODE_COLORS.get(series) or SERIES_COLORS.get(series) or PHASE_COLORS.get(series)


def _label(series: str) -> str:
    return MODE_LABELS.get(series, series)


def sweep_time(agg: "pd.DataFrame", fits: Mapping[str, Fit], log: bool, subtitle: str,
               height: int = HEIGHT) -> go.Figure:
    """Total generation time vs N: medians with min-max bars; on log-log, the fitted slopes."""
    fig = go.Figure()
    for series, g in agg.groupby("series", sort=False):
        s = str(series)
        fit = fits.get(s)
        name = _label(s) + (f" (slope {fit.slope:.2f})" if fit is not None else "")
        fig.add_trace(go.Scatter(x=f32(g["x"]), y=f32(g["median"] / 1000.0), mode="lines+markers", name=name,
                                 line=dict(color=_color(s), width=2), marker=dict(size=8),
                                 error_y=_errors(g, 1e-3)))
        if log and fit is not None:
            xs = np.geomspace(fit.x_min, fit.x_max, 20)
            fig.add_trace(go.Scatter(x=f32(xs), y=f32(fit.predict(xs) / 1000.0), mode="lines", showlegend=False,
                                     line=dict(color=_color(s), width=6), opacity=0.25, hoverinfo="skip"))
    title = "Total time vs new tokens N" + (" (log-log)" if log else "")
    if log:
        subtitle += " · slope 1 = linear, 2 = quadratic; bold lines: fits on the large-N points"
    fig = _layout(fig, title, subtitle + " · medians, min–max bars", "new tokens N", "total time (s)", height)
    if log:
        fig.update_xaxes(type="log", tickvals=f32(sorted(agg["x"].unique())))  # label the swept N values
        _log_axes(fig)
    fig.update_layout(hovermode="closest")
    return fig


def ttft_chart(agg: "pd.DataFrame", subtitle: str, height: int = HEIGHT) -> go.Figure:
    fig = go.Figure()
    for series, g in agg.groupby("series", sort=False):
        fig.add_trace(go.Scatter(x=f32(g["x"]), y=f32(g["median"]), mode="lines+markers", name="TTFT (median)",
                                 line=dict(color=PHASE_COLORS["prefill"], width=2), marker=dict(size=8),
                                 error_y=_errors(g)))
    fig = _layout(fig, "Time to first token vs prompt length", subtitle + " · the prefill forward, min–max bars",
                  "prompt length (tokens)", "TTFT (ms)", height)
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(hovermode="closest")
    return fig


def decode_chart(agg: "pd.DataFrame", subtitle: str, height: int = HEIGHT) -> go.Figure:
    """Per-token decode latency vs context: median line inside a min-max band."""
    fig = go.Figure()
    for series, g in agg.groupby("series", sort=False):
        x = f32(g["x"])
        fig.add_trace(go.Scatter(x=np.concatenate([x, x[::-1]]), y=f32(np.concatenate([g["max"], g["min"][::-1]])),
                                 fill="toself", fillcolor="rgba(44,160,44,0.18)", line=dict(width=0),
                                 name="min–max over repeats", hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=x, y=f32(g["median"]), mode="lines+markers", name="median per token",
                                 line=dict(color=PHASE_COLORS["decode"], width=2), marker=dict(size=5)))
    # Other processes cause rare spikes that would flatten the median line: clip the band, and say so.
    top = float(agg["median"].max()) * 3.0 if len(agg) else 0.0
    peak = float(agg["max"].max()) if len(agg) else 0.0
    if top > 0 and peak > top:
        subtitle += f" · band clipped at {top:,.1f} ms (spikes up to {peak:,.0f} ms)"
    fig = _layout(fig, "Per-token decode latency vs context length", subtitle + " · median, min–max over repeats",
                  "context length (tokens in the cache)", "latency per token (ms)", height)
    fig.update_yaxes(rangemode="tozero", range=[0, top] if top > 0 and peak > top else None)
    return fig


def roofline(probe: MachineProbe, points: Mapping[str, "pd.DataFrame"], height: int = 460) -> go.Figure:
    """Log-log roofline of this machine with measured prefill and decode points on it.

    ``points[phase]`` has columns intensity, median, min, max (achieved FLOP/s) and x (the
    prompt or context length, for the hover text).
    """
    fig = go.Figure()
    lo = min([probe.ridge / 100] + [float(df["intensity"].min()) / 2 for df in points.values() if len(df)])
    hi = max([probe.ridge * 100] + [float(df["intensity"].max()) * 2 for df in points.values() if len(df)])
    xs = np.geomspace(lo, hi, 200)
    roof = np.minimum(probe.peak_flops, xs * probe.bandwidth)
    fig.add_trace(go.Scatter(x=f32(xs), y=f32(roof / 1e9), mode="lines", name="roof: min(peak, intensity × bandwidth)",
                             line=dict(color="#333333", width=3)))
    # Annotations on log axes take log10 coordinates (add_vline's own label would land at 10^x).
    fig.add_vline(x=probe.ridge, line=dict(color="#999999", dash="dot"))
    fig.add_annotation(x=np.log10(probe.ridge), y=0.0, yref="paper", text=f" ridge {probe.ridge:,.1f} FLOP/byte",
                       showarrow=False, xanchor="left", yanchor="bottom", font=dict(color="#777777", size=12))
    fig.add_annotation(x=np.log10(hi), y=np.log10(probe.peak_flops / 1e9), text="compute-bound", showarrow=False,
                       xanchor="right", yanchor="bottom", font=dict(color="#555555"))
    x_mem = probe.ridge / 1.5  # above the sloped roof, just left of the ridge: clear of the points below
    fig.add_annotation(x=np.log10(x_mem), y=np.log10(x_mem * probe.bandwidth / 1e9), text="memory-bound",
                       showarrow=False, xanchor="right", yanchor="bottom", font=dict(color="#555555"))
    for phase, df in points.items():
        if not len(df):
            continue
        unit = "prompt" if phase == "prefill" else "context"
        fig.add_trace(go.Scatter(
            x=f32(df["intensity"]), y=f32(df["median"] / 1e9), mode="markers", name=f"{phase} (measured)",
            marker=dict(color=PHASE_COLORS.get(phase), size=10, line=dict(color="white", width=1)),
            error_y=_errors(df, 1e-9),
            text=[f"{unit} {int(v)} tokens" for v in df["x"]],
            hovertemplate="%{text}<br>%{x:.1f} FLOP/byte<br>%{y:.2f} GFLOP/s<extra></extra>"))
    sub = (f"{probe.device} · {probe.dtype} · peak {probe.peak_flops / 1e9:,.1f} GFLOP/s (n={probe.matmul_n} matmul), "
           f"bandwidth {probe.bandwidth / 1e9:,.1f} GB/s ({fmt_bytes(probe.copy_bytes)} copy)")
    fig = _layout(fig, "Roofline of this machine: where prefill and decode sit", sub,
                  "arithmetic intensity (FLOPs per byte moved)", "achieved GFLOP/s", height)
    _log_axes(fig, x=True)
    fig.update_layout(hovermode="closest")
    return fig


def short_long_chart(ttft: "pd.DataFrame", tpot: "pd.DataFrame", subtitle: str, height: int = HEIGHT) -> go.Figure:
    """TTFT and per-token decode latency for a short question vs a long document."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.15,
                        subplot_titles=("time to first token (prefill)", "per-token decode latency (after it)"))
    for col, df in ((1, ttft), (2, tpot)):
        for series, g in df.sort_values("x").groupby("series", sort=False):  # short prompt first
            s = str(series)
            label = f"{s} ({int(g['x'].iloc[0])} tokens)"
            fig.add_trace(go.Bar(x=[label], y=f32(g["median"]), marker_color=_color(s), name=s, legendgroup=s,
                                 showlegend=col == 1, error_y=_errors(g),
                                 text=[f"{v:,.1f} ms" for v in g["median"]], textposition="outside",
                                 cliponaxis=False), row=1, col=col)
    fig = _layout(fig, "Short question vs long pasted document", subtitle + " · medians, min–max bars", "", "", height)
    fig.update_annotations(font_size=13)
    fig.update_layout(margin=dict(t=120), uniformtext=dict(minsize=12, mode="show"))
    fig.update_yaxes(title_text="ms", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="ms per token", rangemode="tozero", row=1, col=2)
    fig.update_layout(hovermode="closest")
    return fig


def batch_tradeoff(latency: "pd.DataFrame", throughput: "pd.DataFrame", subtitle: str,
                   height: int = 420) -> go.Figure:
    """Aggregate tokens/s vs per-request latency: one point per batch size, labelled B=..."""
    fig = go.Figure()
    # Labels of the second curve go on the other side, so two curves on top of each other stay legible.
    for i, (series, g) in enumerate(latency.groupby("series", sort=False)):
        s = str(series)
        t = throughput[throughput["series"] == series].set_index("x").loc[g["x"]]
        fig.add_trace(go.Scatter(
            x=f32(g["median"]), y=f32(t["median"]), mode="lines+markers+text", name=s,
            text=[f"B={int(b)}" for b in g["x"]], textposition="top left" if i % 2 == 0 else "bottom right",
            textfont=dict(size=13, color=_color(s)),
            line=dict(color=_color(s), width=2), marker=dict(size=10),
            error_x=_errors(g), error_y=_errors(t.reset_index()),
            hovertemplate="%{text}<br>%{x:.2f} ms/token per request<br>%{y:,.0f} tokens/s in total<extra></extra>"))
    fig = _layout(fig, "Batching: throughput vs per-request latency (cached decode)", subtitle +
                  " · up and right = more throughput for more latency", "per-request latency (ms per token)",
                  "aggregate throughput (tokens/s)", height)
    fig.update_xaxes(rangemode="tozero")
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(hovermode="closest")
    return fig


def batch_kv(allocated: "pd.DataFrame", used: "pd.DataFrame", subtitle: str, height: int = HEIGHT) -> go.Figure:
    """KV cache bytes vs batch size: the static cache's allocation and what the run filled."""
    fig = go.Figure()
    for df, name, color in ((allocated, "allocated (whole context, preallocated)", "#1f77b4"),
                            (used, "used (prompt + generated tokens)", "#17becf")):
        g = df.groupby("x", sort=True)["median"].max().reset_index()
        fig.add_trace(go.Bar(x=[f"B={int(b)}" for b in g["x"]], y=f32(g["median"] / MIB), name=name,
                             marker_color=color, text=[f"{v / MIB:,.1f}" for v in g["median"]],
                             textposition="outside", cliponaxis=False))
    fig = _layout(fig, "KV cache bytes vs batch size", subtitle + " · grows linearly with B",
                  "batch size", "MiB", height)
    fig.update_layout(barmode="group", hovermode="closest", uniformtext=dict(minsize=11, mode="show"))
    return fig
