"""The Decoding strategies page in AppTest (random:tiny): beam search and speculative decoding end to end."""
from __future__ import annotations

from streamlit.testing.v1 import AppTest

from apptest_pages import ok as _ok, tiny_default, titles as _titles  # noqa: F401 (tiny_default: autouse)


def _decoding() -> None:
    import streamlit as st

    from kvviz.ui.pages.decoding import decoding
    from kvviz.ui.sidebar import render_sidebar

    st.session_state["settings"] = render_sidebar()
    decoding.page()


def test_beam_tab_runs_and_shows_tree_reorder_and_bytes() -> None:
    at = AppTest.from_function(_decoding, default_timeout=120)
    at.run()
    _ok(at)
    assert at.title[0].value == "Decoding strategies"
    at.text_area(key="prompt").set_value("abcabc").run()
    at.number_input(key="beam_k").set_value(3)
    at.number_input(key="beam_new").set_value(5)
    at.button(key="beam_run").click().run()
    _ok(at)
    t = _titles(at)
    assert "The beam tree" in t and "Bytes each reorder copied" in t
    assert "Cache rows at step 0: before and after the reorder" in t
    table = at.dataframe[0].value
    assert list(table["beam"]) == [0, 1, 2] and list(table["score"]) == sorted(table["score"], reverse=True)
    labels = {m.label: m.value for m in at.metric}
    assert labels["Beams k"] == "3" and labels["Steps"] == "5"
    at.slider(key="beam_step").set_value(2).run()
    _ok(at)
    assert "Cache rows at step 2: before and after the reorder" in _titles(at)
    # A bad request is a message, and the earlier result stays.
    at.text_area(key="prompt").set_value("").run()
    at.button(key="beam_run").click().run()
    assert any("prompt is empty" in e.value for e in at.error)
    assert "The beam tree" in _titles(at)


def test_spec_tab_times_both_and_draws_the_notebook() -> None:
    at = AppTest.from_function(_decoding, default_timeout=120)
    at.run()
    at.selectbox(key="spec_prompt").set_value("counting")
    at.number_input(key="spec_new").set_value(24)
    at.button(key="spec_run").click().run()
    _ok(at)
    t = _titles(at)
    assert "What each verify forward wrote into the cache" in t and "Drafted vs accepted, per verify forward" in t
    assert any("Identical output" in s.value and "24 tokens" in s.value for s in at.success)
    labels = {m.label for m in at.metric}
    assert {"Acceptance", "Forward passes", "Forwards saved", "Speedup (wall clock)", "Positions rolled back"} <= labels
