"""Bad input in the app (AppTest): bad model folders, plain-text messages, NaN runs, interrupted runs.

One unreadable folder is listed as unreadable with its reason while every generation page keeps
working; names and reasons reach Markdown only through ``md_plain``; a model that produces NaN says
so (never "the device failed"); and a live run interrupted by a rerun ends with the true reason, or
resumes when the rerun was a reconnect.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from streamlit.testing.v1 import AppTest

from kvviz import LoadedModel, iter_generate
from kvviz.engine.loading.save import save_model
from kvviz.ui.pages.generate import live
from kvviz.ui.common.plain_text import unescape
from kvviz.ui.settings import Settings
from kvviz.ui.state.run_store import LiveRuns, RunStore

TIMEOUT = 120
GOOD = dict(model_type="kvviz-gpt", vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=32)
MARKDOWN_NAME = "[Session expired](evil.example) **x** :red[y] $z$"  # a folder name is user text too


def _pages_app() -> None:
    """The sidebar and one generation page, chosen by session state (app.py's shape, per page)."""
    import streamlit as st

    from kvviz.ui.pages.batching import batching
    from kvviz.ui.pages.generate import live
    from kvviz.ui.pages.prefill import prefill
    from kvviz.ui.pages.race import race
    from kvviz.ui.sidebar import render_sidebar

    st.session_state["settings"] = render_sidebar()
    pages = {"live": live.page, "race": race.page, "prefill": prefill.page, "batching": batching.page}
    pages[st.session_state.get("_test_page", "live")]()


def _folder(root: Path, name: str, config: Any = None, weights: Path | None = None) -> None:
    f = root / name
    f.mkdir(parents=True)
    if weights is not None:
        os.link(weights, f / "model.safetensors")
    if config is not None:
        (f / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory, make_model: Callable[..., LoadedModel]) -> Path:
    folder = tmp_path_factory.mktemp("w") / "good"
    save_model(make_model().model, folder)
    return folder / "model.safetensors"


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weights: Path) -> Path:
    """A models/ folder with one good model and every kind of bad one, side by side."""
    root = tmp_path / "models"
    root.mkdir()
    _folder(root, "good", (weights.parent / "config.json").read_text(), weights)
    _folder(root, "eos_abc", {**GOOD, "eos_token_id": "abc"})
    _folder(root, "deep", "[" * 100_000 + "]" * 100_000)
    _folder(root, "bigint", '{"model_type": "kvviz-gpt", "n_layer": ' + "9" * 5000 + "}")
    _folder(root, "million_layers", {**GOOD, "n_layer": 1_000_000}, weights)
    _folder(root, "lying", {**GOOD, "n_layer": 3}, weights)
    _folder(root, "fifo")
    os.mkfifo(root / "fifo" / "config.json")
    _folder(root, "dev_zero")
    os.symlink("/dev/zero", root / "dev_zero" / "config.json")
    _folder(root, MARKDOWN_NAME, {**GOOD, "bias": "no"})
    monkeypatch.setenv("KVVIZ_MODELS_DIR", str(root))
    monkeypatch.setenv("KVVIZ_DEFAULT_MODEL", "random:tiny")
    return root


BAD = {"eos_abc": "eos_token_id must be a token id", "deep": "nested 100,000 levels deep",
       "bigint": "5,000-digit integer", "million_layers": "n_layer is 1,000,000",
       "lying": "does not match its config.json", "fifo": "config.json is a FIFO",
       "dev_zero": "config.json is a character device", MARKDOWN_NAME: "bias must be true or false"}


def _app(page: str = "live") -> AppTest:
    at = AppTest.from_function(_pages_app, default_timeout=TIMEOUT)
    at.session_state["_test_page"] = page
    return at.run()


def _clean(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def test_bad_folders_are_listed_as_unreadable_with_their_reason(models: Path) -> None:
    at = _app()
    _clean(at)
    from kvviz.ui.state.model_menu import choice_label

    labels = at.selectbox(key="model").options  # AppTest shows the format_func labels
    for name, reason in BAD.items():
        label = choice_label(f"folder:{name}")
        if name == "lying":  # its config reads; the header mismatch shows once it is loaded
            assert "unreadable" not in label
            continue
        assert label.startswith(f"folder:{name} (unreadable: ") and reason[:20] in label, label
        assert label in labels
    assert "folder:good (" in " ".join(labels) and "unreadable" not in choice_label("folder:good")


@pytest.mark.parametrize("name", list(BAD))
def test_choosing_a_bad_folder_shows_its_reason_and_the_page_works(models: Path, name: str) -> None:
    at = _app()
    at.selectbox(key="model").set_value(f"folder:{name}").run()
    _clean(at)
    shown = [unescape(e.value) for e in at.error]
    assert any("cannot be loaded" in e and BAD[name] in e for e in shown), shown
    at.button(key="generate").click().run()
    _clean(at)
    at.selectbox(key="model").set_value("folder:good").run()
    at.number_input(key="max_new_tokens").set_value(4)
    at.button(key="generate").click().run()
    _clean(at)
    assert "Run #1 finished" in "\n".join(m.value for m in at.markdown)


@pytest.mark.parametrize("page", ["race", "prefill", "batching"])
def test_the_other_generation_pages_survive_a_bad_folder(models: Path, page: str) -> None:
    at = _app(page)
    _clean(at)
    at.selectbox(key="model").set_value("folder:deep").run()
    _clean(at)
    assert any("nested 100,000 levels deep" in unescape(e.value) for e in at.error)


def test_folder_names_and_reasons_reach_markdown_as_plain_text(models: Path) -> None:
    at = _app()
    at.selectbox(key="model").set_value(f"folder:{MARKDOWN_NAME}").run()
    _clean(at)
    (err,) = [e.value for e in at.error if "cannot be loaded" in e.value]
    assert MARKDOWN_NAME in unescape(err)
    for raw in ("[Session expired](", "**x**", ":red[", "$z$"):
        assert raw not in err, err  # every punctuation character arrives backslash-escaped
    assert "\\[Session expired\\]\\(evil\\.example\\)" in err


def test_a_model_that_produces_nan_says_so_and_keeps_the_run(models: Path, weights: Path) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(weights))
    sd["transformer.h.1.ln_2.weight"].fill_(3e38)  # finite weights; float32 overflows in layer 1
    _folder(models, "overflow", (weights.parent / "config.json").read_text())
    save_file(sd, str(models / "overflow" / "model.safetensors"))
    at = _app()
    at.selectbox(key="model").set_value("folder:overflow").run()
    at.number_input(key="max_new_tokens").set_value(4)
    at.button(key="generate").click().run()
    _clean(at)
    errors = [unescape(e.value) for e in at.error]
    assert any("the model produced NaN at step 0, first in layer 1 (transformer.h.1.ln_2)" in e for e in errors), errors
    assert not any("device" in e for e in errors), errors
    (entry,) = at.session_state["kvviz_runs_live"]["runs"]
    assert entry.run.stop_reason == "error" and "NaN" in entry.run.note and "device" not in entry.run.note
    markdown = "\n".join(m.value for m in at.markdown)
    assert "ended by an error" in markdown


# --- a live run interrupted by a rerun ------------------------------------------------------------

def _parked(model: LoadedModel, settings: Settings, store: RunStore, tokens: int = 3,
            age_s: float = 0.0) -> live.Parked:
    stream = iter_generate(model, **settings.generate_kwargs())
    it = iter(stream)
    for _ in range(tokens):
        next(it)
    run_id = store.new_id()
    store.put(run_id, stream.run)
    parked = live.Parked(run_id, stream, it, {}, live._signature(settings), time.monotonic() - age_s)
    store.post("parked", parked)
    return parked


@pytest.mark.parametrize("click, change, age_s, note", [
    ("stop", {}, 0.0, "stopped by the user"),
    ("generate", {}, 0.0, "replaced by a new run"),
    (None, {"temperature": 0.5, "greedy": False}, 0.0, "ended when a setting changed"),
    (None, {}, live.RESUME_WINDOW_S + 1, "ended: the page was away too long to resume"),
])
def test_an_interrupted_run_ends_with_the_true_reason(small_model: LoadedModel, click: str | None,
                                                      change: dict[str, Any], age_s: float, note: str) -> None:
    settings = Settings(model="random:tiny", prompt="Hi", max_new_tokens=20)
    store = RunStore({})
    parked = _parked(small_model, settings, store, age_s=age_s)
    out = live._resolve_parked(store, Settings(**{**settings.__dict__, **change}), stop=click == "stop",
                               new_run=click == "generate")
    assert out is None and store.take("parked") is None
    run = store.get(parked.run_id).run
    assert (run.stop_reason, run.note, len(run.events)) == ("stopped", note, 3)
    assert parked.it.gi_frame is None  # the stream was closed: its cache is freed


@pytest.mark.parametrize("click", ["stop", "generate", None])
def test_a_run_interrupted_on_its_last_token_ended_by_itself(small_model: LoadedModel, click: str | None) -> None:
    """Interrupted while its last token is drawn (all max_new_tokens made; the loop notes that only
    when asked for the next event), a run reports how it ended, not "stopped by the user"."""
    settings = Settings(model="random:tiny", prompt="Hi", max_new_tokens=4)
    store = RunStore({})
    parked = _parked(small_model, settings, store, tokens=4)
    assert parked.stream.run.stop_reason == "stopped"  # what it said before: nobody asked for a fifth
    assert live._resolve_parked(store, settings, stop=click == "stop", new_run=click == "generate") is None
    run = store.get(parked.run_id).run
    assert (run.stop_reason, run.note, len(run.events)) == ("max_new_tokens", "", 4)
    assert store.take("notice") is None  # no "Stopped: run #1 is kept with..."


def test_a_stop_after_the_answer_reached_its_end_token_reports_eos(smollm2: LoadedModel) -> None:
    """Issue 36: a Stop pressed after the answer reached <|im_end|> reported "stopped by the user"."""
    settings = Settings(model="smollm2", prompt="What is the capital of France?", chat=True, max_new_tokens=64)
    store = RunStore({})
    stream = iter_generate(smollm2, **settings.generate_kwargs())
    it = iter(stream)
    for ev in it:  # up to and including the end token, and not one call further
        if ev.token_id == smollm2.tokenizer.eos_token_id:
            break
    run_id = store.new_id()
    store.put(run_id, stream.run)
    store.post("parked", live.Parked(run_id, stream, it, {}, live._signature(settings), time.monotonic()))
    assert live._resolve_parked(store, settings, stop=True, new_run=False) is None
    run = store.get(run_id).run
    assert run.stop_reason == "eos" and run.text.endswith("Paris.<|im_end|>"), (run.stop_reason, run.text)
    assert "stopped" not in run.note and store.take("notice") is None


def test_a_rerun_without_a_click_resumes_the_same_run(small_model: LoadedModel) -> None:
    """A reconnect reruns the script with the same widget values: the run goes on, token for token."""
    settings = Settings(model="random:tiny", prompt="Hi", max_new_tokens=12)
    store = RunStore({})
    parked = _parked(small_model, settings, store, tokens=5)
    out = live._resolve_parked(store, settings, stop=False, new_run=False)
    assert out is parked
    rest = list(out.it)
    run = out.stream.run
    assert len(rest) == 7 and run.stop_reason == "max_new_tokens"
    whole = iter_generate(small_model, **settings.generate_kwargs())
    assert [e.token_id for e in whole] == run.generated_ids


def test_the_live_run_counter_counts_nested_runs() -> None:
    runs = LiveRuns()
    with runs:
        with runs:
            assert runs.count == 2
        assert runs.count == 1
    assert runs.count == 0


def test_token_labels_reach_plotly_escaped(small_model: LoadedModel) -> None:
    """Plotly reads a subset of HTML in labels: a token "<a href=...>" must stay text (a BPE
    tokenizer makes such multi-character tokens), and a byte token's "<0x0A>" must not vanish."""
    from kvviz import Capture, generate
    from kvviz.charts import run_charts as charts
    from kvviz.charts.tokens import plotly_text, short_label

    assert short_label("<a href=x>") == "&lt;a·href…" and plotly_text("<0x0A>") == "&lt;0x0A&gt;"
    run = generate(small_model, prompt="<b>x</b>&", max_new_tokens=3, capture=Capture(attention=True, kv_norms=True))
    for fig in (charts.cache_notebook(run, "layer", 0), charts.attention_bars(run, 0, 0)):
        layout = fig.to_plotly_json()["layout"]
        ticks = [t for k, ax in layout.items() if k.startswith("xaxis") for t in (ax.get("ticktext") or ())]
        assert "&lt;" in ticks and "&gt;" in ticks and "&amp;" in ticks and not {"<", ">", "&"} & set(ticks), ticks
    bars = charts.attention_bars(run, 0, 0)
    hover = [str(c[0]) for c in bars.data[0].customdata]
    assert "&lt;" in hover and "<" not in hover
