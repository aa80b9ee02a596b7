"""Pure Plotly charts of a Run: Run -> go.Figure. No streamlit, no torch.

Every chart draws the run *as it stands after its last event*: live, step mode and replay
(``run.upto(step)``) share one path. float32 arrays, fixed heights; the cache and attention x axes
span the planned length (prompt + max_new_tokens): the picture grows in a fixed frame.

Positions: after step s the sequence holds ``N + s + 1`` tokens; the cache holds the K/V of the
first ``N + s`` (the token sampled last has not been fed yet). ``StepEvent.position`` is where
the sampled token goes, so it is also the number of K/V columns that exist after the step.
"""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from kvviz.charts.fast_layout import set_layout
from kvviz.charts.style import integer_ticks, top_tick
from kvviz.charts.render_cost import (  # noqa: F401 (COLUMN_GAP_MAX: the tests read it here)
    AXIS, AXIS_MARGIN_FLAT, COLORBAR_R, COLORBAR_TITLE_R, COLUMN_GAP_MAX, MARGIN, axis_margin, column_gap, label_margin,
    rate_axis_margin,
)
from kvviz.charts.tokens import (  # noqa: F401 (visible, prompt_tokens, generated_text: the views' API too)
    MAX_TICKS, generated_text, planned_columns, plotly_text, position_labels, prompt_tokens, short_label, token_axis,
    visible,
)
from kvviz.engine.generation.events import Run, StepEvent
from kvviz.measure.stats import rolling_median

# One look for every chart: large enough for a projector, calm colours, fixed heights.
FONT = dict(family="Source Sans Pro, Inter, Helvetica, Arial, sans-serif", size=15, color="#212529")
TITLE_SIZE = 19
PROMPT_COLOR = "#4263eb"  # prompt tokens, prefill
GEN_COLOR = "#f08c00"  # generated tokens, decode steps
HILITE = "#e03131"  # what happened at this step
EMPTY_FILL = "#e9ecef"  # preallocated but not yet written
# Attention is mostly near 0 with a few strong weights: spend most of the colour range on small
# weights (1% is already visible), keeping 0 white and the scale fixed at 0..1 across steps.
ATTENTION_SCALE = [[0.0, "#ffffff"], [0.01, "#deebf7"], [0.05, "#9ecae1"], [0.2, "#4292c6"], [0.5, "#2171b5"],
                   [1.0, "#08306b"]]
HEIGHTS = {"notebook": 470, "values": 470, "attention": 430, "bars": 360, "latency": 380}
# A small white template built once: "plotly_white" costs ~80 ms per figure (looked up and
# deep-copied each time). Its axes take render_cost.AXIS: Plotly lays a chart out once.
_GRID = "#e9ecef"
TEMPLATE = go.layout.Template(layout=dict(
    paper_bgcolor="white", plot_bgcolor="white", colorway=[PROMPT_COLOR, GEN_COLOR, "#2b8a3e", "#862e9c"],
    xaxis=dict(gridcolor=_GRID, linecolor=_GRID, zerolinecolor=_GRID, ticks="", **AXIS),
    yaxis=dict(gridcolor=_GRID, linecolor=_GRID, zerolinecolor=_GRID, ticks="", **AXIS),
))
def _layout(fig: go.Figure, title: str, subtitle: str, height: int, margin: dict[str, int] | None = None
            ) -> go.Figure:
    # ``margin``: what the chart's labels need (charts/render_cost.py), so Plotly lays it out once.
    # Title and subtitle are anchored in pixels from the top of the figure, so a short chart
    # does not clip them (a fraction of the height would).
    return set_layout(
        fig,
        title=dict(text=title, font=dict(size=TITLE_SIZE), x=0.0, xref="container", xanchor="left",
                   pad=dict(l=12, t=14), y=1.0, yref="container", yanchor="top",
                   subtitle=dict(text=subtitle, font=dict(size=14, color="#495057"))),
        font=FONT, height=height, template=TEMPLATE,
        margin=dict(MARGIN, t=96 if subtitle else 64, **(margin or {})), hoverlabel=dict(font=dict(size=15)),
    )


def _message_figure(title: str, message: str, height: int) -> go.Figure:
    """An empty chart that says why it is empty (before a run, or captures dropped)."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font=dict(size=17, color="#495057"))
    set_layout(fig, xaxis=dict(visible=False), yaxis=dict(visible=False))
    return _layout(fig, title, "", height)


# --- the notebook: what the cache holds --------------------------------------------------------

def _written(run: Run, ev: StepEvent) -> tuple[int, int]:
    """Columns [a, b) this step computed: the new ones (cache), or all of them (no cache)."""
    if not run.use_cache:
        return 0, ev.position
    n_new = ev.input_len
    return ev.position - n_new, ev.position


def kv_norm_grid(run: Run, by: str = "layer", layer: int = 0) -> tuple[np.ndarray, list[str]] | None:
    """(2, R, X) float32 norms (K then V), NaN where nothing is written; and the R row labels.

    by="layer": one row per layer, the L2 norm of the layer's whole K (or V) vector at a position
    (all heads together). by="head": one row per K/V head of ``layer``.
    """
    if not run.events or run.events[0].kv_norms is None:
        return None
    L, H = run.n_layer, run.n_kv_head
    rows = L if by == "layer" else H
    X = planned_columns(run)
    z = np.full((2, rows, X), np.nan, dtype=np.float32)
    for ev in run.events:
        if ev.kv_norms is None:
            continue
        a = ev.kv_norms.astype(np.float32)  # (L, 2, H, Tn)
        if by == "layer":
            vals = np.sqrt((a ** 2).sum(axis=2))  # (L, 2, Tn): norm over all heads = norm of the layer
            vals = vals.transpose(1, 0, 2)  # (2, L, Tn)
        else:
            vals = a[layer]  # (2, H, Tn)
        end = min(ev.kv_start + vals.shape[-1], X)
        z[:, :, ev.kv_start:end] = vals[:, :, : end - ev.kv_start]
    labels = [f"layer {i}" for i in range(L)] if by == "layer" else kv_head_labels(run.n_head or H, H)
    return z, labels


def kv_head_labels(n_head: int, n_kv_head: int) -> list[str]:
    """One label per K/V head; under GQA/MQA it names the query heads that read it (query head h
    reads K/V head h // (n_head / n_kv_head), as the models' enable_gqa does)."""
    group = max(1, n_head // max(1, n_kv_head))
    return [f"kv {g} ← q {g * group}-{(g + 1) * group - 1}" if group > 1 else f"head {g}" for g in range(n_kv_head)]


def kv_value_grid(run: Run, kv: int = 0, head: int = 0) -> tuple[np.ndarray, int] | None:
    """(head_dim, X) float32 raw K (kv=0) or V (kv=1) values of one head; and the captured layer."""
    evs = [e for e in run.events if e.kv_values is not None]
    if not evs:
        return None
    X = planned_columns(run)
    z = np.full((run.head_dim, X), np.nan, dtype=np.float32)
    for ev in evs:
        vals = ev.kv_values[kv, head].astype(np.float32).T  # (hs, Tn)
        end = min(ev.kv_start + vals.shape[1], X)
        z[:, ev.kv_start:end] = vals[:, : end - ev.kv_start]
    return z, int(evs[-1].kv_layer or 0)


def _mode_story(run: Run, ev: StepEvent) -> tuple[str, str]:
    """(title, subtitle) for the notebook, by cache mode: the point each mode makes."""
    filled = ev.position
    if not run.use_cache:
        return (f"No cache, step {ev.step}: all {filled} K/V columns recomputed, none kept",
                f"This step ran the model over all {ev.input_len} tokens again and threw the K/V away "
                f"(0 bytes kept). Red: recomputed this step.")
    kind = "static" if run.cache_kind == "static" else "concat"
    what = "prefill wrote the whole prompt" if ev.step == 0 else f"step {ev.step} wrote 1 column"
    if kind == "static":
        return (f"The KV cache after step {ev.step}: {filled} of {run.block_size:,} slots filled",
                f"Static cache: {what} in place. Grey: allocated, still empty. Red: written this step.")
    return (f"The KV cache after step {ev.step}: {filled} columns",
            f"Concat cache: {what}, and torch.cat copied the rest into a new tensor. Red: written this step.")


def _decorate_positions(run: Run, ev: StepEvent, X: int, axes: list[tuple[str, str]], n_rows: int
                        ) -> tuple[list[dict], list[dict]]:
    """Shapes and annotations: unfilled slots by cache mode, the prompt|generated divider, this step's columns.

    ``axes``: the (xref, yref) pairs of the heatmaps to mark (the K and V blocks, or one).
    """
    filled = ev.position
    N = len(run.prompt_ids)
    a, b = _written(run, ev)
    static = run.use_cache and run.cache_kind == "static"
    box = dict(y0=-0.5, y1=n_rows - 0.5)
    shapes: list[dict] = []
    for xref, yref in axes:
        if filled < X:
            # Static: the slots exist (grey). Concat: they do not exist yet. No cache: nothing is stored.
            shapes.append(dict(type="rect", x0=filled - 0.5, x1=X - 0.5, xref=xref, yref=yref, layer="below",
                               fillcolor=EMPTY_FILL if static else "rgba(0,0,0,0)",
                               line=dict(width=0) if static else dict(color="#adb5bd", width=1.5, dash="dash"), **box))
        if 0 < N < X:
            shapes.append(dict(type="line", x0=N - 0.5, x1=N - 0.5, xref=xref, yref=yref,
                               line=dict(color="#495057", width=2, dash="dot"), **box))
        shapes.append(dict(type="rect", x0=a - 0.5, x1=b - 0.5, xref=xref, yref=yref,
                           line=dict(color=HILITE, width=3), fillcolor="rgba(0,0,0,0)", **box))
    notes: list[dict] = []
    if X - filled >= max(4, X // 6):  # room for a two-line label in the unfilled part
        if not run.use_cache:
            what = "nothing is stored<br>between steps"
        elif static:
            what = "preallocated,<br>still empty"
        else:
            what = "not allocated yet:<br>torch.cat grows it"
        notes.append(dict(x=(filled + X - 1) / 2, y=(n_rows - 1) / 2, xref=axes[0][0], yref=axes[0][1], text=what,
                          showarrow=False, font=dict(size=14, color="#495057")))
    if 0 < N < X:
        notes.append(dict(x=N - 0.5, y=1.0, xref=axes[0][0], yref="paper", text="prompt │ generated",
                          showarrow=False, yanchor="bottom", font=dict(size=13, color="#495057")))
    return shapes, notes


def _color_range(values: np.ndarray) -> tuple[float, float]:
    """2nd to 98th percentile of the finite values: contrast for the typical cells, no outlier washout."""
    finite = values[np.isfinite(values)]
    if not finite.size:
        return 0.0, 1.0
    lo, hi = (float(v) for v in np.percentile(finite, [2, 98]))
    return (lo, hi) if hi > lo else (lo - 0.5, hi + 0.5)


def cache_notebook(run: Run, by: str = "layer", layer: int = 0) -> go.Figure:
    """The cache as a notebook: a column per position, K block above V block, colour = each vector's
    length (its L2 norm: the square root of the sum of its squared numbers)."""
    title = "The KV cache"
    if not run.events:
        return _message_figure(title, "Generate to watch the cache fill, one column per token.", HEIGHTS["notebook"])
    grid = kv_norm_grid(run, by, layer)
    if grid is None:
        return _message_figure(title, "This run kept no K/V captures (dropped to save memory).", HEIGHTS["notebook"])
    z, labels = grid
    ev = run.events[-1]
    X = z.shape[-1]
    axis = token_axis(position_labels(run), X)
    # Two stacked heatmaps sharing the x axis (laid out by hand: make_subplots is slow to build).
    scale = "Viridis" if run.use_cache else "OrRd"  # warm colours: recomputed, temporary
    where = "" if by == "layer" else f" · layer {layer}"
    traces = []
    for i, name in enumerate(("K", "V")):
        lo, hi = _color_range(z[i])
        traces.append(go.Heatmap(
            z=z[i], x=np.arange(X, dtype=np.int32), y=labels, colorscale=scale, zmin=lo, zmax=hi,
            xaxis="x" if i == 0 else "x2", yaxis="y" if i == 0 else "y2", xgap=column_gap(X), ygap=1, name=name,
            # One short title line (what the colour is: each vector's L2 norm) and three ticks: a two-line
            # title left a short chart's bar too short for its labels, which printed over each other.
            colorbar=dict(title=dict(text=f"‖{name}‖ (L2)", side="top"), len=0.46, y=0.77 - 0.54 * i,
                          yanchor="middle", thickness=14, nticks=3),
            hovertemplate=f"position %{{x}}<br>%{{y}}<br>‖{name}‖ = %{{z:.2f}} (L2 norm, no unit)<extra></extra>"))
    shapes, notes = _decorate_positions(run, ev, X, [("x", "y"), ("x2", "y2")], len(labels))
    fig = go.Figure(traces)
    # automargin: a GQA head's label ("kv 0 ← q 0-2") is wider than "layer 29"
    y_common = dict(autorange="reversed", showgrid=False, automargin=True)
    set_layout(
        fig,
        xaxis=dict(axis, anchor="y", showticklabels=False, title=None),
        xaxis2=dict(axis, anchor="y2", matches="x"),
        yaxis=dict(y_common, domain=[0.54, 1.0], title=dict(text=f"<b>K</b> (keys){where}")),
        yaxis2=dict(y_common, domain=[0.0, 0.46], title=dict(text=f"<b>V</b> (values){where}")),
        shapes=shapes, annotations=notes,
    )
    t, sub = _mode_story(run, ev)
    return _layout(fig, t, sub, HEIGHTS["notebook"], dict(l=label_margin(labels), r=COLORBAR_R, b=axis_margin(axis)))


def cache_values(run: Run, kv: str = "K", head: int = 0, wanted_layer: int | None = None) -> go.Figure:
    """Raw K or V values of one head (positions × head_dim), for the layer captured in the run.

    Only one layer's raw values are recorded per run (bounded memory); ``wanted_layer`` is the one
    the user picked, and the subtitle says so when the run recorded another.
    """
    title = f"Raw {kv} values"
    if not run.events:
        return _message_figure(title, "Generate to see the raw vectors the cache stores.", HEIGHTS["values"])
    grid = kv_value_grid(run, 0 if kv == "K" else 1, head)
    if grid is None:
        return _message_figure(title, "This run kept no raw K/V values.", HEIGHTS["values"])
    z, layer = grid
    ev = run.events[-1]
    X = z.shape[1]
    finite = np.abs(z[np.isfinite(z)])
    lim = float(np.percentile(finite, 99)) if finite.size else 1.0
    fig = go.Figure(go.Heatmap(
        z=z, x=np.arange(X, dtype=np.int32), y=np.arange(z.shape[0], dtype=np.int32), colorscale="RdBu_r",
        zmid=0.0, zmin=-lim, zmax=lim, colorbar=dict(title=dict(text=kv, side="right"), thickness=14),
        hovertemplate=f"position %{{x}}<br>dimension %{{y}}<br>{kv} = %{{z:.3f}}<extra></extra>"))
    shapes, notes = _decorate_positions(run, ev, X, [("x", "y")], z.shape[0])
    axis = token_axis(position_labels(run), X)
    set_layout(fig, shapes=shapes, annotations=notes, xaxis=axis,
               yaxis=dict(title=dict(text="dimension of the head vector"), autorange="reversed", showgrid=False))
    t, _ = _mode_story(run, ev)
    sub = (f"Layer {layer}, head {head}: one {run.head_dim}-number {kv} vector per position. "
           f"{'Red: written this step.' if run.use_cache else 'Red: recomputed this step.'}")
    if wanted_layer is not None and wanted_layer != layer:
        sub = f"This run recorded raw values of layer {layer} only: generate again to record layer {wanted_layer}."
    return _layout(fig, f"Raw {kv} vectors, layer {layer} head {head}, after step {ev.step}", sub, HEIGHTS["values"],
                   dict(r=COLORBAR_R, b=axis_margin(axis)))


# --- attention ----------------------------------------------------------------------------------

def attention_grid(ev: StepEvent) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
    """(rows, S) float32 attention of the newest query, one row per (layer, head); the row keys."""
    if ev.attn is None:
        return None
    a = ev.attn.astype(np.float32)  # (n_cap_layers, n_head, S)
    keys = [(layer, h) for layer in ev.attn_layers for h in range(a.shape[1])]
    return a.reshape(-1, a.shape[-1]), keys


def _query_words(run: Run, ev: StepEvent) -> str:
    """'the token 'e' at position 12': the newest query, i.e. the last token fed this step."""
    labels = position_labels(run)
    q = ev.position - 1
    tok = plotly_text(visible(labels[q])) if 0 <= q < len(labels) else "?"
    return f"“{tok}” (position {q})"


def _rules(ys: list[float]) -> str:  # lines across the plot (xref="paper")
    return "".join(f"M0,{y:g}H1" for y in ys)


def attention_heatmap(run: Run, selected: tuple[int, int] | None = None) -> go.Figure:
    """The newest token's attention over every cached position, one row per (layer, head)."""
    title = "Attention of the newest token"
    if not run.events:
        return _message_figure(title, "Generate to see what each new token looks at.", HEIGHTS["attention"])
    ev = run.events[-1]
    grid = attention_grid(ev)
    if grid is None:
        return _message_figure(title, "This run kept no attention captures.", HEIGHTS["attention"])
    z, keys = grid
    X = planned_columns(run)
    full = np.full((z.shape[0], X), np.nan, dtype=np.float32)
    full[:, : min(X, z.shape[1])] = z[:, :X]
    n_head = run.n_head or 1
    n_kv = run.n_kv_head or n_head
    group = max(1, n_head // n_kv)  # query heads per K/V head: 1 = MHA, >1 = GQA, n_head = MQA
    rows = [f"L{layer} h{h}" + (f" (kv{h // group})" if group > 1 else "") for layer, h in keys]
    fig = go.Figure(go.Heatmap(
        z=full, x=np.arange(X, dtype=np.int32), y=rows, colorscale=ATTENTION_SCALE, zmin=0.0, zmax=1.0,
        colorbar=dict(title=dict(text="weight", side="right"), thickness=14),
        hovertemplate="layer·head %{y}<br>key position %{x}<br>weight %{z:.3f}<extra></extra>", xgap=column_gap(X)))
    # One tick per layer, on its middle head, so the 144 rows of GPT-2 small stay readable; past
    # 12 layers (SmolLM2's 30) every k-th layer, or the labels overprint each other.
    layer_rows = [i for i, (_, h) in enumerate(keys) if h == 0]
    stride = -(-len(layer_rows) // 12)
    labelled = layer_rows[::stride]
    mid = (n_head - 1) // 2
    yaxis = dict(tickmode="array", tickvals=[rows[i + mid] for i in labelled],
                 ticktext=[f"layer {keys[i][0]}" for i in labelled], autorange="reversed", showgrid=False,
                 title=dict(text=f"layer (× {n_head} heads)"))
    # Row separators as one path each (y: a row's index), not SmolLM2's 89 shapes, each validated
    # by Plotly and drawn by the browser on every step.
    shapes = [dict(type="path", path=_rules([i - 0.5 for i in layer_rows[1:]]), xref="paper", yref="y",
                   line=dict(color="white", width=3))] if len(layer_rows) > 1 else []  # gaps between layers
    if 1 < group < n_head:  # GQA: a thin line between the query heads of different K/V heads
        shapes.append(dict(type="path", path=_rules([i + g * group - 0.5 for i in layer_rows for g in range(1, n_kv)]),
                           xref="paper", yref="y", line=dict(color="#adb5bd", width=1, dash="dot")))
    if selected in keys:
        r = keys.index(selected)
        shapes.append(dict(type="rect", x0=-0.5, x1=ev.position - 0.5, y0=r - 0.5, y1=r + 0.5,
                           line=dict(color=HILITE, width=3)))
    N = len(run.prompt_ids)
    if 0 < N < X:
        shapes.append(dict(type="line", x0=N - 0.5, x1=N - 0.5, y0=0, y1=1, yref="paper",
                           line=dict(color="#495057", width=2, dash="dot")))
    axis = token_axis(position_labels(run), X, "key position (token)")
    set_layout(fig, shapes=shapes, xaxis=axis, yaxis=yaxis)
    sub = (f"Step {ev.step}: the query of {_query_words(run, ev)} against {ev.position} keys"
           f"{' read from the cache' if run.use_cache else ' recomputed this step'}; each row sums to 1.")
    if group > 1:  # one line beside the notebook: a clipped subtitle hides the point
        sub = (f"Step {ev.step}: {_query_words(run, ev)} reads {ev.position} "
               f"{'cached' if run.use_cache else 'recomputed'} keys; rows sum to 1. " +
               (f"GQA: {n_head} query heads share {n_kv} K/V heads (dotted lines group them)." if n_kv > 1 else
                f"MQA: all {n_head} query heads read one K/V head."))
    return _layout(fig, f"Where the newest token looks: {len(ev.attn_layers)} layers × {n_head} heads", sub,
                   HEIGHTS["attention"], dict(r=COLORBAR_TITLE_R, b=axis_margin(axis)))


def attention_bars(run: Run, layer: int = 0, head: int = 0) -> go.Figure:
    """One (layer, head)'s attention weights of the newest token, as bars over positions."""
    title = f"Layer {layer}, head {head}"
    if not run.events:
        return _message_figure(title, "Generate, then pick a layer and head.", HEIGHTS["bars"])
    ev = run.events[-1]
    grid = attention_grid(ev)
    if grid is None or (layer, head) not in grid[1]:
        why = "no attention captures" if grid is None else f"layer {layer} was not captured"
        return _message_figure(title, f"This run has {why}.", HEIGHTS["bars"])
    z, keys = grid
    w = z[keys.index((layer, head))]
    S = w.shape[0]
    X = planned_columns(run)
    N = len(run.prompt_ids)
    labels = position_labels(run)
    colors = [PROMPT_COLOR if p < N else GEN_COLOR for p in range(S)]
    fig = go.Figure(go.Bar(
        x=np.arange(S, dtype=np.int32), y=w, marker_color=colors, marker_line_width=0,
        customdata=np.array([plotly_text(visible(labels[p])) if p < len(labels) else "" for p in range(S)])[:, None],
        hovertemplate="position %{x} “%{customdata[0]}”<br>weight %{y:.3f}<extra></extra>"))
    # Name the three strongest positions so a projector audience can read them.
    top = sorted(int(p) for p in np.argsort(w)[::-1][:3])  # left to right, labels staggered upwards
    set_layout(fig, annotations=[
        dict(x=p, y=float(w[p]), text=f"“{short_label(labels[p])}” {w[p]:.2f}", showarrow=True, arrowhead=0,
             # Fan the three labels out left, up, right; near an edge, lean them inwards (off the y ticks).
             ax=50 * (i - 1) - (70 if p > 0.8 * X else 0) + (90 if p < 0.2 * X else 0), ay=-30 - 18 * (i % 2),
             font=dict(size=14, color="#212529"), bgcolor="rgba(255,255,255,0.85)")
        for i, p in enumerate(top)])
    axis = token_axis(labels, X, "key position (token)")
    set_layout(fig, xaxis=axis, yaxis=dict(title=dict(text="attention weight"), rangemode="tozero",
                                           range=[0, max(0.05, float(w.max()) * 1.45)]))
    sub = f"Blue: prompt tokens, orange: generated. Query: {_query_words(run, ev)}, step {ev.step}."
    return _layout(fig, f"Layer {layer}, head {head}: attention weights of the newest token", sub, HEIGHTS["bars"],
                   dict(b=axis_margin(axis)))


# --- time ---------------------------------------------------------------------------------------

SPIKE_FACTOR = 3.0  # a bar taller than this x the 95th percentile of decode steps is cut, its time written on it
TREND = 9  # steps in the running median of the tokens/s line


def latency_chart(run: Run) -> go.Figure:
    """Per-step latency (bars, prefill marked) with tokens/s as a running median on a second axis.

    One slow step (the scheduler, another process) must not flatten the scale for the rest: bars
    above SPIKE_FACTOR x the decode steps' 95th percentile are cut at that height and labelled with
    their time, and the subtitle says so. The tokens/s line is a running median, so it shows the
    trend instead of zig-zagging over the bars.
    """
    title = "Time per step"
    if not run.events:
        return _message_figure(title, "Generate to time each forward pass.", HEIGHTS["latency"])
    steps = np.array([e.step for e in run.events], dtype=np.int32)
    lat = np.array([e.latency_ms for e in run.events], dtype=np.float32)
    inp = np.array([e.input_len for e in run.events], dtype=np.int32)
    colors = [PROMPT_COLOR if e.phase == "prefill" else GEN_COLOR for e in run.events]
    traces = [go.Bar(x=steps, y=lat, marker_color=colors, name="latency (ms)", customdata=inp,
                     hovertemplate="step %{x}<br>%{y:.2f} ms<br>%{customdata} tokens fed<extra></extra>")]
    decode = lat[1:]
    if decode.size:
        trend = rolling_median(decode.astype(np.float64), TREND)
        tps = (1000.0 * run.batch_size / np.maximum(trend, 1e-6)).astype(np.float32)
        traces.append(go.Scatter(x=steps[1:], y=tps, mode="lines", yaxis="y2", name=f"tokens/s (running median of {TREND})",
                                 line=dict(color="#2b8a3e", width=3),
                                 hovertemplate="step %{x}<br>%{y:,.0f} tokens/s (median of nearby steps)<extra></extra>"))
    fig = go.Figure(traces)
    rate_ticks = integer_ticks(float(tps.max()) if decode.size else 1.0)
    n_steps = max(run.max_new_tokens, len(steps))
    notes = [dict(x=0, y=float(lat[0]), text=f"prefill: {run.events[0].input_len} tokens", showarrow=True,
                  arrowhead=0, ax=40, ay=-30, font=dict(size=14, color=PROMPT_COLOR))]
    yaxis: dict = dict(title=dict(text="latency (ms)"), rangemode="tozero")
    cut = ""
    if decode.size >= 8:
        cap = SPIKE_FACTOR * float(np.percentile(decode, 95))
        tall = np.flatnonzero(lat > 1.15 * cap)
        if tall.size:
            yaxis["range"] = [0, cap]
            notes = [dict(x=int(steps[i]), y=cap, text=f"↑ {lat[i]:,.0f} ms", showarrow=False, yanchor="top",
                          textangle=-90, font=dict(size=13, color="#c92a2a"), bgcolor="rgba(255,255,255,0.8)")
                     for i in tall[np.argsort(lat[tall])[::-1][:6]]]
            cut = f" Bars above {cap:,.1f} ms are cut, their time written on them."
    set_layout(
        fig,
        xaxis=dict(title=dict(text="step (0 = prefill, then one decode step per token)"), range=[-0.7, n_steps - 0.3]),
        yaxis=yaxis,
        yaxis2=dict(title=dict(text="tokens/s", font=dict(color="#2b8a3e")), overlaying="y", side="right",
                    showgrid=False, tickformat=",.0f", tickfont=dict(color="#2b8a3e"), **rate_ticks),
        annotations=notes,
        legend=dict(orientation="h", x=1.0, xanchor="right", y=1.0, yanchor="bottom", bgcolor="rgba(255,255,255,0.85)"),
        bargap=0.15,
    )
    mode = "no cache: each step re-reads the whole sequence" if not run.use_cache else \
        f"{run.cache_kind} cache: each decode step feeds one token"
    sub = f"Blue: prefill (the whole prompt at once). Orange: decode steps; {mode}.{cut}"
    return _layout(fig, f"Time per step, {len(steps)} of {run.max_new_tokens} steps", sub, HEIGHTS["latency"],
                   dict(r=rate_axis_margin(top_tick(rate_ticks) if decode.size else None), b=AXIS_MARGIN_FLAT))
