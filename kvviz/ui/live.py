"""The Generate page: watch generation live, step through it, replay it, export it.

Flow (ARCHITECTURE.md): Settings -> ``iter_generate`` -> StepEvents appended to a Run -> the
same drawing function for the live loop, step mode and replay (``run.upto(step)``).

- Live: the view's placeholders are created once and redrawn in place; the text on every token,
  metrics and charts at most every ``CHART_INTERVAL_S`` and always on the last step, each chart
  with a key unique to the run and the draw. A click (Stop, or any widget) interrupts the script
  at its next Streamlit call; ``try/finally`` then stores the partial run, reported as stopped.
- Step mode: the GenerationStream lives in session_state; each Step click advances one event.
- Replay: a fragment redraws the stored run at the slider's step; Play advances it on a timer.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import streamlit as st

from kvviz import KVVizError, LoadedModel, Run, charts, iter_generate
from kvviz.events import to_dataframe
from kvviz.ui import chips, metrics, persist
from kvviz.ui.budget import Shape, plan_capture
from kvviz.ui.settings import Settings
from kvviz.ui.state import RunStore, StoredRun, get_model, run_store
from kvviz.ui.stepper import Stepper, close_iterator

CHART_INTERVAL_S = 0.15  # ~6-7 chart redraws per second while generating
REPLAY_SPEEDS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0)
STEPPER_KEY = "_kvviz_stepper"
PLAYING_KEY = "_kvviz_playing"
REPLAY_FOR_KEY = "_kvviz_replay_for"
INTERVAL_KEY = "_kvviz_replay_interval"  # the timer the fragment was created with
POS_KEY = "_kvviz_replay_pos"  # the step shown by replay (the slider follows it, Play advances it)
TICK_KEY = "_kvviz_replay_tick"  # (run id, playing) of the fragment's previous run: only ticks advance
# Less empty space above the title, so the text, the numbers and the cache fit on one projected screen.
PAGE_CSS = '<style>[data-testid="stMainBlockContainer"]{padding-top:2.2rem}</style>'
VIEWS = {"layer": "All layers", "head": "Heads of one layer", "values": "Raw values of one head"}
MAX_EXPORT_CAPTURES = 16 * 2**20  # offer a JSON with captures only when it stays a sane download


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
    _stored_view(store)


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
        n_prompt = len(model.tokenizer.encode(settings.prompt)) if settings.prompt and model.has_tokenizer else 1
        capture, note = plan_capture(_shape(model), n_prompt, max(1, settings.max_new_tokens), kv_layer)
        stream = iter_generate(model, capture=capture, **settings.generate_kwargs())
    except KVVizError as e:
        st.error(f"Cannot generate: {e}")
        return None
    meta = {"prompt_tokens": [model.tokenizer.token_display(i) for i in stream.run.prompt_ids]}
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
    slots, opts = _layout((shape.n_layer, shape.n_head, shape.n_kv_head))
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
            _draw(run, slots, opts, f"{run_id}-{draws}", charts_too=chart_due)
            if chart_due:
                # Charts at 5-10 Hz, but never more than a third of the loop's time: slow charts
                # (a big model's attention map) must not slow the generation they show.
                last_chart, draws = time.perf_counter(), draws + 1
                gap = max(CHART_INTERVAL_S, 2.0 * (last_chart - now))
            if settings.speed_tps:  # presentation speed: hold each token until its slot in time
                _pause(t0 + (ev.step + 1) / settings.speed_tps - time.perf_counter())
        _draw(_with_meta(stream.run, meta), slots, opts, f"{run_id}-final")
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


def _layout(shape: tuple[int, int, int] | None, replay: Any = None) -> tuple[Slots, ViewOptions]:
    """The view, top to bottom: text, numbers, [replay row], cache, attention, time.

    ``shape`` (n_layer, n_head, n_kv_head) sizes the selectors; None draws the view without them.
    """
    with st.container(key="output", border=True):
        out = st.empty()
    m = st.empty()
    if replay is not None:
        replay()
    opts = ViewOptions()
    st.subheader("What the cache holds", anchor=False)
    if shape is not None:
        opts = _cache_controls(shape[0], shape[2])
    nb = st.empty()
    st.subheader("What the newest token attends to", anchor=False)
    at = st.empty()
    if shape is not None:
        opts = dataclasses.replace(opts, **_attention_controls(shape[0], shape[1]))
    bars = st.empty()
    st.subheader("How long each step takes", anchor=False)
    lat = st.empty()
    return Slots(out, m, nb, at, bars, lat), opts


def _draw(run: Run, slots: Slots, opts: ViewOptions, key: str, charts_too: bool = True) -> None:
    """Draw the run as it stands after its last event into the placeholders."""
    with slots.output.container():
        chips.render(run)
    if not charts_too:
        return
    with slots.metrics.container():
        metrics.render(run)
    if opts.nb_view == "values":
        fig = charts.cache_values(run, opts.nb_kv, opts.nb_head, wanted_layer=opts.nb_layer)
    else:
        fig = charts.cache_notebook(run, opts.nb_view, opts.nb_layer)
    config = {"displaylogo": False, "toImageButtonOptions": {"scale": 2}}
    slots.notebook.plotly_chart(fig, key=f"notebook-{key}", config=config, theme=None)
    slots.attention.plotly_chart(charts.attention_heatmap(run, (opts.attn_layer, opts.attn_head)),
                                 key=f"attention-{key}", config=config, theme=None)
    slots.bars.plotly_chart(charts.attention_bars(run, opts.attn_layer, opts.attn_head), key=f"bars-{key}",
                            config=config, theme=None)
    slots.latency.plotly_chart(charts.latency_chart(run), key=f"latency-{key}", config=config, theme=None)


def _cache_controls(n_layer: int, n_kv_head: int) -> ViewOptions:
    """Selectors of the cache chart (kept across pages like the sidebar's)."""
    layers, kv_heads = list(range(n_layer)), list(range(n_kv_head))
    c1, c2, c3, c4 = st.columns([3.2, 1, 1, 1.1], vertical_alignment="bottom")
    persist.keep("nb_view", "layer", options=tuple(VIEWS))
    view = c1.radio("Cache view", tuple(VIEWS), key="nb_view", format_func=VIEWS.get, horizontal=True,
                    help="All layers: one row per layer, colour = length (L2 norm) of its K or V vector at each "
                         "position. Heads: the K/V heads of one layer. Raw: the numbers themselves, one head.")
    persist.keep("nb_layer", 0, options=layers)
    layer = c2.selectbox("Layer", layers, key="nb_layer", help="The layer of the heads and raw views. Its raw K/V "
                         "values are recorded while generating (the other layers keep norms only).")
    persist.keep("nb_head", 0, options=kv_heads)
    head = c3.selectbox("K/V head", kv_heads, key="nb_head", help="The head of the raw view.")
    persist.keep("nb_kv", "K", options=("K", "V"))
    kv = c4.radio("Raw values of", ("K", "V"), key="nb_kv", horizontal=True, help="Raw view: keys or values.")
    persist.remember("nb_view", "nb_layer", "nb_head", "nb_kv")
    return ViewOptions(nb_view=str(view), nb_layer=int(layer), nb_head=int(head), nb_kv=str(kv))


def _attention_controls(n_layer: int, n_head: int) -> dict[str, int]:
    layers, heads = list(range(n_layer)), list(range(n_head))
    c1, c2, _ = st.columns([1, 1, 4.3], vertical_alignment="bottom")
    persist.keep("attn_layer", 0, options=layers)
    a_layer = c1.selectbox("Attention layer", layers, key="attn_layer",
                           help="The layer of the bar chart below (outlined in red in the heatmap).")
    persist.keep("attn_head", 0, options=heads)
    a_head = c2.selectbox("Attention head", heads, key="attn_head", help="The head of the bar chart below.")
    persist.remember("attn_layer", "attn_head")
    return {"attn_layer": int(a_layer), "attn_head": int(a_head)}


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


# --- stored runs: picker, replay, export -------------------------------------------------------

def _stored_view(store: RunStore) -> None:
    runs = store.runs()
    if not runs:
        slots, opts = _layout(None)
        _draw(Run(model="", device="", dtype="fp32", use_cache=True, cache_kind="static", sampling="",
                  prompt_ids=(), prompt_text="", max_new_tokens=0), slots, opts, "empty")
        return
    ids = [r.id for r in runs]
    show = store.take("show")
    if show in ids:
        st.session_state["run_pick"] = show
    persist.keep("run_pick", ids[-1], options=ids)
    c_pick, c_json, c_caps, c_csv = st.columns([4.2, 1, 1.4, 1], vertical_alignment="bottom")
    labels = {r.id: r.label for r in runs}  # a plain dict: format_func may run outside the script
    chosen = c_pick.selectbox("Run", ids, key="run_pick", format_func=labels.get,
                              help="The last runs of this session (newest last). Pick one to replay or compare.")
    persist.remember("run_pick")
    entry = store.get(chosen)
    assert entry is not None
    _export_buttons(entry, c_json, c_caps, c_csv)

    n = len(entry.run.events)
    if st.session_state.get(REPLAY_FOR_KEY) != (entry.id, n):
        # A new or grown run: show its last step, and stop any playback of the previous one.
        st.session_state[REPLAY_FOR_KEY] = (entry.id, n)
        st.session_state[POS_KEY] = max(0, n - 1)
        st.session_state[PLAYING_KEY] = False
    interval = _replay_interval(n)
    st.session_state[INTERVAL_KEY] = interval
    st.fragment(run_every=interval)(_replay_fragment)(entry)


def _export_buttons(entry: StoredRun, c_json: Any, c_caps: Any, c_csv: Any) -> None:
    run, rid = entry.run, entry.id
    c_json.download_button("JSON", data=lambda: run.to_json(), file_name=f"kvviz-run-{rid}.json",
                           mime="application/json", key="export_json", on_click="ignore", width="stretch",
                           icon=":material/download:",
                           help="The run: settings, tokens, text and the per-step timings and bytes.")
    small = 0 < run.capture_nbytes() <= MAX_EXPORT_CAPTURES
    c_caps.download_button("JSON + captures", data=lambda: run.to_json(captures=True),
                           file_name=f"kvviz-run-{rid}-captures.json", mime="application/json",
                           key="export_json_captures", on_click="ignore", width="stretch", disabled=not small,
                           icon=":material/download:",
                           help="The same, plus the attention rows and K/V norms and values of every step "
                                "(offered up to 16 MiB of captures).")
    c_csv.download_button("CSV", data=lambda: to_dataframe(run).to_csv(index=False),
                          file_name=f"kvviz-run-{rid}-steps.csv", mime="text/csv", key="export_csv",
                          on_click="ignore", width="stretch", icon=":material/download:",
                          help="One row per step (pandas table).")


def _replay_interval(n: int) -> float | None:
    """Seconds between replay ticks while playing, else None (no timer)."""
    if not st.session_state.get(PLAYING_KEY) or n < 2:
        return None
    return 1.0 / float(persist.last("replay_speed", 2.0))


def _toggle_play(n: int) -> None:
    """Button callback: runs before the script, so the label and the timer agree on this run."""
    playing = not st.session_state.get(PLAYING_KEY, False)
    if playing and int(st.session_state.get(POS_KEY, n - 1)) >= n - 1:
        st.session_state[POS_KEY] = 0  # at the end: play from the start
    st.session_state[PLAYING_KEY] = playing


def _replay_fragment(entry: StoredRun) -> None:
    """Everything below the run picker; reruns alone when the slider moves or Play ticks."""
    run, n = entry.run, len(entry.run.events)
    if st.session_state.get(PLAYING_KEY) and n > 1 and st.session_state.get(TICK_KEY) == (entry.id, True):
        # A timer tick (the fragment's previous run was playing this run too): one step on.
        nxt = int(st.session_state.get(POS_KEY, 0)) + 1
        st.session_state[POS_KEY] = min(nxt, n - 1)
        if nxt >= n - 1:
            st.session_state[PLAYING_KEY] = False
    st.session_state[TICK_KEY] = (entry.id, bool(st.session_state.get(PLAYING_KEY)))
    if _replay_interval(n) != st.session_state.get(INTERVAL_KEY):
        st.rerun()  # play, pause, a new speed or the end: a full rerun re-creates the fragment's timer
    step = min(int(st.session_state.get(POS_KEY, n - 1)), max(0, n - 1))
    _status(entry, step)
    slots, opts = _layout((run.n_layer, run.n_head, run.n_kv_head), replay=lambda: _replay_row(entry))
    # One key per run, not per step: scrubbing and Play update the same charts instead of new ones.
    _draw(run.upto(step), slots, opts, f"{entry.id}-replay")


def _replay_row(entry: StoredRun) -> None:
    """Play/pause, speed and the step slider, in one row between the numbers and the charts."""
    n = len(entry.run.events)
    if n < 2 or entry.stepping:  # step mode moves with the Step button
        return
    playing = bool(st.session_state.get(PLAYING_KEY))
    c_play, c_speed, c_step = st.columns([1.1, 1.7, 5.2], vertical_alignment="bottom")
    c_play.button("Pause" if playing else "Play", key="replay_play", width="stretch", on_click=_toggle_play,
                  args=(n,), icon=":material/pause:" if playing else ":material/replay:",
                  help="Animate the replay from the current step (from the start when at the end).")
    persist.keep("replay_speed", 2.0, options=REPLAY_SPEEDS)
    c_speed.select_slider("Replay speed (tokens/s)", REPLAY_SPEEDS, key="replay_speed",
                          format_func=lambda v: f"{v:g}", help="How fast Play advances the replay.")
    persist.remember("replay_speed")
    pos = min(int(st.session_state.get(POS_KEY, n - 1)), n - 1)
    if playing:
        # No slider while playing: the browser would send its (older) slider value with every tick.
        c_step.progress(pos / (n - 1), text=f"Playing: step {pos} of {n - 1}")
        return
    st.session_state["replay_step"] = pos
    c_step.slider("Replay: show the state after step", 0, n - 1, key="replay_step", on_change=_on_scrub,
                  help="Scrub through the run: every view shows the state after this step (0 = the prefill).")


def _on_scrub() -> None:
    st.session_state[POS_KEY] = int(st.session_state["replay_step"])


def _status(entry: StoredRun, step: int) -> None:
    """One line about the shown run; its keyed container is the done marker browser tests wait on."""
    run = entry.run
    n = len(run.events)
    if entry.stepping:
        text = (f"Run #{entry.id}: step mode, {n} of {run.max_new_tokens} steps so far. Press Step for the "
                "next token.")
    else:
        reason = {"max_new_tokens": "reached max_new_tokens", "eos": "the model emitted end-of-text",
                  "stop_string": "hit a stop string", "stopped": "stopped by the user",
                  "error": "ended by an error"}.get(run.stop_reason or "", str(run.stop_reason))
        text = f"Run #{entry.id} finished: {n} tokens, {reason}."
        if step < n - 1:
            text += f" Replaying step {step} of {n - 1}."
    notes = [x for x in (run.note if run.stop_reason == "error" else "", run.meta.get("capture_note", ""),
                         "Its captures were dropped to keep the session small: replay shows text and timings."
                         if entry.captures_dropped else "") if x]
    marker = f"run_done_{entry.id}" if not entry.stepping else f"run_stepping_{entry.id}"
    with st.container(key=marker):
        st.markdown(f"**{text}**")
        for note in notes:
            st.caption(note)
