"""The guided tour and the presentation layout: their texts, and both in headless Streamlit (AppTest)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from kvviz.ui import present, tour

APP = Path(__file__).resolve().parents[2] / "app.py"

# Every term the tour uses, and the words that define it where it first appears.
TERMS = {
    "tokens": "numbered pieces of text", "query": "what am I looking for", "key": "what do I hold",
    "value": "what I pass on", "causal": "only looks back", "KV cache": "notebook", "L2 norm": "square root",
    "prefill": "whole prompt goes through", "TTFT": "time to first token", "decode": "feeds only the newest",
    "TPOT": "time per output token", "attention heads": "its own Q, K", "GQA": "share one K/V head",
    "roofline": "most arithmetic", "compute-bound": "arithmetic is its limit", "memory-bound": "reading bytes is",
}


def test_eight_steps_define_every_term_where_it_first_appears() -> None:
    steps = tour.steps(None)  # no model: the tour must not depend on any one (SmolLM2 or other)
    assert len(steps) == 9
    text = [s.text for s in steps]
    for term, definition in TERMS.items():
        first = next(i for i, t in enumerate(text) if term in t)
        assert definition in text[first], (term, first)
    assert "GQA" in text[5] and "SmolLM2" in text[5]  # step 6: what GQA is, on SmolLM2, by name only
    assert [s.action for s in steps[:5]] == ["generate", None, "step", "step", "no_cache"]
    assert steps[6].link == "calculator" and steps[7].link == "race" and steps[8].link == "serving"
    assert re.search(r"Llama-2-70B.*per token", text[6])  # the calculator's answer for a 70B model


def test_highlight_css_outlines_the_views() -> None:
    css = tour.highlight_css(("output", "view_notebook"))
    assert ".st-key-output,.st-key-view_notebook{outline" in css


def test_steps_that_say_the_chart_below_scroll_it_into_view(app: AppTest) -> None:
    steps = tour.steps(None)
    below = [i + 1 for i, s in enumerate(steps) if "chart below" in s.text or "heatmap" in s.text]
    assert below == [2, 6] and [steps[i - 1].scroll_to for i in below] == ["view_notebook", "view_attention"]
    assert all(s.scroll_to is None or s.scroll_to in s.points_at for s in steps)
    js = tour.scroll_js("view_notebook")
    assert ".st-key-view_notebook" in js and "scrollIntoView" in js and "r.bottom <= vh" in js

    def scripts(at: AppTest) -> list[str]:
        return [h.proto.body for h in at.get("html") if "scrollIntoView" in h.proto.body]

    app.query_params["tour"] = "2"
    app.run()
    assert not app.exception
    assert len(scripts(app)) == 1 and ".st-key-view_notebook" in scripts(app)[0]
    app.run()  # a rerun at the same step (Step, Generate) leaves the scroll where the reader put it
    assert scripts(app) == []
    app.button(key="tour_next").click().run()  # step 3 points at the notebook too, but scrolls nothing
    assert scripts(app) == []
    app.button(key="tour_back").click().run()  # back at step 2: the chart is brought into view again
    assert len(scripts(app)) == 1 and ".st-key-view_notebook" in scripts(app)[0]


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> AppTest:
    monkeypatch.setenv("KVVIZ_DEFAULT_MODEL", "random:tiny")
    monkeypatch.setenv("KVVIZ_MODELS_DIR", str(tmp_path))
    return AppTest.from_file(str(APP), default_timeout=120)


def test_tour_from_the_url_walks_and_acts(app: AppTest) -> None:
    app.query_params["tour"] = "1"
    app.run()
    assert not app.exception
    md = " ".join(m.value for m in app.markdown)
    assert "Tour, step 1 of 9: What a token is" in md
    app.number_input(key="max_new_tokens").set_value(6).run()
    app.button(key="tour_action").click().run()  # step 1's action: Generate
    assert not app.exception and any("finished: 6 tokens" in m.value for m in app.markdown)
    app.button(key="tour_next").click().run()
    app.button(key="tour_next").click().run()  # step 3: prefill, by Step
    assert app.session_state[tour.STEP_KEY] == 3 and app.query_params["tour"] in ("3", ["3"])
    app.button(key="tour_action").click().run()
    assert any("step mode, 1 of 6" in m.value for m in app.markdown)
    app.button(key="tour_next").click().run()
    app.button(key="tour_next").click().run()  # step 5: no cache, then step
    app.button(key="tour_action").click().run()
    assert app.session_state["cache_mode"] == "none"
    assert any("No cache" in m.value or "step mode, 1 of 6" in m.value for m in app.markdown)
    # The step-mode run the setting change ended says why in the run picker, not just "stopped".
    labels = list(app.selectbox(key="run_pick").options)  # as shown
    assert any("ended when a setting changed" in x for x in labels), labels
    app.button(key="tour_end").click().run()
    assert app.session_state[tour.STEP_KEY] == 0 and "tour" not in app.query_params


def test_presentation_layout_from_the_url_and_its_switch(app: AppTest) -> None:
    app.query_params["present"] = "1"
    app.run()
    assert not app.exception
    assert app.session_state[present.STATE_KEY] is True and app.toggle(key=present.KEY).value is True
    css = " ".join(h.proto.body for h in app.get("html"))
    assert "html{font-size:19px}" in css
    app.toggle(key=present.KEY).set_value(False).run()
    assert app.session_state[present.STATE_KEY] is False and "present" not in app.query_params
    css = " ".join(h.proto.body for h in app.get("html"))
    assert "html{font-size:19px}" not in css


def test_measurement_pages_feed_the_prompt_as_generate_does_through_the_chat_template(smollm2) -> None:  # type: ignore[no-untyped-def]
    """With Chat on, the race, the sweeps and the batching page get the question in SmolLM2's template (fed
    bare, the instruct model answers with its end token at once: a one-token race). Checked against
    the chat module's own rendering and against what generate(chat=True) feeds."""
    from kvviz import generate
    from kvviz.engine.tokenize.chat_template import chat_prompt
    from kvviz.ui.common.measuring_page import prompt_ids
    from kvviz.ui.settings import Settings

    q = "What is the capital of France?"
    ids, text = prompt_ids(Settings(model="smollm2", prompt=q, chat=True), smollm2)
    want = chat_prompt(smollm2.tokenizer, [{"role": "user", "content": q}])
    assert ids == want.ids and text == want.text and text.endswith("<|im_start|>assistant\n")
    assert ids == tuple(generate(smollm2, prompt=q, chat=True, max_new_tokens=1).prompt_ids)
    plain, text = prompt_ids(Settings(model="smollm2", prompt=q, chat=False), smollm2)
    assert plain == tuple(smollm2.tokenizer.encode(q)) and text == q and len(plain) < len(ids)
    assert prompt_ids(Settings(model="smollm2", prompt="", chat=True), smollm2) == ((), "")


def test_a_hybrid_model_gets_a_ninth_step_with_the_calculators_numbers() -> None:
    """Gemma 3 270M's shape: 15 sliding layers (window 512) and 3 global (5, 11, 17), one K/V head of
    256. fp32 per layer and token: 2 x 1 x 256 x 4 = 2,048 B. At 32,768 tokens: 2,048 x (3 x 32,768 +
    15 x 512) B held, against 2,048 x 18 x 32,768 B if every layer were global; the calculator's
    preset gives the same figure."""
    from types import SimpleNamespace

    from kvviz.engine.models.gemma3 import Gemma3Config
    from kvviz.calculator import MemoryRequest, calculate, find_preset, load_presets
    from kvviz.units import fmt_bytes

    model = SimpleNamespace(config=Gemma3Config(), tokenizer=SimpleNamespace(vocab_size=262144))
    steps = tour.steps(model)  # type: ignore[arg-type]
    assert len(steps) == tour.MAX_STEPS == 10 and len(tour.steps(None)) == 9
    last = steps[-1]
    hybrid, every = 2048 * (3 * 32768 + 15 * 512), 2048 * 18 * 32768
    assert hybrid == calculate(find_preset("gemma-3-270m", load_presets()),
                               MemoryRequest(seq_len=32768, kv_dtype="fp32")).kv_bytes
    assert "15 of its 18 layers are sliding" in last.text and "3 (layers 5, 11, 17) are global" in last.text
    assert f"**{fmt_bytes(hybrid)}**" in last.text and f"**{fmt_bytes(every)}** (5.6× more)" in last.text
    assert "MQA" in last.text and last.points_at == ("view_metrics",)
