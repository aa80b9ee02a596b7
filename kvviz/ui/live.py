"""The Generate page: generate live, or step through a run one token at a time.

Flow (ARCHITECTURE.md): Settings -> ``iter_generate`` -> StepEvents appended to a Run -> the view
(``view.draw``) for the live loop, step mode and replay (``replay.py``, ``run.upto(step)``).

- Live: the view's placeholders are created once and redrawn in place; the text on every token,
  numbers and charts every ``CHART_INTERVAL_S`` or slower, and always on the last step, each chart
  with a key unique to the run and the draw.
- Stop (or any click) during a live run: with Streamlit's fast reruns the next script run starts
  at once on another thread, and this one raises at its next Streamlit call or session-state
  access, inside its ``finally`` too. So the loop records the partial run in the run store's own
  dict (``RunStore.put``/``post``, no session-state access) and the next run waits for it.
- Step mode: the GenerationStream lives in session_state; each Step click advances one event.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import streamlit as st

from kvviz import KVVizError, LoadedModel, Run, iter_generate
from kvviz.ui import chips, persist
from kvviz.ui.budget import Shape, plan_capture
from kvviz.ui.replay import stored_view
from kvviz.ui.settings import Settings
from kvviz.ui.state import RunStore, get_model, run_store
from kvviz.ui.stepper import Stepper, close_iterator
from kvviz.ui.view import draw, layout

CHART_INTERVAL_S = 0.15  # ~6-7 chart redraws per second while generating
STEPPER_KEY = "_kvviz_stepper"
# Less empty space above the title, so the text, the numbers and the cache fit on one projected screen.
PAGE_CSS = '<style>[data-testid="stMainBlockContainer"]{padding-top:2.2rem}</style>'


# --- the page ------------------------------------------------------------------------------------

def page() -> None:
    settings: Settings = st.session_state.get("settings") or Settings()
    store = run_store()
    # A click during a live run starts this run at once, on another thread; let the interrupted one
    # record its partial run first (it takes one step at most).
    store.wait_live()
    chips.inject_css()
    st.html(PAGE_CSS)
    st.header("Watch the KV cache fill, token by token", anchor=False)
    st.caption("Each step feeds the model, writes a K and a V column per layer into the cache, and attends over "
               "every column so far. Generate, or Step through it one token at a time.")

    c_gen, c_stop, c_step, c_info = st.columns([1.2, 1, 1, 4.6], vertical_alignment="center")
    generate = c_gen.button("Generate", key="generate", type="primary", icon=":material/play_arrow:",
                            width="stretch", help="Run the prompt with the sidebar's settings and watch it live.")
    stop = c_stop.button("Stop", key="stop", icon=":material/stop:", width="stretch",
                         help="End the run at the next step; the partial run is kept and marked stopped.")
    step = c_step.button("Step", key="step", icon=":material/skip_next:", width="stretch",
                         help="Step mode: the first click runs the prefill, each next click one token. "
                              "Change a setting or press Generate to start over.")
    c_info.caption(_settings_line(settings))

    stepper: Stepper | None = st.session_state.get(STEPPER_KEY)
    if stop and stepper is not None:
        _end_stepping(store)  # a live run was already ended by this click's rerun (see _live's finally)
    _show_notice(store)
    if stop:
        pass  # never start anything on the Stop click, even if Generate's click is replayed with it
    elif generate:
        _end_stepping(store)
        model = _load(settings)
        if model is not None:
            _live(settings, model, store)  # reruns when it has drawn; returns after an input error
    elif step:
        model = _load(settings)
        if model is not None:
            _step(settings, model, store, stepper)
    stored_view(store)


def _settings_line(s: Settings) -> str:
    sampling = "greedy" if s.greedy else f"T={s.temperature:g}" + (f", top-k {s.top_k}" if s.top_k else "") + (
        f", top-p {s.top_p:g}" if s.top_p else "") + f", seed {s.seed}"
    speed = f" · presenting at {s.speed_tps:g} tok/s" if s.speed_tps else ""
    return f"**{s.model}** · {s.cache_label} · {sampling} · {s.max_new_tokens} new tokens{speed}"


def _show_notice(store: RunStore) -> None:
    notice = store.take("notice")
    if notice:
        kind, text = notice
        getattr(st, kind)(text)


def _load(settings: Settings) -> LoadedModel | None:
    try:
        return get_model(settings.model, settings.device, settings.dtype)
    except KVVizError as e:
        st.error(f"The model cannot be loaded: {e}")
        return None


def _shape(model: LoadedModel) -> Shape:
    c = model.config
    return Shape(c.n_layer, c.n_head, c.kv_heads, c.head_dim)


def _start(settings: Settings, model: LoadedModel):  # type: ignore[no-untyped-def]
    """A validated stream and its metadata, or None after showing why not (inputs stay as typed)."""
    kv_layer = min(max(int(persist.last("nb_layer", 0) or 0), 0), model.config.n_layer - 1)
    try:
        stream = iter_generate(model, **settings.generate_kwargs())  # tokenizes the prompt, once
        n_prompt = len(stream.prompt_rows[0])
        # Set before the first step: the loop reads the capture request once, when it starts.
        stream.capture, note = plan_capture(_shape(model), n_prompt, max(1, settings.max_new_tokens), kv_layer)
    except KVVizError as e:
        st.error(f"Cannot generate: {e}")
        return None
    meta: dict[str, Any] = {}
    if note:
        meta["capture_note"] = note
    return stream, meta


def _with_meta(run: Run, meta: dict[str, Any]) -> Run:
    return dataclasses.replace(run, meta={**run.meta, **meta})


# --- live ----------------------------------------------------------------------------------------

def _live(settings: Settings, model: LoadedModel, store: RunStore) -> None:
    """Generate with live drawing, store the run (also when interrupted), then rerun to show it."""
    started = _start(settings, model)
    if started is None:
        return
    stream, meta = started
    run_id = store.new_id()
    with st.container(key=f"run_live_{run_id}"):
        st.markdown(f"**Run #{run_id}: generating…** Stop ends it at the next step.")
    shape = _shape(model)
    slots, opts = layout((shape.n_layer, shape.n_head, shape.n_kv_head))
    it = iter(stream)
    error: Exception | None = None
    last_chart, gap = 0.0, CHART_INTERVAL_S
    draws = 0
    t0 = time.perf_counter()
    store.begin_live(run_id)
    try:
        for ev in it:
            run = _with_meta(stream.run, meta)
            store.put(run_id, run, trim=False)  # before drawing: a Stop click interrupts the draw
            now = time.perf_counter()
            chart_due = now - last_chart >= gap
            draw(run, slots, opts, f"{run_id}-{draws}", charts_too=chart_due)
            if chart_due:
                # Charts at 5-10 Hz, but never more than a third of the loop's time: slow charts
                # (a big model's attention map) must not slow the generation they show.
                last_chart, draws = time.perf_counter(), draws + 1
                gap = max(CHART_INTERVAL_S, 2.0 * (last_chart - now))
            if settings.speed_tps:  # presentation speed: hold each token until its slot in time
                _pause(t0 + (ev.step + 1) / settings.speed_tps - time.perf_counter())
        draw(_with_meta(stream.run, meta), slots, opts, f"{run_id}-final")
    except (RuntimeError, KVVizError) as e:
        # The device failed under us (a GPU lost or out of memory): keep what was generated.
        error = e
    finally:
        # Also runs when a click interrupts the loop. Streamlit then makes every st.* call and
        # session-state access raise here, so record everything in the store's own dict.
        try:
            close_iterator(it)
            run = _with_meta(stream.run, meta)
            if error is not None:
                run = run.finish("error", run.text, note=f"the device failed after {len(run.events)} tokens: {error}")
                store.post("notice", ("error", f"Generation failed after {len(run.events)} tokens: {error}. The "
                                               f"partial run #{run_id} is kept; pick another device or model in "
                                               "the sidebar and try again."))
            elif run.stop_reason == "stopped":
                store.post("notice", ("info", f"Stopped: run #{run_id} is kept with the {len(run.events)} tokens "
                                              "it had (a click or a changed control ends a live run)."))
            store.put(run_id, run)
            store.post("show", run_id)
        finally:
            store.end_live()
    st.rerun()  # draw the stored run, with the replay controls (the layout above is already on screen)


def _pause(seconds: float) -> None:
    """Sleep in short slices, each ending at a point where a Stop click can interrupt the script."""
    end = time.perf_counter() + min(max(seconds, 0.0), 2.0)
    while (left := end - time.perf_counter()) > 0:
        time.sleep(min(left, 0.05))
        st.session_state.get("settings")  # a session-state read is a Streamlit interrupt point


# --- step mode -----------------------------------------------------------------------------------

def _signature(settings: Settings) -> tuple:
    return dataclasses.astuple(dataclasses.replace(settings, speed_tps=None))


def _step(settings: Settings, model: LoadedModel, store: RunStore, stepper: Stepper | None) -> None:
    if stepper is None or stepper.finished or stepper.signature != _signature(settings):
        _end_stepping(store)
        started = _start(settings, model)
        if started is None:
            return
        stream, meta = started
        stepper = Stepper(store.new_id(), stream, meta, _signature(settings))
        st.session_state[STEPPER_KEY] = stepper
    try:
        ev = stepper.advance()
        if ev is not None and (len(stepper.stream.events) >= stepper.stream.max_new_tokens
                               or ev.token_id == model.tokenizer.eos_token_id):
            stepper.advance()  # the run is over: let the stream record why (no compute happens)
    except (RuntimeError, KVVizError) as e:
        _end_stepping(store)
        st.error(f"Generation failed: {e}. The partial run is kept.")
        return
    if stepper.finished:
        _end_stepping(store)
        return
    store.put(stepper.run_id, _with_meta(stepper.stream.run, stepper.meta), stepping=True)
    store.post("show", stepper.run_id)


def _end_stepping(store: RunStore) -> None:
    """Finish the step-mode run (if any): close its stream and keep its run as it ended."""
    stepper: Stepper | None = st.session_state.pop(STEPPER_KEY, None)
    if stepper is None:
        return
    stepper.close()
    if stepper.stream.events:  # an unfinished stream reports itself as stopped
        store.put(stepper.run_id, _with_meta(stepper.stream.run, stepper.meta), stepping=False)
        store.post("show", stepper.run_id)


