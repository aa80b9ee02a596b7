"""The Generate page: generate live, or step through a run one token at a time.

Flow (ARCHITECTURE.md): Settings -> ``iter_generate`` -> StepEvents appended to a Run -> the view
(``view.draw``) for the live loop, step mode and replay (``replay.py``, ``run.upto(step)``).

- The run view (stored or live) sits in one of two places that follow each other on the page
  (``_view_place``): a live run takes the one the stored view is not in and empties the other, so
  no greyed copy of the last run shows in or under the new one; the rerun after it draws the
  stored view over the live one, part by part (the live view is laid out as the stored view is).
- Live: the view's placeholders are created once and redrawn in place, paced by ``pacing.Pacer``:
  the live views may take a twentieth of the loop's time, the browser's drawing included where it
  slows the engine (text at most 10 times a second, numbers and charts once: what a small
  machine's browser can draw; all slower when several runs are live), each chart with a key
  unique to the run and the draw; the rerun after the loop draws the finished run in full. What
  the views cost is kept in ``run.meta["live_cost"]`` and said under the finished run.
- Any rerun during a live run (a Stop click, a changed control, or the browser reconnecting after
  its WebSocket dropped) interrupts it: with Streamlit's fast reruns the next script run starts
  at once on another thread, and this one raises at its next Streamlit call or session-state
  access, inside its ``finally`` too. So the loop *parks* its stream, suspended between two
  steps, in the run store's own dict (no session-state access), and the next script run, which
  knows what caused it, decides: Stop -> the run ends "stopped by the user"; Generate/Step -> it
  ends "replaced by a new run"; a changed setting -> it ends saying so; no click and the same
  settings (a reconnect) -> the same run *resumes* from where it was. A run never claims the user
  stopped it without a click.
- Step mode: the GenerationStream lives in session_state; each Step click advances one event.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import streamlit as st

from kvviz import KVVizError, LoadedModel, Run, StepEvent, iter_generate
from kvviz.engine.core.loop import GenerationStream
from kvviz.measure import threads
from kvviz.ui import present, tour
from kvviz.ui.pages.generate import chips
from kvviz.ui.common.budget import Shape, plan_capture
from kvviz.ui.pages.generate.pacing import Pacer
from kvviz.ui.common.busy_notes import busy_note
from kvviz.ui.common.plain_text import md_plain
from kvviz.ui.pages.generate.replay import stored_view
from kvviz.ui.settings import Settings
from kvviz.ui.state import persist, session
from kvviz.ui.state.model_cache import get_model
from kvviz.ui.state.run_store import RunStore, live_runs, run_store
from kvviz.ui.common.stepper import Stepper, close_iterator
from kvviz.ui.pages.generate.view import Slots, ViewOptions, draw, layout

# Redraw intervals (kvviz/ui/pages/generate/pacing.py) are for one live run; with N runs live in the process each
# is N times longer, so the server sends the browsers about what one run would (see run_store.LiveRuns).
# With more live runs than this in the process, charts wait for the end of the run (the text and
# numbers keep updating). Measured: ten browsers re-rendering four Plotly charts each stopped
# reading their sockets for over 30 s, and the server's keepalive dropped them (docs/load-test.md).
LIVE_CHARTS_MAX_RUNS = 3
STEPPER_KEY = session.STEPPER
VIEW_PLACE_KEY = session.VIEW_PLACE  # which of the run view's two places holds it (_view_place)
# A run interrupted by a rerun with no click (a reconnect) resumes within this many seconds; past
# it (the tab was closed, the page left and revisited much later) it ends, saying so.
RESUME_WINDOW_S = 120.0  # Streamlit's disconnectedSessionTTL default: the session outlives a drop that long


@dataclass
class Parked:
    """A live run interrupted between two steps, waiting for the next script run to resume or end it."""

    run_id: int
    stream: GenerationStream
    it: Iterator[StepEvent]
    meta: dict[str, Any]
    signature: tuple
    at: float  # time.monotonic() when parked
# Less empty space above the title, so the text, the numbers and the cache fit on one projected screen.
PAGE_CSS = '<style>[data-testid="stMainBlockContainer"]{padding-top:2.2rem}</style>'


# --- the page ------------------------------------------------------------------------------------

def page() -> None:
    settings: Settings = session.settings() or Settings()
    store = run_store()
    # A click (or a reconnect) during a live run starts this run at once, on another thread; let the
    # interrupted one park its stream first. It takes one step and one draw at most, but a step
    # under load can take seconds, and a resume needs the stream parked: wait up to 30 s.
    store.wait_live(timeout=30.0)
    chips.inject_css()
    st.html(PAGE_CSS)
    projecting = present.active()
    if projecting:  # the title shares the buttons' row
        c_title, c_buttons, c_info = st.columns([2.6, 5.4, 2.6], vertical_alignment="center")
        with c_title, st.container(key="page_title"):
            st.header("Watch the KV cache fill", anchor=False)
    else:
        with st.container(key="page_title"):
            st.header("Watch the KV cache fill, token by token", anchor=False)
        st.caption("Each step feeds the model, writes a K and a V column per layer into the cache, and attends over "
                   "every column so far. **Generate** (key G) runs live, **Stop** (X) ends a run at its next step, "
                   "**Step** (S) runs the prefill on the first press and one token per press after it; a changed "
                   "setting or Generate starts over.")

        c_buttons, c_info = st.columns([5.2, 4.2], vertical_alignment="center")
    # Each button as wide as its label and key (a fixed column cut them to "G…" and "S X" at 1366 px);
    # the row wraps instead. No help tooltips on these three: a tooltip stays over the page after a click.
    with c_buttons, st.container(horizontal=True, vertical_alignment="center", key="run_buttons"):
        generate = st.button("Generate", key="generate", type="primary", icon=":material/play_arrow:", shortcut="G")
        stop = st.button("Stop", key="stop", icon=":material/stop:", shortcut="X")
        step = st.button("Step", key="step", icon=":material/skip_next:", shortcut="S")
        runs_slot = st.empty() if projecting else None  # the run picker, drawn there by stored_view
        if not tour.current():
            tour.start_button()
    choice = threads.ensure()
    with c_info:
        if not projecting:  # a projector gets the cache, not the settings
            st.caption(_settings_line(settings))
        # Live speed suffers when others hold the cores; said beside the buttons, in one sentence.
        busy_note(free_cores=choice.spare_cores, short=True)
    asked = tour.card(_model_or_none(settings), settings.dtype)
    generate = generate or asked == "generate"
    step = step or asked == "step"

    stepper: Stepper | None = session.get(STEPPER_KEY)
    if stop and stepper is not None:
        _end_stepping(store, "stopped by the user")
    parked = _resolve_parked(store, settings, stop=stop, new_run=generate or step)
    msgs = Messages()
    _show_notice(store, msgs)
    model: LoadedModel | None = None
    started: tuple[GenerationStream, dict[str, Any]] | None = None  # a live run to begin: (stream, meta)
    if stop:
        pass  # never start anything on the Stop click, even if Generate's click is replayed with it
    elif parked is not None:
        model = parked.stream.model  # a reconnect: the same run goes on
    elif generate:
        _end_stepping(store, "replaced by a new run")
        model = _load(settings, msgs)
        started = _start(settings, model, msgs) if model is not None else None
    elif step:
        model = _load(settings, msgs)
        if model is not None:
            _step(settings, model, store, stepper, msgs)
    live = model is not None and (parked is not None or started is not None)
    place = _view_place(live)
    if live:
        assert model is not None
        _live(settings, model, store, place, started, parked)  # reruns when it has drawn
    else:
        with place:
            stored_view(store, runs_slot)


def _resolve_parked(store: RunStore, settings: Settings, stop: bool, new_run: bool) -> Parked | None:
    """End the parked run with the true reason and return None, or return it to be resumed.

    Only this script run knows why the last one was interrupted: a Stop click, a Generate/Step
    click, a changed setting, or none of these, which is the browser reconnecting (its rerun
    carries the same widget values).
    """
    parked: Parked | None = store.take("parked")
    if parked is None:
        return None
    n = len(parked.stream.events)
    if parked.stream.settle_end() is not None:  # interrupted on its last token: it ended by itself
        why, notice = "", ""  # (a Stop pressed while the end token was drawn stopped nothing)
    elif stop:
        why, notice = "stopped by the user", f"Stopped: run #{parked.run_id} is kept with the {n} tokens it had."
    elif new_run:
        why, notice = "replaced by a new run", ""
    elif parked.signature != _signature(settings):
        why = "ended when a setting changed"
        notice = (f"Run #{parked.run_id} ended after {n} tokens because a setting changed; it is kept. Press "
                  "Generate to run with the new settings.")
    elif time.monotonic() - parked.at > RESUME_WINDOW_S:
        why = "ended: the page was away too long to resume"
        notice = f"Run #{parked.run_id} was interrupted and not resumed within {RESUME_WINDOW_S:.0f} s; it is kept."
    else:
        return parked
    close_iterator(parked.it)
    run = parked.stream.run
    if run.stop_reason == "stopped":  # it did not end by itself: say why it ended
        run = run.finish("stopped", run.text, run.stop_string, why)
    store.put(parked.run_id, _with_meta(run, parked.meta))
    store.post("show", parked.run_id)
    if notice:
        store.post("notice", ("info", notice))
    return None


def _settings_line(s: Settings) -> str:
    sampling = "greedy" if s.greedy else f"T={s.temperature:g}" + (f", top-k {s.top_k}" if s.top_k else "") + (
        f", top-p {s.top_p:g}" if s.top_p else "") + f", seed {s.seed}"
    speed = f" · presenting at {s.speed_tps:g} tok/s" if s.speed_tps else ""
    return f"**{md_plain(s.model)}** · {s.cache_label} · {sampling} · {s.max_new_tokens} new tokens{speed}"


class Messages:
    """This script run's notices and input errors, in one place above the run view: always one
    element (an empty placeholder until something is said), so the view below keeps its place."""

    def __init__(self) -> None:
        self._slot = st.empty()
        self._box: Any = None

    def say(self, kind: str, text: str) -> None:
        """``kind``: "info", "warning" or "error" (a Streamlit alert)."""
        if self._box is None:
            self._box = self._slot.container()
        getattr(self._box, kind)(text)


def _view_place(live: bool) -> Any:
    """The run view's container, in one of two places that follow each other on the page.

    Streamlit keeps a block's children when another block takes its place, and greys them until the
    script run ends: a live run drawn where the stored view was showed the last run's text, numbers
    and charts inside and under the new one (and mounted its charts again as it began). So the
    stored view stays where it is, and a live run takes the other place and puts an empty element
    in this one, which drops the stored view at once; the rerun after a live run draws the stored
    view where the live one is, over it, part by part. Each place gets one delta per script run
    (two to one place, queued together, would go out as the second alone).
    """
    current = int(session.get(VIEW_PLACE_KEY, 0))
    use = 1 - current if live else current
    session.put(VIEW_PLACE_KEY, use)
    place: Any = None
    for i in (0, 1):
        if i == use:
            place = st.container(key=f"run_view_{i}")
        else:
            st.empty()
    return place


def _show_notice(store: RunStore, msgs: Messages) -> None:
    notice = store.take("notice")
    if notice:
        msgs.say(*notice)


def _model_or_none(settings: Settings) -> LoadedModel | None:
    """The sidebar's model (already loaded and cached), quietly: the tour quotes its shape."""
    try:
        return get_model(settings.model, settings.device, settings.dtype)
    except KVVizError:
        return None


def _load(settings: Settings, msgs: Messages) -> LoadedModel | None:
    try:
        return get_model(settings.model, settings.device, settings.dtype)
    except KVVizError as e:
        msgs.say("error", "The model cannot be loaded: " + md_plain(e))
        return None


def _shape(model: LoadedModel) -> Shape:
    c = model.config
    return Shape(c.n_layer, c.n_head, c.kv_heads, c.head_dim)


def _start(settings: Settings, model: LoadedModel, msgs: Messages
           ) -> tuple[GenerationStream, dict[str, Any]] | None:
    """A validated stream and its metadata, or None after saying why not (inputs stay as typed)."""
    kv_layer = min(max(int(persist.last("nb_layer", 0) or 0), 0), model.config.n_layer - 1)
    try:
        stream = iter_generate(model, **settings.generate_kwargs())  # tokenizes the prompt, once
        n_prompt = len(stream.prompt_rows[0])
        # Set before the first step: the loop reads the capture request once, when it starts.
        stream.capture, note = plan_capture(_shape(model), n_prompt, max(1, settings.max_new_tokens), kv_layer)
    except KVVizError as e:
        msgs.say("error", "Cannot generate: " + md_plain(e))
        return None
    meta: dict[str, Any] = {}
    if note:
        meta["capture_note"] = note
    return stream, meta


def _with_meta(run: Run, meta: dict[str, Any]) -> Run:
    return dataclasses.replace(run, meta={**run.meta, **meta})


# --- live ----------------------------------------------------------------------------------------

def _live(settings: Settings, model: LoadedModel, store: RunStore, place: Any,
          started: tuple[GenerationStream, dict[str, Any]] | None, resume: Parked | None = None) -> None:
    """Generate with live drawing in ``place``, store the run (park it when interrupted), then rerun
    to show it.

    ``started``: the (stream, meta) ``_start`` made; ``resume``: a parked run to go on with instead
    (same stream, same run id).
    """
    if resume is None:
        assert started is not None
        stream, meta = started
        run_id, it = store.new_id(), iter(stream)
        status = f"**Run #{run_id}: generating…** Stop ends it at the next step."
    else:
        stream, meta, run_id, it = resume.stream, resume.meta, resume.run_id, resume.it
        status = (f"**Run #{run_id}: generating…** (resumed at token {len(stream.events)} after the page "
                  "reconnected) Stop ends it at the next step.")
    slots, opts = _live_view(place, run_id, status, _shape(model))
    chips.render(stream.run, slots.output)  # the prompt's chips at once (resumed: the tokens so far), before the prefill
    error: Exception | None = None
    finished, draws, paused = False, 0, False  # paused: the charts, for the rest of this run (LIVE_CHARTS_MAX_RUNS)
    spare = threads.ensure().spare_cores  # none: the browser first draws the click's rerun on the engine's core
    waited = threads.wait_for_core() if spare == 0 and resume is None else 0.0
    t_loop = time.perf_counter()
    # Presentation pacing counts from the run's first token, also across a resume.
    t0 = t_loop - (len(stream.events) / settings.speed_tps if settings.speed_tps else 0.0)
    pacer = Pacer(t_loop, every_token=bool(settings.speed_tps), spare_cores=spare, waited_s=waited)
    engine_ms = 0.0  # this loop's forwards, as the events measured them
    store.begin_live(run_id)
    try:
        with live_runs() as live:
            for ev in it:
                engine_ms += ev.latency_ms
                now = time.perf_counter()
                load = max(1, live.count)
                if not paused and load > LIVE_CHARTS_MAX_RUNS:
                    # Paused until this run ends, not until the load drops: when the other runs end,
                    # their browsers render their final charts, the worst moment to resume ours.
                    paused = True
                    slots.notebook.caption(f"The charts are paused while {load} sessions generate on this server; "
                                           "they are drawn when this run ends. The text and numbers keep updating.")
                # The live views get a twentieth of the loop's time, counting the browser's drawing where it
                # slows the steps after a draw (one core), and charts at most once a second; intervals N
                # times longer with N live runs (ui/pages/generate/pacing.py).
                due = pacer.due(now, engine_ms / 1000, load, steps_left=stream.max_new_tokens - len(stream.events))
                chart_due = due.charts and not paused
                if due.text:
                    run = _with_meta(stream.run, meta)  # stored before the draw a Stop click interrupts
                    store.put(run_id, run, trim=False)  # (between draws, the finally below stores it)
                    numbers = due.numbers or paused
                    draw(run, slots, opts, f"{run_id}-{draws}", charts_too=chart_due, numbers_too=numbers)
                    draws += chart_due
                    pacer.drew(now, time.perf_counter(), chart_due, numbers)
                if settings.speed_tps:  # presentation speed: hold each token until its slot in time
                    _pause(t0 + (ev.step + 1) / settings.speed_tps - time.perf_counter())
            finished = True
            meta["live_cost"] = pacer.finish(time.perf_counter(), engine_ms / 1000).as_dict()
            # The last token's text and numbers; the rerun below draws the finished run's charts
            # once (drawing them here too would double the heaviest render).
            draw(_with_meta(stream.run, meta), slots, opts, f"{run_id}-final", charts_too=False, numbers_too=True)
    except (RuntimeError, KVVizError) as e:
        # A device failure (a GPU lost or out of memory, a RuntimeError) or a broken model (NaN
        # logits, a KVVizError saying where): keep what was generated.
        error = e
    finally:
        # Also runs when a rerun interrupts the loop. Streamlit then makes every st.* call and
        # session-state access raise here, so record everything in the store's own dict.
        try:
            run = _with_meta(stream.run, meta)
            n = len(run.events)
            if error is not None:
                close_iterator(it)
                what = str(error) if isinstance(error, KVVizError) else f"the device failed: {error}"
                run = run.finish("error", run.text, note=f"ended after {n} tokens: {what}")
                store.post("notice", ("error", f"Generation failed after {n} tokens: {md_plain(what)}. The "
                                               f"partial run #{run_id} is kept."))
            elif not finished and stream.stop_reason is None:
                # Interrupted between two steps: park the suspended stream; the next script run
                # knows why (a click, a changed setting, a reconnect) and ends or resumes it.
                store.post("parked", Parked(run_id, stream, it, meta, _signature(settings), time.monotonic()))
            else:
                close_iterator(it)
            store.put(run_id, run)
            store.post("show", run_id)
        finally:
            store.end_live()
    st.rerun()  # draw the stored run, with the replay controls (the layout above is already on screen)


def _live_view(place: Any, run_id: int, status: str, shape: Shape) -> tuple[Slots, ViewOptions]:
    """The live view in ``place``, laid out as the stored view is (``replay.stored_view``: the run
    picker's row, then the replay fragment's container with the done marker and the view, the
    replay row between the numbers and the charts), so the rerun after the run draws each part over
    its live self, in place.
    """
    with place:
        if not present.active():  # presenting, the picker sits in the top row
            st.empty()  # the run picker's row
        with st.container():  # the replay fragment's container
            with st.container(key=f"run_live_{run_id}"):
                st.markdown(status)
            return layout((shape.n_layer, shape.n_head, shape.n_kv_head), replay=st.empty)


def _pause(seconds: float) -> None:
    """Sleep in short slices, each ending at a point where a Stop click can interrupt the script."""
    end = time.perf_counter() + min(max(seconds, 0.0), 2.0)
    while (left := end - time.perf_counter()) > 0:
        time.sleep(min(left, 0.05))
        session.settings()  # a session-state read is a Streamlit interrupt point


# --- step mode -----------------------------------------------------------------------------------

def _signature(settings: Settings) -> tuple:
    return dataclasses.astuple(dataclasses.replace(settings, speed_tps=None))


def _step(settings: Settings, model: LoadedModel, store: RunStore, stepper: Stepper | None,
          msgs: Messages) -> None:
    if stepper is None or stepper.finished or stepper.signature != _signature(settings):
        _end_stepping(store)
        started = _start(settings, model, msgs)
        if started is None:
            return
        stream, meta = started
        stepper = Stepper(store.new_id(), stream, meta, _signature(settings))
        session.put(STEPPER_KEY, stepper)
    try:
        ev = stepper.advance()
        if ev is not None and (len(stepper.stream.events) >= stepper.stream.max_new_tokens
                               or ev.token_id == model.tokenizer.eos_token_id):
            stepper.advance()  # the run is over: let the stream record why (no compute happens)
    except (RuntimeError, KVVizError) as e:
        what = str(e) if isinstance(e, KVVizError) else f"the device failed: {e}"
        _end_stepping(store, what, reason="error")
        msgs.say("error", "Generation failed: " + md_plain(what) + ". The partial run is kept.")
        return
    if stepper.finished:
        _end_stepping(store)
        return
    store.put(stepper.run_id, _with_meta(stepper.stream.run, stepper.meta), stepping=True)
    store.post("show", stepper.run_id)


def _end_stepping(store: RunStore, why: str = "ended when a setting changed", reason: str = "stopped") -> None:
    """Finish the step-mode run (if any): close its stream and keep its run as it ended.

    A run that had not ended by itself gets ``reason`` and the note ``why``.
    """
    stepper: Stepper | None = session.pop(STEPPER_KEY, None)
    if stepper is None:
        return
    stepper.stream.settle_end()  # a step that drew the last token ended the run by itself
    stepper.close()
    if stepper.stream.events:
        run = stepper.stream.run
        if run.stop_reason == "stopped":  # it did not end by itself: say why it ended
            run = run.finish(reason, run.text, run.stop_string, why)
        store.put(stepper.run_id, _with_meta(run, stepper.meta), stepping=False)
        store.post("show", stepper.run_id)


