"""The Compression lab page in AppTest (random:tiny, a GPT-2-family model): the four KV dtypes side
by side, the window tab (which explains why GPT-2 keeps its positions) and the shipped curves."""
from __future__ import annotations

from streamlit.testing.v1 import AppTest

from apptest_pages import ok as _ok, tiny_default, titles as _titles  # noqa: F401 (tiny_default: autouse)
from kvviz import CacheSpec


def _compress() -> None:
    import streamlit as st

    from kvviz.ui.pages.compress import compress
    from kvviz.ui.sidebar import render_sidebar

    st.session_state["settings"] = render_sidebar()
    compress.page()


def test_quantized_tab_compares_four_caches() -> None:
    at = AppTest.from_function(_compress, default_timeout=120)
    at.run()
    _ok(at)
    titles = _titles(at)
    assert any(t.startswith("Perplexity by position: smollm2") for t in titles)  # the shipped measurement
    at.number_input(key="kvq_new").set_value(6)
    at.button(key="kvq_run").click().run()
    _ok(at)
    titles = _titles(at)
    assert "Where each KV dtype leaves full precision" in titles
    assert any(t.startswith("K error per layer and KV head (int8)") for t in titles)
    assert any(t.startswith("Attention-row KL (int8)") for t in titles)
    assert "Keys' outlier channels, layer 0" in titles
    labels = [m.label for m in at.metric]
    assert labels[:4] == ["fp32 (full)", "int8", "int4", "fp8 per-tensor"]
    # every live cache's bytes, beside the calculator's figure for the same settings: equal, four times
    assert sum("equals the calculator" in c.value for c in at.caption) == 4, [c.value for c in at.caption]
    table = next(d.value for d in at.dataframe if "logit KL (mean)" in d.value.columns)
    assert list(table["KV"]) == ["int8", "int4", "fp8 per-tensor"]
    from kvviz.engine.loading.loader import RANDOM_SHAPES

    hs = RANDOM_SHAPES["tiny"].head_dim
    # int8 holds a byte per value plus one fp16 scale per head vector, against fp32's 4 bytes per value
    assert list(table["vs full"]) == [f"{(hs + 2) / (4 * hs):.1%}", f"{(hs / 2 + 2) / (4 * hs):.1%}", "25.0%"]
    assert "Quantization error at every step (int8)" in titles
    at.radio(key="kvq_pick").set_value("int4").run()
    _ok(at)
    assert any(t.startswith("K error per layer and KV head (int4)") for t in _titles(at))
    at.radio(key="kvq_err_kv").set_value("V")
    at.radio(key="kvq_err_stat").set_value("mean").run()
    _ok(at)
    assert any(t.startswith("V error per layer and KV head (int4)") for t in _titles(at))


def test_window_tab_runs_past_the_window_and_explains_gpt2() -> None:
    at = AppTest.from_function(_compress, default_timeout=120)
    at.run()
    assert any("learned position embedding" in i.value for i in at.info)
    assert at.selectbox(key="kvw_pos").options == ["original"]
    at.number_input(key="kvw_window").set_value(8)
    at.number_input(key="kvw_sinks").set_value(2)
    at.number_input(key="kvw_new").set_value(20)
    at.button(key="kvw_run").click().run()
    _ok(at)
    held = next(m for m in at.metric if m.label == "Positions held")
    assert held.value == "10"
    titles = _titles(at)
    assert "What the cache keeps: sinks, the window, and the evicted" in titles
    assert "The ring: which position each slot holds" in titles


def test_window_bad_combination_is_a_message() -> None:
    at = AppTest.from_function(_compress, default_timeout=120)
    at.run()
    at.number_input(key="kvw_window").set_value(4)
    at.number_input(key="kvw_sinks").set_value(4)
    at.button(key="kvw_run").click().run()
    assert not at.exception
    assert any("must be fewer than the window" in e.value for e in at.error)
    assert at.number_input(key="kvw_sinks").value == 4  # inputs stay as typed


def test_curves_measured_on_demand() -> None:
    at = AppTest.from_function(_compress, default_timeout=120)
    at.run()
    at.number_input(key="kvc_tokens").set_value(96)
    at.number_input(key="kvc_window").set_value(16)
    at.button(key="kvc_run").click().run()
    _ok(at)
    titles = _titles(at)
    assert "Perplexity by position: random:tiny" in titles
    live = [d.value for d in at.dataframe if "perplexity (all positions)" in d.value.columns][-1]
    assert list(live["cache"]) == ["full", "window 16", "4 sinks + window 16"]  # GPT-2: no renumbering
    assert (live["perplexity (all positions)"] > 1).all()


def test_calculator_bytes_follow_each_layers_window_on_gemma3() -> None:
    """The quantized tab's calculator figure, layer by layer: past its window a sliding layer of
    Gemma 3 holds its window, and the live quantized cache's bytes equal the figure at every length."""
    import importlib
    import sys
    from pathlib import Path

    import kvviz
    from kvviz.ui.pages.compress.compress import _calculator_bytes

    folder = str(Path(__file__).resolve().parents[1] / "engine")
    if folder not in sys.path:  # the test folders are not packages
        sys.path.insert(0, folder)
    m = importlib.import_module("test_gemma3_tiny").tiny()  # 3 layers, 2 sliding with a window of 5
    for dt, n in (("int8", 3), ("int4", 12), ("fp8", 12)):
        run = kvviz.generate(m, prompt=[7, 8, 9, 10], max_new_tokens=n, cache=CacheSpec(kv_dtype=dt, group_size=8))
        positions = 4 + run.events[-1].step
        assert run.events[-1].cache_bytes_used == _calculator_bytes(m, dt, 8, False, "tensor", positions), dt
    # by hand, int8 in groups of 8 over 16 dims: 16 code bytes + 2 fp16 scales = 20 B a vector, K and V;
    # 16 positions on the global layer, the window's 5 on each sliding one
    assert _calculator_bytes(m, "int8", 8, False, "tensor", 16) == 2 * 20 * (16 + 5 + 5)
