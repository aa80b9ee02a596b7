"""kvviz.notebook: the figures are the app's own chart functions' figures, the chips are escaped,
the calculator table holds exact bytes, and LiveView (ipywidgets + FigureWidget) draws a run as it
goes, stops at a Stop click and says a bad request before anything runs."""
from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

import kvviz.notebook as nb  # noqa: E402
from kvviz import generate  # noqa: E402
from kvviz.charts import run_charts  # noqa: E402
from kvviz.errors import KVVizError  # noqa: E402
from kvviz import SamplingParams


def test_figures_are_the_app_chart_functions_figures(small_model) -> None:  # type: ignore[no-untyped-def]
    run = nb.generate(small_model, prompt="<b>hi</b> & bye", max_new_tokens=6)
    assert nb.cache_notebook(run).to_dict() == run_charts.cache_notebook(run).to_dict()
    assert nb.attention(run).to_dict() == run_charts.attention_heatmap(run).to_dict()
    assert nb.step_latencies(run).to_dict() == run_charts.latency_chart(run).to_dict()
    assert run.events[-1].attn is not None  # CAPTURE_ALL: the attention figure has data to draw
    html = nb.chips(run)._repr_html_()
    assert "&lt;b&gt;" in html and "<b>hi" not in html  # model/user text is escaped, never raw HTML
    assert repr(nb.chips(run)) == run.prompt_text + run.text


def test_race_runs_cached_and_uncached_to_the_same_tokens(small_model) -> None:  # type: ignore[no-untyped-def]
    runs = nb.race_runs(small_model, "abc", max_new_tokens=8)
    assert runs["static"].generated_ids == runs["none"].generated_ids and len(runs["none"].events) == 8
    assert [e.input_len for e in runs["none"].events] == list(range(3, 11))  # recomputes all t tokens
    assert [e.input_len for e in runs["static"].events] == [3] + [1] * 7
    assert len(nb.race(runs).data) >= 2
    with pytest.raises(KVVizError, match="unknown race chart"):
        nb.race(runs, chart="pie")


def test_calculator_table_is_exact() -> None:
    df = nb.calculator_table(["llama-3-8b"], [1000, 8192], kv_dtype="fp16")
    # Llama 3 8B: 32 layers x 8 KV heads x 128 x (K and V) x 2 bytes = 131,072 bytes per token.
    assert df["bytes per token"].tolist() == [131_072, 131_072]
    assert df["KV bytes"].tolist() == [131_072 * 1000, 131_072 * 8192]
    with pytest.raises(KVVizError):
        nb.calculator_table(["no-such-model"], [10])


def test_live_view_draws_each_step_and_ends_with_the_run(small_model) -> None:  # type: ignore[no-untyped-def]
    view = nb.LiveView(small_model, "abc", max_new_tokens=10, redraw_s=0.0, display=False, start=False)
    assert view.status.value.endswith("ready</span>") and not view.done
    sent: list[str] = []
    original = view._draw

    def draw_and_check(final: bool) -> None:
        original(final)
        sent.append(json.dumps(view.figure._data, allow_nan=False, default=lambda a: a.tolist()))

    view._draw = draw_and_check  # type: ignore[method-assign]
    view.start(background=False)
    assert view.done and view.error is None and view.stop_button.disabled
    reference = generate(small_model, prompt="abc", max_new_tokens=10)
    assert view.run.generated_ids == reference.generated_ids  # the live view changes nothing it shows
    assert view.draws == 1 + 10 + 1 and len(sent) == 10 + 1  # the empty view, every step (redraw_s=0), the end
    assert view.figure.layout.title.text == run_charts.cache_notebook(view.run).layout.title.text
    assert "max_new_tokens: 10 tokens" in view.status.value
    # The widget's state after every draw is strict JSON (arrays aside, which go as binary buffers).
    assert len(sent) == 11
    assert view.text.value.count(reference.text.replace("&", "&amp;").replace("<", "&lt;")[:3]) >= 1
    with pytest.raises(KVVizError, match="already ran"):
        view.start()


def test_stop_click_ends_a_background_run(small_model) -> None:  # type: ignore[no-untyped-def]
    view = nb.LiveView(small_model, "abc", max_new_tokens=60, redraw_s=0.0, display=False, start=False)
    drawn = threading.Event()
    original = view._draw

    def draw_then_click(final: bool) -> None:  # click Stop from inside the third step's redraw
        original(final)
        if len(view.run.events) == 3 and not drawn.is_set():
            drawn.set()
            view.stop_button.click()

    view._draw = draw_then_click  # type: ignore[method-assign]
    view.start()
    assert view.wait(120)
    assert view.run.stop_reason == "stopped" and len(view.run.events) == 3
    assert "stopped: 3 tokens" in view.status.value


def test_bad_request_is_refused_before_anything_runs(small_model) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KVVizError):
        nb.LiveView(small_model, "abc", max_new_tokens=0, display=False)
    with pytest.raises(KVVizError):
        nb.LiveView(small_model, "abc", display=False, sampling=SamplingParams(top_k=5))  # top_k without a temperature
