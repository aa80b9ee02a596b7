"""kvviz.charts.run_charts: pure Plotly figures of a Run (no Streamlit). Small byte model, a few steps each."""
from __future__ import annotations

import dataclasses

import numpy as np
import plotly.graph_objects as go
import pytest

from kvviz import Capture, LoadedModel, Run, generate
from kvviz.charts import run_charts as charts
from kvviz import CacheSpec

CAPTURE = Capture(attention=True, kv_norms=True, kv_layer=1)
PROMPT = "Hi there\n"  # 9 byte tokens, one of them a newline


@pytest.fixture(scope="module")
def runs(small_model: LoadedModel) -> dict[str, Run]:
    """The same 6-token greedy run in each cache mode."""
    out = {}
    for mode in ("static", "concat", "none"):
        out[mode] = generate(small_model, prompt=PROMPT, max_new_tokens=6, capture=CAPTURE,
                             cache=CacheSpec(use_cache=mode != "none", kind="static" if mode == "none" else mode))
    return out


def heatmaps(fig: go.Figure) -> list[go.Heatmap]:
    return [t for t in fig.data if isinstance(t, go.Heatmap)]


def assert_presentable(fig: go.Figure) -> None:
    """Every chart: a title, a fixed height, labelled axes, float32 arrays, serialisable."""
    assert fig.layout.title.text
    assert isinstance(fig.layout.height, int) and 250 <= fig.layout.height <= 600
    for t in fig.data:
        for name in ("x", "y", "z"):
            arr = getattr(t, name, None)
            if isinstance(arr, np.ndarray) and arr.dtype.kind == "f":
                assert arr.dtype == np.float32, f"{t.type}.{name} is {arr.dtype}"
    if fig.data:  # a message figure has no axes to label
        assert fig.layout.xaxis.title.text or fig.layout.xaxis2.title.text
        assert fig.layout.yaxis.title.text
    fig.to_json()


# --- labels -------------------------------------------------------------------------------------

def test_visible_makes_whitespace_and_control_characters_readable() -> None:
    assert charts.visible("a b\n\tc") == "a·b↵⇥c"
    assert charts.visible("\x00\x1b\x7f") == "<0x00><0x1B><0x7F>"
    assert charts.visible("") == "∅"
    assert charts.visible("é😀") == "é😀"


def test_events_carry_the_bytes_the_text_is_made_of(runs: dict[str, Run]) -> None:
    """Charts read token bytes from the events, never by parsing '<0xNN>' display strings."""
    run = runs["static"]
    assert [e.token_bytes for e in run.events] == [bytes([i]) for i in run.generated_ids]
    assert run.prompt_bytes == tuple(bytes([b]) for b in PROMPT.encode())


def test_position_labels_use_the_recorded_prompt_tokens_else_ids(runs: dict[str, Run]) -> None:
    run = runs["static"]
    labels = charts.position_labels(run)
    assert labels[:9] == list(PROMPT)  # byte ids decode one character each
    assert labels[9:] == [e.token_text for e in run.events]
    stored = dataclasses.replace(run, prompt_tokens=("Hi", " there", "\n") + ("",) * 6)
    assert charts.position_labels(stored)[:2] == ["Hi", " there"]
    bare = dataclasses.replace(run, prompt_tokens=())
    assert charts.position_labels(bare)[:2] == [f"<|{i}|>" for i in run.prompt_ids[:2]]


def test_generated_text_of_a_prefix_decodes_its_events(runs: dict[str, Run]) -> None:
    run = runs["static"]
    assert charts.generated_text(run) == run.text
    assert charts.generated_text(run.upto(2)) == bytes(run.generated_ids[:3]).decode("utf-8", errors="replace")


def test_token_axis_thins_labels_but_keeps_the_range() -> None:
    axis = charts.token_axis([str(i % 10) for i in range(500)], 500)
    assert len(axis["tickvals"]) <= charts.MAX_TICKS
    assert axis["range"] == [-0.5, 499.5]


# --- the notebook ---------------------------------------------------------------------------------

def test_norm_grid_fills_one_column_per_position_and_leaves_the_rest_empty(runs: dict[str, Run]) -> None:
    run = runs["static"]
    z, labels = charts.kv_norm_grid(run)
    X = len(run.prompt_ids) + run.max_new_tokens - 1
    assert z.shape == (2, run.n_layer, X) and z.dtype == np.float32
    assert labels == [f"layer {i}" for i in range(run.n_layer)]
    filled = run.events[-1].position
    assert np.isfinite(z[:, :, :filled]).all()
    assert np.isnan(z[:, :, filled:]).all()
    z_mid, _ = charts.kv_norm_grid(run.upto(2))
    assert np.isfinite(z_mid[:, :, : run.events[2].position]).all()
    assert np.isnan(z_mid[:, :, run.events[2].position:]).all()


def test_no_cache_grid_matches_the_cached_one(runs: dict[str, Run]) -> None:
    """Recomputing K/V gives the same vectors the cache would have kept (the no-cache view's point)."""
    cached, _ = charts.kv_norm_grid(runs["static"])
    recomputed, _ = charts.kv_norm_grid(runs["none"])
    np.testing.assert_allclose(recomputed, cached, rtol=2e-3, atol=2e-3)


def test_head_grid_and_values_grid_shapes(runs: dict[str, Run]) -> None:
    run = runs["static"]
    z, labels = charts.kv_norm_grid(run, by="head", layer=1)
    assert z.shape[:2] == (2, run.n_kv_head) and labels[0] == "head 0"
    # GQA: each K/V head names the query heads that read it (SmolLM2: 9 query heads over 3)
    assert charts.kv_head_labels(9, 3) == ["kv 0 ← q 0-2", "kv 1 ← q 3-5", "kv 2 ← q 6-8"]
    assert charts.kv_head_labels(4, 1) == ["kv 0 ← q 0-3"] and charts.kv_head_labels(4, 4)[3] == "head 3"
    vals, layer = charts.kv_value_grid(run, kv=1, head=2)
    assert layer == 1 and vals.shape == (run.head_dim, len(run.prompt_ids) + run.max_new_tokens - 1)


@pytest.mark.parametrize("mode", ["static", "concat", "none"])
def test_cache_notebook_marks_this_steps_columns(runs: dict[str, Run], mode: str) -> None:
    run = runs[mode].upto(3)
    fig = charts.cache_notebook(run)
    assert_presentable(fig)
    assert len(heatmaps(fig)) == 2  # K block and V block
    ev = run.events[-1]
    boxes = [s for s in fig.layout.shapes if s.line.color == charts.HILITE]
    assert boxes, "the columns of this step are outlined"
    x0, x1 = boxes[0].x0 + 0.5, boxes[0].x1 + 0.5
    if mode == "none":
        assert (x0, x1) == (0, ev.position)  # every column recomputed
        assert "none kept" in fig.layout.title.text
    else:
        assert (x0, x1) == (ev.position - 1, ev.position)  # one new column
    grey = [s for s in fig.layout.shapes if s.fillcolor == charts.EMPTY_FILL]
    assert bool(grey) == (mode == "static")  # only a preallocated cache has empty slots


def test_prefill_step_outlines_the_whole_prompt(runs: dict[str, Run]) -> None:
    fig = charts.cache_notebook(runs["static"].upto(0))
    box = next(s for s in fig.layout.shapes if s.line.color == charts.HILITE)
    assert (box.x0 + 0.5, box.x1 + 0.5) == (0, len(PROMPT))
    assert "prefill" in fig.layout.title.subtitle.text


def test_replay_keeps_the_frame_fixed(runs: dict[str, Run]) -> None:
    full = charts.cache_notebook(runs["static"])
    early = charts.cache_notebook(runs["static"].upto(1))
    assert tuple(full.layout.xaxis.range) == tuple(early.layout.xaxis.range)


def test_cache_values_heatmap(runs: dict[str, Run]) -> None:
    fig = charts.cache_values(runs["static"], "V", head=3)
    assert_presentable(fig)
    assert heatmaps(fig)[0].z.shape[0] == runs["static"].head_dim
    other = charts.cache_values(runs["static"], "K", head=0, wanted_layer=0)
    assert "layer 1 only" in other.layout.title.subtitle.text


# --- attention and time ---------------------------------------------------------------------------

def test_attention_heatmap_has_a_row_per_layer_and_head(runs: dict[str, Run]) -> None:
    run = runs["static"]
    fig = charts.attention_heatmap(run, selected=(1, 2))
    assert_presentable(fig)
    z = heatmaps(fig)[0].z
    assert z.shape == (run.n_layer * run.n_head, len(run.prompt_ids) + run.max_new_tokens - 1)
    S = run.events[-1].position
    np.testing.assert_allclose(np.nansum(z, axis=1), 1.0, atol=1e-2)  # softmax rows
    assert np.isnan(z[:, S:]).all()


def test_attention_bars_for_one_head(runs: dict[str, Run]) -> None:
    run = runs["concat"]
    fig = charts.attention_bars(run, layer=1, head=3)
    assert_presentable(fig)
    bar = fig.data[0]
    assert len(bar.y) == run.events[-1].position and bar.y.dtype == np.float32
    assert len(fig.layout.annotations) >= 3  # the three strongest positions are named


def test_attention_bars_for_an_uncaptured_layer_says_so(small_model: LoadedModel) -> None:
    run = generate(small_model, prompt="abc", max_new_tokens=2, capture=Capture(attention=(0,)))
    fig = charts.attention_bars(run, layer=1, head=0)
    assert not fig.data and "not captured" in fig.layout.annotations[0].text


def test_latency_chart_marks_prefill_and_plots_tokens_per_second(runs: dict[str, Run]) -> None:
    run = runs["none"]
    fig = charts.latency_chart(run)
    assert_presentable(fig)
    bars, line = fig.data
    assert list(bars.marker.color[:2]) == [charts.PROMPT_COLOR, charts.GEN_COLOR]
    assert line.yaxis == "y2" and fig.layout.yaxis2.title.text == "tokens/s"
    assert any("prefill" in a.text for a in fig.layout.annotations)
    assert fig.layout.xaxis.range[1] >= run.max_new_tokens - 1  # room for the whole run while live
    # tokens/s ticks at whole 1, 2 or 5 x 10^n steps from 0 (issue 36 saw "0, 2, 4, 5, 7, 9": 1.75 apart,
    # rounded by the integer tick format), and the axis reaches past the fastest point
    y2 = fig.layout.yaxis2
    assert y2.tick0 == 0 and y2.dtick in {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000}
    assert y2.range[0] == 0 and y2.range[1] >= max(line.y) and y2.range[1] / y2.dtick <= 6 * 1.05
    from kvviz.charts.style import integer_ticks

    assert [integer_ticks(t)["dtick"] for t in (0.3, 9.4, 13, 65.15, 1320)] == [1, 2, 5, 20, 500]
    from kvviz.charts.style import top_tick

    assert [top_tick(integer_ticks(t)) for t in (0.3, 9.4, 96, 99.9, 1320)] == [1, 8, 100, 100, 1000]


def test_empty_and_capture_free_runs_give_message_figures(runs: dict[str, Run]) -> None:
    empty = runs["static"].upto(-1)
    assert not empty.events
    bare = dataclasses.replace(runs["static"], events=tuple(
        dataclasses.replace(e, attn=None, kv_norms=None, kv_values=None) for e in runs["static"].events))
    for fn in (charts.cache_notebook, charts.cache_values, charts.attention_heatmap, charts.attention_bars,
               charts.latency_chart):
        assert_presentable(fn(empty))
    for fn in (charts.cache_notebook, charts.cache_values, charts.attention_heatmap):
        fig = fn(bare)
        assert not fig.data and fig.layout.annotations


def test_attention_labels_at_most_12_layers(make_llama) -> None:  # type: ignore[no-untyped-def]
    """30 layers (SmolLM2) labelled one by one overprint each other: every k-th layer instead."""
    run = generate(make_llama(n_layer=30), prompt="Hi", max_new_tokens=2, capture=Capture(attention=True))
    axis = charts.attention_heatmap(run).layout.yaxis
    assert list(axis.ticktext) == [f"layer {i}" for i in range(0, 30, 3)]
    assert list(axis.tickvals) == [f"L{i} h1 (kv0)" for i in range(0, 30, 3)]  # the middle of 4 heads' rows
    small = generate(make_llama(), prompt="Hi", max_new_tokens=2, capture=Capture(attention=True))
    assert list(charts.attention_heatmap(small).layout.yaxis.ticktext) == ["layer 0", "layer 1"]


def test_mqa_says_every_query_head_reads_the_one_kv_head(make_model) -> None:  # type: ignore[no-untyped-def]
    """Gemma 3's shape (one K/V head): the heatmap and the metrics name it MQA, with MHA's bytes beside."""
    from kvviz.ui.pages.generate.metrics import bytes_formula

    run = generate(make_model(n_kv_head=1), prompt="Hi there", max_new_tokens=3, capture=Capture(attention=True))
    fig = charts.attention_heatmap(run)
    assert list(fig.data[0].y)[:4] == ["L0 h0 (kv0)", "L0 h1 (kv0)", "L0 h2 (kv0)", "L0 h3 (kv0)"]
    assert "MQA: all 4 query heads read one K/V head." in fig.layout.title.subtitle.text
    assert [s.line.dash for s in fig.layout.shapes if s.type == "path"] == [None]  # layer gaps, no groups
    used = run.events[-1].cache_bytes_used
    assert f"**MQA saves**: all 4 query heads read one K/V head. With one K/V head per query head (MHA) these " \
           f"tokens would take {4 * used:,} B" in bytes_formula(run)


def test_gqa_groups_query_heads_by_the_kv_head_they_read(make_model) -> None:  # type: ignore[no-untyped-def]
    """4 query heads over 2 K/V heads: rows say which K/V head each reads, and the metrics show
    the bytes GQA saves against MHA from the run's own numbers."""
    from kvviz.ui.pages.generate.metrics import bytes_formula

    run = generate(make_model(n_kv_head=2), prompt="Hi there", max_new_tokens=3, capture=Capture(attention=True))
    fig = charts.attention_heatmap(run)
    rows = list(fig.data[0].y)
    assert rows[:4] == ["L0 h0 (kv0)", "L0 h1 (kv0)", "L0 h2 (kv1)", "L0 h3 (kv1)"]
    assert "GQA: 4 query heads share 2 K/V heads (dotted lines group them)" in fig.layout.title.subtitle.text
    gaps, groups = (s.path for s in fig.layout.shapes if s.type == "path")
    assert gaps == "".join(f"M0,{4 * i - 0.5:g}H1" for i in range(1, run.n_layer))  # between layers
    assert groups == "".join(f"M0,{4 * i + 1.5:g}H1" for i in range(run.n_layer))  # kv0 | kv1 within each
    ev = run.events[-1]
    text = bytes_formula(run)
    assert f"would take {2 * ev.cache_bytes_used:,} B" in text and f"{ev.cache_bytes_used:,} B saved" in text


def test_heatmap_columns_are_gapped_only_while_there_are_few(runs: dict[str, Run]) -> None:
    """A 1-px gap per column made Chromium draw each cell on its own (twice the render time on
    SmolLM2's 240 positions): the notebook and the attention map separate their columns up to
    COLUMN_GAP_MAX planned positions, not beyond; the notebook's rows keep their gap."""
    short = runs["static"]  # 9 + 6 - 1 = 14 planned columns
    long = dataclasses.replace(short, max_new_tokens=charts.COLUMN_GAP_MAX - 9 + 2)  # 129 planned columns
    assert charts.planned_columns(long) == charts.COLUMN_GAP_MAX + 1
    for run, gap in ((short, 1), (long, 0)):
        for fig in (charts.cache_notebook(run), charts.attention_heatmap(run)):
            assert [t.xgap for t in heatmaps(fig)] == [gap] * len(heatmaps(fig))
        assert [t.ygap for t in heatmaps(charts.cache_notebook(run))] == [1, 1]
    edge = dataclasses.replace(short, max_new_tokens=charts.COLUMN_GAP_MAX - 9 + 1)  # exactly 128
    assert charts.column_gap(charts.planned_columns(edge)) == 1


# --- margins: Plotly lays a live chart out once ------------------------------------------------------

def test_visible_len_counts_what_a_plotly_label_shows() -> None:
    from kvviz.charts.render_cost import visible_len
    from kvviz.charts.tokens import MAX_LABEL

    assert visible_len(charts.short_label("<|im_start|>")) == MAX_LABEL  # "&lt;|im_st…"
    assert visible_len("<b>K</b> (keys)") == len("K (keys)")
    assert visible_len("a &amp; b<br>c") == len("a & bc")
    assert visible_len("") == 0 and visible_len("Tom & Jerry") == len("Tom & Jerry")  # a lone '&' is text


def test_token_axis_margin_grows_with_slanted_labels() -> None:
    """The bottom margins automargin measured in Chromium: 49 px for level labels, 77 for six
    characters slanted, 88 for eight (the presets add a few px)."""
    from kvviz.charts.render_cost import AXIS_MARGIN_FLAT, axis_margin

    level = charts.token_axis(list("Hi there"), 8)
    assert level["tickangle"] == 0 and axis_margin(level) == AXIS_MARGIN_FLAT >= 49
    six = charts.token_axis(["·Romeo", "·loves"] * 4, 8)
    eight = charts.token_axis(["<|im_start|>", "·assistant"] * 4, 8)
    assert six["tickangle"] == eight["tickangle"] == -50
    assert 77 <= axis_margin(six) <= 77 + 6 and 88 <= axis_margin(eight) <= 88 + 6


def test_each_live_chart_presets_the_margins_its_labels_need(runs: dict[str, Run], make_model) -> None:  # type: ignore[no-untyped-def]
    """Level byte labels (this run's 14 columns) need the flat bottom margin; colorbars a wide right
    one; a GQA head label ("kv 0 ← q 0-1") a wider left one than "layer 1" (116 px measured for
    "kv 0 ← q 0-2"). The browser tests check Plotly then grows none of them."""
    from kvviz.charts.render_cost import AXIS_MARGIN_FLAT

    run = runs["static"]
    notebook, attention = charts.cache_notebook(run), charts.attention_heatmap(run, (0, 0))
    bars, latency = charts.attention_bars(run, 0, 0), charts.latency_chart(run)
    for fig in (notebook, attention, bars, latency):
        assert fig.layout.margin.b == AXIS_MARGIN_FLAT
        assert fig.layout.template.layout.xaxis.ticklabeloverflow == "allow"  # no per-label overflow check
    assert notebook.layout.margin.r == charts.COLORBAR_R and attention.layout.margin.r == charts.COLORBAR_TITLE_R
    assert notebook.layout.margin.l == charts.MARGIN["l"]
    gqa = generate(make_model(n_kv_head=2), prompt="Hi there", max_new_tokens=2, capture=CAPTURE)
    heads = charts.cache_notebook(gqa, "head", 0)
    assert list(heads.data[0].y) == ["kv 0 ← q 0-1", "kv 1 ← q 2-3"]
    assert heads.layout.margin.l == 20 + 8 * len("kv 0 ← q 0-1") > charts.MARGIN["l"]
    # The tokens/s axis's labels: "2,000" (71 px; "1,320" measured 69) needs more room than "20" (48 measured).
    def at(ms: float) -> Run:
        return dataclasses.replace(run, events=tuple(dataclasses.replace(e, latency_ms=ms) for e in run.events))
    assert charts.latency_chart(at(0.5)).layout.margin.r == 71
    assert charts.latency_chart(at(50.0)).layout.margin.r == 50
    # 96 tok/s: the axis runs to 100.8 and labels its top tick "100", three digits (a margin sized for
    # "96" was grown by Plotly in the browser test of SmolLM2's answer, 2026-11-29)
    assert charts.latency_chart(at(10.4)).layout.margin.r == 36 + 7 * 3


def test_chat_turn_charts_write_their_numbers_level_and_compare_reuse() -> None:
    """Issue 36: the chat's per-turn counts ("8" generated) were turned sideways in thin segments;
    they are level, at least 11 px. The TTFT chart pairs each turn's TTFT with its no-reuse TTFT."""
    from kvviz.charts import paged_charts as pc

    turns = [{"reused_tokens": r, "prefilled_tokens": p, "generated_tokens": 8, "ttft_ms": t,
              "no_reuse_ttft_ms": n} for r, p, t, n in ((0, 40, 120.0, 118.0), (48, 15, 60.0, None),
                                                        (71, 15, 55.0, 250.0))]
    reuse = pc.reuse_bars(turns)
    assert [tr.textangle for tr in reuse.data] == [0, 0, 0] and reuse.layout.uniformtext.minsize >= 11
    assert [str(v) for v in reuse.data[2].text] == ["8", "8", "8"]
    ttft = pc.ttft_bars(turns)
    assert [tr.textangle for tr in ttft.data] == [0, 0]
    assert list(ttft.data[0].y) == [120.0, 60.0, 55.0] and list(ttft.data[1].y) == [118.0, None, 250.0]
    assert list(ttft.data[1].text) == ["118", "", "250"] and ttft.layout.yaxis.range[1] >= 250.0
    # The check's recompute fills a turn that was not timed after it.
    turns[1]["recompute_ttft_ms"] = 90.0
    assert list(pc.ttft_bars(turns).data[1].y) == [118.0, 90.0, 250.0]


def test_the_no_reuse_note_names_the_noise_on_a_turn_that_reused_nothing() -> None:
    """A turn that reused nothing timed the same work twice: the note calls their gap noise, not
    a saving; a turn that reused says how much it saved. Figures as the turn recorded them."""
    import dataclasses

    from kvviz.engine.sessions.turn import TurnRecord
    from kvviz.ui.pages.chat.chat_views import no_reuse_note

    base = TurnRecord(user="u", text="a", prompt_ids=tuple(range(36)), generated_ids=(1,) * 24, cached_before=0,
                      reused_tokens=0, prefilled_tokens=36, ttft_ms=120.4, decode_ms=900.0, cache_bytes_before=0,
                      cache_bytes_used=1, cache_bytes_allocated=1, blocks_used=None, blocks_shared=None,
                      prefix_hit_blocks=None, stop_reason="max_new_tokens", no_reuse_ttft_ms=131.0)
    first = no_reuse_note([base], "m · static cache", "cpu")
    assert "120 ms with reuse vs 131 ms without" in first and "gap (11 ms)" in first and "saved" not in first
    later = dataclasses.replace(base, prompt_ids=tuple(range(75)), reused_tokens=59, prefilled_tokens=16,
                                ttft_ms=60.2, no_reuse_ttft_ms=250.0)
    note = no_reuse_note([base, later], "m · static cache", "cpu")
    assert "59 tokens reused, 16 prefilled" in note and "same 75 prompt tokens" in note and "(saved 190 ms)" in note
    assert no_reuse_note([dataclasses.replace(base, no_reuse_ttft_ms=None)], "x", "cpu").startswith("The TTFT without")
    # A turn computed before a model switch is named with the model and cache that computed it.
    carried = dataclasses.replace(later, made_on="smollm2 (fp32, fast engine) · paged cache, blocks of 16")
    assert "(smollm2 (fp32, fast engine) · paged cache, blocks of 16)" in no_reuse_note([carried], "tiny", "cpu")
