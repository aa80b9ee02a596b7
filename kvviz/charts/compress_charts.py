"""The compression lab's charts, from plain data (pure Plotly, no torch).

Quantized KV: the same prompt's tokens under each KV dtype, with where each leaves full
precision; per layer/head heatmaps (K/V error, attention-row KL); keys' channels (their outliers).
Windowed KV: the notebook of which positions are sinks, kept or evicted at each step, with the
ring slot the step wrote; perplexity by position for full, window and sinks + window caches.
"""
from __future__ import annotations

from typing import Any, Sequence

import plotly.graph_objects as go

from kvviz.charts.render_cost import visible_len
from kvviz.charts.run_charts import _layout, _message_figure
from kvviz.charts.tokens import short_label
from kvviz.units import fmt_bytes

SAME = "#2b8a3e"
DIFF = "#e03131"
SINK = "#7048e8"
KEPT = "#1c7ed6"
EVICTED = "#dee2e6"
WRITE = "#f08c00"
LINE_COLORS = ["#212529", "#e03131", "#2b8a3e", "#7048e8", "#f08c00", "#1c7ed6"]
VISIBLE = 24  # tokens shown at once in the side-by-side lanes, at most
# The lanes' plot is about 780 px wide at 1366x768 (the page's full width less the lane names); a
# token's chip is CHAR_PX a character of its 12 px label plus CHIP_PAD, and the view holds only as
# many chips as fit side by side, so neighbouring labels never overprint (pan for the rest).
LANES_PX = 760
CHAR_PX, CHIP_PAD = 7, 10
HEIGHTS = {"tokens": 150, "heat": 400, "notebook": 460, "curves": 440}


def first_divergence(ref: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first token where ``other`` leaves ``ref`` (None: they agree as far as both go)."""
    return next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), None)


def token_comparison(rows: Sequence[tuple[str, Sequence[int], Sequence[str]]], title: str = "",
                     reference: str = "full precision") -> go.Figure:
    """rows: (name, token ids, token labels), the first the reference. One lane per row: a token's cell is
    green while the row agrees with the reference, red from its first different token on."""
    title = title or "Where each KV dtype leaves full precision"
    if not rows:
        return _message_figure(title, "Run the comparison to see the texts side by side.", HEIGHTS["tokens"] * 2)
    ref = rows[0][1]
    fig = go.Figure()
    n = max(len(r[1]) for r in rows)
    firsts = [d for r in rows[1:] if (d := first_divergence(ref, r[1])) is not None]
    widest = max((visible_len(short_label(t)) for r in rows for t in r[2]), default=1)
    visible = max(4, min(VISIBLE, LANES_PX // (CHAR_PX * widest + CHIP_PAD)))
    for y, (name, ids, labels) in enumerate(rows):
        d = first_divergence(ref, ids) if y else None
        colors = [SAME if d is None or i < d else DIFF for i in range(len(ids))]
        texts = [short_label(t) for t in labels]
        fig.add_trace(go.Scatter(
            x=list(range(len(ids))), y=[name] * len(ids), mode="markers+text", showlegend=False,
            marker=dict(symbol="square", size=26, color=colors, opacity=0.25), text=texts,
            textfont=dict(size=12), hoverinfo="text",
            hovertext=[f"{name} · token {i} · {short_label(t)}" for i, t in enumerate(labels)]))
        if d is not None:
            fig.add_vline(x=d - 0.5, line=dict(color=DIFF, width=2, dash="dot"))
    sub = f"green: the same token as {reference} · red: from the first different token on"
    fig.update_yaxes(autorange="reversed", type="category")
    # VISIBLE tokens stay legible; the view starts a few tokens before the first divergence (pan for the rest)
    lo = max(0, min(min(firsts, default=0) - min(4, visible // 3), n - visible))
    fig.update_xaxes(title="generated token (drag to pan)" if n > visible else "generated token",
                     range=[lo - 0.7, lo + min(n, visible) - 0.3])
    return _layout(fig, title, sub, 120 + 56 * len(rows))


def layer_head_heatmap(values: Sequence[Sequence[float]], title: str, subtitle: str, colorbar: str,
                       head_label: str = "head") -> go.Figure:
    """values (n_layer, n_head): one cell per layer and head."""
    if not values:
        return _message_figure(title, "Nothing measured yet.", HEIGHTS["heat"])
    fig = go.Figure(go.Heatmap(z=[list(map(float, r)) for r in values], colorscale="Reds",
                               colorbar=dict(title=dict(text=colorbar, side="right")),
                               hovertemplate=f"layer %{{y}} · {head_label} %{{x}} · %{{z:.3g}}<extra></extra>"))
    fig.update_xaxes(title=f"{head_label}", dtick=1)
    fig.update_yaxes(title="layer", autorange="reversed")
    return _layout(fig, title, subtitle, HEIGHTS["heat"])


def error_by_step(steps: Sequence[Sequence[float]], name: str) -> go.Figure:
    """steps: (position, K max, K mean, V max, V mean) per write: how far the cache's K and V sit
    from the exact vectors at every step, over all layers and KV heads (log scale)."""
    title = f"Quantization error at every step ({name})"
    if not steps:
        return _message_figure(title, "Nothing measured yet.", HEIGHTS["heat"])
    x = [int(r[0]) for r in steps]
    fig = go.Figure()
    for col, label, color, dash in ((1, "K max", DIFF, "solid"), (2, "K mean", DIFF, "dot"),
                                    (3, "V max", KEPT, "solid"), (4, "V mean", KEPT, "dot")):
        fig.add_trace(go.Scatter(x=x, y=[float(r[col]) for r in steps], name=label, mode="lines+markers",
                                 line=dict(color=color, dash=dash, width=2), marker=dict(size=5),
                                 hovertemplate=f"position %{{x}} · {label} |error| %{{y:.3g}}<extra></extra>"))
    fig.update_xaxes(title="first position the write stored (the prefill, then one per step)")
    fig.update_yaxes(title="|dequantized - exact|", type="log")
    # The legend at the figure's bottom edge, under the long x-axis title (a fraction of the plot's
    # height below it landed on that title).
    fig.update_layout(legend=dict(orientation="h", yref="container", yanchor="bottom", y=0.0, x=0))
    return _layout(fig, title, "over every layer and KV head: the largest error, and the mean", HEIGHTS["heat"],
                   margin=dict(b=110))


def channel_heatmap(absmax: Sequence[Sequence[float]], layer: int) -> go.Figure:
    """absmax (n_kv_head, head_dim): the largest |K| each channel of each KV head reached."""
    title = f"Keys' outlier channels, layer {layer}"
    if not absmax:
        return _message_figure(title, "Nothing measured yet.", HEIGHTS["heat"] - 80)
    fig = go.Figure(go.Heatmap(z=[list(map(float, r)) for r in absmax], colorscale="Viridis",
                               colorbar=dict(title=dict(text="max |K|", side="right")),
                               hovertemplate="KV head %{y} · channel %{x} · max |K| %{z:.3g}<extra></extra>"))
    fig.update_xaxes(title="channel (head_dim)")
    fig.update_yaxes(title="KV head", dtick=1, autorange="reversed")
    sub = "a few channels carry much larger keys: one shared scale per head vector spends its range on them"
    return _layout(fig, title, sub, HEIGHTS["heat"] - 80)


def window_state(p: int, n: int, sinks: int, window: int) -> str:
    """What position p is after n tokens: 'sink', 'kept' or 'evicted'."""
    if p < sinks:
        return "sink"
    return "kept" if p >= max(sinks, n - window) else "evicted"


def window_notebook(sinks: int, window: int, n_prompt: int, n_steps: int, max_cols: int = 160) -> go.Figure:
    """Rows: steps (0 = prefill); columns: positions. Sinks, kept and evicted positions after each step,
    and the ring slot the step's newest row was written to (its number on the orange cell)."""
    title = "What the cache keeps: sinks, the window, and the evicted"
    if n_steps < 1:
        return _message_figure(title, "Generate to fill the notebook.", HEIGHTS["notebook"])
    cap = sinks + window
    groups: dict[str, tuple[list[int], list[int], list[str]]] = {k: ([], [], []) for k in
                                                                   ("sink", "kept", "evicted", "write")}
    first_col = max(0, n_prompt + n_steps - max_cols)
    for s in range(n_steps):
        n = n_prompt + s  # positions written after this step (the step's new row is position n - 1)
        for p in range(first_col, n):
            key = window_state(p, n, sinks, window)
            if p == n - 1 and (s > 0 or n <= cap):
                key = "write"
            slot = p if p < cap else sinks + (p - sinks) % window
            xs, ys, hv = groups[key]
            xs.append(p)
            ys.append(s)
            hv.append(f"step {s} · position {p} · {key} · slot {slot}")
    names = {"sink": f"sink (kept forever, {sinks})", "kept": f"in the window (last {window})",
             "evicted": "evicted", "write": "written this step (ring slot in the hover)"}
    colors = {"sink": SINK, "kept": KEPT, "evicted": EVICTED, "write": WRITE}
    fig = go.Figure()
    for key, (xs, ys, hv) in groups.items():
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=names[key], hovertext=hv, hoverinfo="text",
                                     marker=dict(symbol="square", size=9, color=colors[key])))
    fig.update_yaxes(autorange="reversed", title="step (0 = prefill)")
    fig.update_xaxes(title="position")
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.3, x=0.0))
    sub = (f"{cap} slots: {sinks} sinks, then a ring of {window}; once full, each step overwrites the oldest "
           f"window row<br>the cache holds min(tokens, {cap}) positions, so its bytes stay flat")
    fig = _layout(fig, title, sub, HEIGHTS["notebook"] + 40)
    fig.update_layout(margin_t=118, margin_b=170)
    return fig


def ring_slots(sinks: int, window: int, n: int) -> go.Figure:
    """The S + W slots after n tokens: the position each holds; the last written slot marked."""
    title = "The ring: which position each slot holds"
    cap = sinks + window
    if n < 1:
        return _message_figure(title, "Generate to fill the ring.", 220)
    held = list(range(min(n, cap)))
    for p in range(max(cap, n - window), n):
        held[p if p < cap else sinks + (p - sinks) % window] = p
    last = (n - 1) if n - 1 < cap else sinks + (n - 1 - sinks) % window
    colors = [WRITE if i == last else (SINK if i < sinks else KEPT) for i in range(len(held))]
    fig = go.Figure(go.Bar(x=list(range(len(held))), y=[1] * len(held), marker_color=colors, text=held,
                           textposition="inside", insidetextanchor="middle", hoverinfo="text",
                           hovertext=[f"slot {i} · position {p}" for i, p in enumerate(held)]))
    fig.update_yaxes(visible=False)
    fig.update_xaxes(title="slot")
    sub = f"after {n} tokens · orange: the slot written last; the next write goes to the slot after it (wrapping)"
    return _layout(fig, title, sub, 240)


def perplexity_curves(by_position: dict[str, Sequence[Sequence[float]]], title: str, subtitle: str,
                      window: int | None = None, sinks: int = 0) -> go.Figure:
    """by_position: name -> [(first position of a bin, perplexity over the bin)]."""
    if not by_position:
        return _message_figure(title, "No measurement yet.", HEIGHTS["curves"])
    fig = go.Figure()
    for i, (name, pts) in enumerate(by_position.items()):
        # "original positions" lies almost on top of its StreamingLLM twin: dashed, so both show
        dash = "dash" if "original" in name else "solid"
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=name,
                                 line=dict(color=LINE_COLORS[i % len(LINE_COLORS)], width=3, dash=dash)))
    if window:
        fig.add_vline(x=window + sinks, line=dict(color="#868e96", dash="dash"),
                      annotation_text="window full: evictions start", annotation_position="top right")
    fig.update_xaxes(title="position in the held-out text")
    fig.update_yaxes(title="perplexity", type="log", dtick=1)  # one tick per power of ten
    # the legend stands to the right: under the plot it ran into the x-axis title
    fig = _layout(fig, title, subtitle, HEIGHTS["curves"])
    fig.update_layout(legend=dict(x=1.02, y=1.0, yanchor="top"))
    return fig


def dtype_table(kv_dtypes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for a table of teacher-forced results per KV dtype."""
    out = []
    for name, s in kv_dtypes.items():
        out.append({"KV": name, "perplexity": round(s["perplexity"], 3), "full precision": round(s["perplexity_full"], 3),
                    "logit KL (mean)": f"{s['mean_logit_kl']:.2e}", "top-1 agreement": f"{s['top1_agreement']:.1%}",
                    "cache bytes": fmt_bytes(s["cache_bytes"]),
                    "vs full": f"{s['cache_bytes'] / s['full_cache_bytes']:.1%}"})
    return out


def curves_finding(perplexity: dict[str, float]) -> str:
    """One sentence per cache: its perplexity over every position, against the full cache's."""
    full = perplexity.get("full")
    parts = []
    for name, v in perplexity.items():
        if name != "full" and full:
            parts.append(f"{name}: {v:,.2f} (x{v / full:.2f} the full cache's {full:,.2f})")
    return "; ".join(parts)
