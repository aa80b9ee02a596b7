"""The run view shared by the live loop, step mode and replay: placeholders, selectors, drawing.

``layout`` creates the view's placeholders once per script run (and the chart selectors), and
``draw`` fills them from a Run as it stands after its last event. The live loop calls ``draw``
on every token (text) and a few times a second (numbers, charts); replay calls it once per frame.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import streamlit as st

from kvviz import Run
from kvviz.charts import run_charts as charts
from kvviz.charts.layer_charts import layer_strip
from kvviz.ui import present
from kvviz.ui.state import persist
from kvviz.ui.pages.generate import chips, metrics
from kvviz.ui.common.figs import show

VIEWS = {"layer": "All layers", "head": "Heads of one layer", "values": "Raw values of one head"}
PRESENT_HEIGHT = 400  # the cache and the attention map side by side, above the fold at 1920x1080


@dataclass(frozen=True)
class ViewOptions:
    nb_view: str = "layer"  # one of VIEWS
    nb_layer: int = 0  # the layer for the heads view, and the layer whose raw K/V are captured
    nb_head: int = 0
    nb_kv: str = "K"
    attn_layer: int = 0
    attn_head: int = 0


@dataclass
class Slots:
    """Placeholders of the view, created once per script run and redrawn in place."""

    output: Any
    metrics: Any
    notebook: Any
    attention: Any
    bars: Any
    latency: Any
    compact: bool = False  # the presentation layout: numbers three to a row, charts side by side


def layout(shape: tuple[int, int, int] | None,
           replay: Callable[[], None] | None = None) -> tuple[Slots, ViewOptions]:
    """The view, top to bottom: text, numbers, [replay row], cache, attention, time.

    ``shape`` (n_layer, n_head, n_kv_head) sizes the selectors; None draws the view without them.
    Each part sits in a keyed container (``output``, ``view_metrics``, ``view_notebook``,
    ``view_attention``, ``view_latency``), which the tour points at. The presentation layout puts
    the text beside the numbers and the cache beside the attention map.
    """
    if present.active():
        return _layout_present(shape, replay)
    with st.container(key="output", border=True):
        out = st.empty()
    with st.container(key="view_metrics"):
        m = st.empty()
    if replay is not None:
        replay()
    opts = ViewOptions()
    with st.container(key="view_notebook"):
        st.subheader("What the cache holds", anchor=False)
        if shape is not None:
            opts = _cache_controls(shape[0], shape[2], shape[1])
        nb = st.empty()
    with st.container(key="view_attention"):
        st.subheader("What the newest token attends to", anchor=False)
        at = st.empty()
        if shape is not None:
            opts = dataclasses.replace(opts, **_attention_controls(shape[0], shape[1]))
        bars = st.empty()
    with st.container(key="view_latency"):
        st.subheader("How long each step takes", anchor=False)
        lat = st.empty()
    return Slots(out, m, nb, at, bars, lat), opts


def _layout_present(shape: tuple[int, int, int] | None,
                    replay: Callable[[], None] | None) -> tuple[Slots, ViewOptions]:
    """For a projector: [text | numbers], [replay row], [cache | attention], [bars | time]."""
    text_col, num_col = st.columns([1.7, 1], gap="medium")
    with text_col, st.container(key="output", border=True):
        out = st.empty()
    with num_col, st.container(key="view_metrics"):
        m = st.empty()
    opts = ViewOptions()
    left, right = st.columns(2, gap="medium")
    # The selectors fold into one button per chart, so both charts start at the same height.
    with left, st.container(key="view_notebook"):
        if shape is not None:
            # Short labels: the buttons sit in the charts' top-right corners, beside their titles.
            with st.popover("Cache view", icon=":material/tune:"):
                opts = _cache_controls(shape[0], shape[2], shape[1])
        nb = st.empty()
    with right, st.container(key="view_attention"):
        if shape is not None:
            which = f"layer {persist.last('attn_layer', 0)}, head {persist.last('attn_head', 0)}"
            with st.popover(f"Bars: {which}", icon=":material/tune:"):
                opts = dataclasses.replace(opts, **_attention_controls(shape[0], shape[1]))
        at = st.empty()
    if replay is not None:  # below the fold's three views, not between them
        replay()
    left, right = st.columns(2, gap="medium")
    with left:
        bars = st.empty()
    with right, st.container(key="view_latency"):
        lat = st.empty()
    return Slots(out, m, nb, at, bars, lat, compact=True), opts


def draw(run: Run, slots: Slots, opts: ViewOptions, key: str, charts_too: bool = True,
         numbers_too: bool | None = None, kept: bool = False) -> None:
    """Draw the run as it stands after its last event into the placeholders.

    ``numbers_too`` (default: as ``charts_too``) redraws the metrics without the charts. ``kept``:
    charts the browser keeps under their keys and redraws in place on the next script run with the
    same ``key`` (step mode: each Step press is a script run; figs.show says why).
    """
    chips.render(run, slots.output)
    if numbers_too if numbers_too is not None else charts_too:
        with slots.metrics.container():
            metrics.render(run, per_row=3 if slots.compact else 6)
            if charts_too and len(set(run.layer_kinds)) > 1 and run.events and run.events[-1].cache_layer_bytes:
                # hybrid attention (Gemma 3): the sliding layers level off at their window
                ev = run.events[-1]
                show(st, layer_strip(ev.cache_layer_bytes, run.layer_kinds, ev.position), key=f"layers-{key}")
    if not charts_too:
        return
    if opts.nb_view == "values":
        fig = charts.cache_values(run, opts.nb_kv, opts.nb_head, wanted_layer=opts.nb_layer)
    else:
        fig = charts.cache_notebook(run, opts.nb_view, opts.nb_layer)
    tall = PRESENT_HEIGHT if slots.compact else None
    show(slots.notebook, fig, key=f"notebook-{key}", height=tall, kept=kept)
    show(slots.attention, charts.attention_heatmap(run, (opts.attn_layer, opts.attn_head)), key=f"attention-{key}",
         height=tall, kept=kept)
    show(slots.bars, charts.attention_bars(run, opts.attn_layer, opts.attn_head), key=f"bars-{key}", kept=kept)
    show(slots.latency, charts.latency_chart(run), key=f"latency-{key}", kept=kept)


def _cache_controls(n_layer: int, n_kv_head: int, n_head: int) -> ViewOptions:
    """Selectors of the cache chart (kept across pages like the sidebar's)."""
    layers, kv_heads = list(range(n_layer)), list(range(n_kv_head))
    head_names = charts.kv_head_labels(n_head, n_kv_head)  # GQA: which query heads read each K/V head
    c1, c2, c3, c4 = st.columns([3.2, 1, 1, 1.1], vertical_alignment="bottom")
    views = tuple(VIEWS)
    view = c1.radio("Cache view", views, index=persist.keep_index("nb_view", "layer", views), key="nb_view",
                    format_func=VIEWS.get, horizontal=True,
                    help="All layers: one row per layer, colour = length (L2 norm) of its K or V vector at each "
                         "position. Heads: the K/V heads of one layer. Raw: the numbers themselves, one head.")
    layer = c2.selectbox("Layer", layers, index=persist.keep_index("nb_layer", 0, layers), key="nb_layer",
                         help="The layer of the heads and raw views. Its raw K/V values are recorded while "
                              "generating (the other layers keep norms only).")
    head = c3.selectbox("K/V head", kv_heads, index=persist.keep_index("nb_head", 0, kv_heads), key="nb_head",
                        format_func=lambda h: head_names[h],
                        help="The head of the raw view. With fewer K/V heads than query heads (GQA), each K/V "
                             "head is read by the query heads its label names.")
    kv = c4.radio("Raw values of", ("K", "V"), index=persist.keep_index("nb_kv", "K", ("K", "V")), key="nb_kv",
                  horizontal=True, help="Raw view: keys or values.")
    persist.remember("nb_view", "nb_layer", "nb_head", "nb_kv")
    return ViewOptions(nb_view=str(view), nb_layer=int(layer), nb_head=int(head), nb_kv=str(kv))


def _attention_controls(n_layer: int, n_head: int) -> dict[str, int]:
    layers, heads = list(range(n_layer)), list(range(n_head))
    c1, c2, _ = st.columns([1, 1, 4.3], vertical_alignment="bottom")
    a_layer = c1.selectbox("Attention layer", layers, index=persist.keep_index("attn_layer", 0, layers),
                           key="attn_layer", help="The layer of the bar chart below (outlined in red in the heatmap).")
    a_head = c2.selectbox("Attention head", heads, index=persist.keep_index("attn_head", 0, heads), key="attn_head",
                          help="The head of the bar chart below.")
    persist.remember("attn_layer", "attn_head")
    return {"attn_layer": int(a_layer), "attn_head": int(a_head)}


