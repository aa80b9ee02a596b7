"""Charts legible to learners and on projectors: word labels on long token axes, the time-per-step
chart's spike cut and smooth tokens/s line, legible text, the calculator's grouped legend."""
from __future__ import annotations

import dataclasses

import numpy as np
import plotly.graph_objects as go

from kvviz import CAPTURE_ALL, LoadedModel, generate
from kvviz.charts import run_charts as charts
from kvviz.charts import calculator_charts as mcharts
from kvviz.charts.style import INK, PROJECTOR_BOTTOM, PROJECTOR_SIZE, PROJECTOR_TICKS, legible, wrap_subtitle
from kvviz.charts.tokens import MAX_TICKS, token_axis

VERSE = "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"


def test_a_long_byte_axis_is_labelled_by_words_not_every_third_byte() -> None:
    labels = list(VERSE * 3)
    axis = token_axis(labels, len(labels))
    pairs = dict(zip(axis["tickvals"], axis["ticktext"]))
    assert pairs[0] == "ROMEO:" and "yonder" in pairs.values() and "window" in pairs.values()
    assert all(labels[p - 1].isspace() or p == 0 for p in axis["tickvals"])  # each tick starts a word
    assert len(axis["tickvals"]) <= MAX_TICKS and "words labelled" in axis["title"]["text"]
    short = token_axis(list("ROMEO:"), 6)  # short axes keep one label per token
    assert short["ticktext"] == ["R", "O", "M", "E", "O", ":"]


def test_a_spike_does_not_flatten_the_time_per_step_chart(small_model: LoadedModel) -> None:
    run = generate(small_model, prompt="abc", max_new_tokens=30)
    events = list(run.events)
    events[12] = dataclasses.replace(events[12], latency_ms=2000.0)  # one 2-second stall
    fig = charts.latency_chart(dataclasses.replace(run, events=tuple(events)))
    top = fig.layout.yaxis.range[1]
    assert top < 2000 and "are cut" in fig.layout.title.subtitle.text
    assert any("2,000 ms" in a.text for a in fig.layout.annotations)
    line = next(t for t in fig.data if isinstance(t, go.Scatter))
    assert "running median" in line.name
    y = np.asarray(line.y, dtype=np.float64)
    assert np.isfinite(y).all() and y.min() > 0


def test_legible_makes_axis_text_dark_and_projector_text_larger() -> None:
    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4]))
    fig.update_layout(font=dict(size=12, color="#aaaaaa"))
    legible(fig)
    assert fig.layout.font.color == INK and fig.layout.font.size == 15
    legible(fig, projector=True, height=300)
    assert fig.layout.font.size == PROJECTOR_SIZE and fig.layout.height == 300 and fig.layout.title.font.size >= 23


def test_projector_grows_preset_margins_with_the_font() -> None:
    """18 px labels beside the plot need 18/15 of the room a builder preset for 15 px ones (else
    Plotly's automargin lays the chart out twice); below it only the axis title grows (token labels
    keep 12 px); a margin left to Plotly stays unset."""
    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4]))
    fig.update_layout(font=dict(size=15), margin=dict(l=90, r=104, b=92))
    legible(fig, projector=True)
    assert (fig.layout.margin.l, fig.layout.margin.r, fig.layout.margin.b) == (108, 125, 98)
    bare = legible(go.Figure(go.Scatter(x=[1], y=[1])), projector=True)
    assert bare.layout.margin.l is None and bare.layout.margin.b is None


def test_calculator_context_chart_groups_models_by_colour_and_dtypes_by_dash() -> None:
    curves = [mcharts.Curve(f"{m} · {d}", (1024, 2048), (1, 2), m, d)
              for m in ("A", "B", "C") for d in ("fp16", "fp8", "int8", "int4")]
    fig = mcharts.memory_vs_context(curves)
    in_legend = [t.name for t in fig.data if t.showlegend is not False]
    assert in_legend == ["A", "B", "C", "fp16", "fp8", "int8", "int4"]  # 7 lines, not 12
    colours = {t.line.color for t in fig.data[:12]}
    dashes = {t.line.dash for t in fig.data[:12]}
    assert len(colours) == 3 and len(dashes) == 4


def test_a_projector_wraps_a_long_subtitle_at_a_space_between_tags_and_grows_the_margin() -> None:
    long = "Step 30: “.” (position 74) reads 75 cached keys; rows sum to 1. GQA: 9 query heads share 3 K/V heads."
    # 102 characters: the space nearest the middle is the one after "keys;" (at 49)
    assert wrap_subtitle(long) == long.replace("keys; rows", "keys;<br>rows")
    assert wrap_subtitle("short") == "short" and wrap_subtitle("a<br>b" * 40) == "a<br>b" * 40
    tagged = "<b>" + "word " * 30 + "</b>"
    wrapped = wrap_subtitle(tagged)
    assert wrapped.count("<br>") == 1 and wrapped.startswith("<b>") and wrapped.endswith("</b>")
    fig = go.Figure(go.Scatter(x=[1], y=[1]))
    fig.update_layout(title=dict(text="t", subtitle=dict(text=long)), margin=dict(t=96))
    legible(fig)
    assert fig.layout.title.subtitle.text == long  # a full-width chart keeps one line
    legible(fig, projector=True)
    assert "<br>" in fig.layout.title.subtitle.text and fig.layout.margin.t == 96 + 20


def test_a_projector_keeps_every_other_word_of_a_long_token_axis(small_model: LoadedModel) -> None:
    run = generate(small_model, prompt="ROMEO: but soft, what light through yonder window", max_new_tokens=8,
                   capture=CAPTURE_ALL)
    fig = charts.cache_notebook(run)
    before = list(fig.layout.xaxis2.tickvals)
    assert len(before) > PROJECTOR_TICKS
    legible(fig, projector=True)
    after = list(fig.layout.xaxis2.tickvals)
    span = fig.layout.xaxis2.range[1] - fig.layout.xaxis2.range[0]
    assert set(after) <= set(before) and len(after) <= PROJECTOR_TICKS + 1
    assert all(b - a >= span / PROJECTOR_TICKS for a, b in zip(after, after[1:]))
    labels = dict(zip(fig.layout.xaxis2.tickvals, fig.layout.xaxis2.ticktext))
    assert all(labels[v] == dict(zip(before, charts.cache_notebook(run).layout.xaxis2.ticktext))[v] for v in after)
    # The colour bars keep their titles beside them and three ticks, so a short chart never overprints them.
    # Each names what its colour is (issue 36: "length" alone): the L2 norm of the K or V vectors.
    assert [t.colorbar.title.text for t in fig.data] == ["‖K‖ (L2)", "‖V‖ (L2)"]
    assert all(t.colorbar.nticks == 3 and "(L2 norm, no unit)" in t.hovertemplate for t in fig.data)
    # A few labels crowded together are spaced out too (the rule is the spacing, not the count).
    few = go.Figure(go.Heatmap(z=[[1] * 100]))
    few.update_layout(xaxis=dict(tickmode="array", tickvals=[0, 2, 4, 50], ticktext=["a", "b", "c", "d"],
                                 range=[-0.5, 99.5]))
    legible(few, projector=True)
    assert list(few.layout.xaxis.tickvals) == [0, 4, 50] and list(few.layout.xaxis.ticktext) == ["a", "c", "d"]


def test_a_projector_puts_a_bottom_legend_under_the_axis_title_not_on_it() -> None:
    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4], name="a"))
    fig.update_layout(legend=dict(orientation="h", yanchor="top", y=-0.2), margin=dict(b=60))
    legible(fig)
    assert fig.layout.legend.y == -0.2 and fig.layout.margin.b == 60  # a full-size chart keeps its layout
    legible(fig, projector=True)
    assert (fig.layout.legend.yref, fig.layout.legend.y, fig.layout.legend.yanchor) == ("container", 0.0, "bottom")
    assert fig.layout.margin.b == PROJECTOR_BOTTOM
    side = go.Figure(go.Scatter(x=[1], y=[1]))
    side.update_layout(legend=dict(orientation="v", y=1.0))
    legible(side, projector=True)
    assert side.layout.legend.yref is None  # a legend beside the plot stays where it is


def test_a_projector_puts_a_long_y_title_on_two_lines_beside_the_plot() -> None:
    fig = go.Figure(go.Scatter(x=[1], y=[1]))
    fig.update_layout(yaxis_title_text="aggregate throughput (tokens/s)", yaxis2=dict(title_text="MB", overlaying="y"))
    legible(fig)
    assert fig.layout.yaxis.title.text == "aggregate throughput (tokens/s)"
    legible(fig, projector=True)
    assert fig.layout.yaxis.title.text == "aggregate throughput<br>(tokens/s)" and fig.layout.yaxis.title.font.size == 16
    assert fig.layout.yaxis2.title.text == "MB"  # a short title is left alone
