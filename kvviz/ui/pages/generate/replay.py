"""Stored runs: the run picker, JSON/CSV export, and replay (slider, Play) of the shown run.

Replay runs in a fragment, so scrubbing or a Play tick redraws the view alone. The replay
position lives in ``POS_KEY``, not in the slider: while playing there is no slider at all (the
browser would send its older slider value with every tick and undo the step).
"""
from __future__ import annotations

from typing import Any

import streamlit as st

from kvviz import Run
from kvviz.engine.generation.events import to_dataframe
from kvviz.ui import present
from kvviz.ui.state import persist, session
from kvviz.ui.pages.generate.pacing import LiveCost
from kvviz.ui.common.plain_text import md_plain
from kvviz.ui.state.run_store import RunStore, StoredRun
from kvviz.ui.pages.generate.view import draw, layout

REPLAY_SPEEDS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0)
PLAYING_KEY = session.REPLAY_PLAYING
REPLAY_FOR_KEY = session.REPLAY_FOR
INTERVAL_KEY = session.REPLAY_INTERVAL  # the timer the fragment was created with
POS_KEY = session.REPLAY_POS  # the step shown by replay (the slider follows it, Play advances it)
TICK_KEY = session.REPLAY_TICK  # (run id, playing) of the fragment's previous run: only ticks advance
TICKS_LEFT_KEY = session.REPLAY_TICKS_LEFT  # what one Play may still advance: playback ends whatever arrives
MAX_EXPORT_CAPTURES = 16 * 2**20  # offer a JSON with captures only when it stays a sane download


def stored_view(store: RunStore, runs_slot: Any = None) -> None:
    """The picker and the replay of the chosen run (or the empty view before any run).

    ``runs_slot``: where the presentation layout puts the picker and the exports (one button in
    the page's top row), so the views move up.
    """
    runs = store.runs()
    if not runs:
        slots, opts = layout(None)
        draw(Run(model="", device="", dtype="fp32", use_cache=True, cache_kind="static", sampling="",
                 prompt_ids=(), prompt_text="", max_new_tokens=0), slots, opts, "empty")
        return
    ids = [r.id for r in runs]
    show = store.take("show")
    if show in ids:
        session.put("run_pick", show)
    pick = persist.keep_index("run_pick", ids[-1], ids)
    labels = {r.id: r.label for r in runs}  # a plain dict: format_func may run outside the script
    projecting = present.active() and runs_slot is not None
    if projecting:  # one button in the top row: the picker and the exports behind it
        c_pick = c_export = runs_slot.popover(f"Run #{session.get('run_pick', ids[-1])}",
                                              icon=":material/history:", width="content")
    else:
        c_pick, c_json, c_caps, c_csv = st.columns([4.2, 1, 1.4, 1], vertical_alignment="bottom")
    chosen = c_pick.selectbox("Run", ids, index=pick, key="run_pick", format_func=labels.get,
                              help="The last runs of this session (newest last). Pick one to replay or compare.")
    persist.remember("run_pick")
    entry = store.get(chosen)
    assert entry is not None
    if projecting:
        with c_export:
            _export_buttons(entry, st, st, st)
    else:
        _export_buttons(entry, c_json, c_caps, c_csv)

    n = len(entry.run.events)
    if session.get(REPLAY_FOR_KEY) != (entry.id, n):
        # A new or grown run: show its last step, and stop any playback of the previous one.
        session.put(REPLAY_FOR_KEY, (entry.id, n))
        session.put(POS_KEY, max(0, n - 1))
        session.put(PLAYING_KEY, False)
    interval = _replay_interval(n)
    session.put(INTERVAL_KEY, interval)
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
    if not session.get(PLAYING_KEY) or n < 2:
        return None
    return 1.0 / float(persist.last("replay_speed", 2.0))


def _toggle_play(n: int) -> None:
    """Button callback: runs before the script, so the label and the timer agree on this run."""
    playing = not session.get(PLAYING_KEY, False)
    if playing and int(session.get(POS_KEY, n - 1)) >= n - 1:
        session.put(POS_KEY, 0)  # at the end: play from the start
    session.put(PLAYING_KEY, playing)
    # A budget of ticks, not just "stop at the last step": the browser's timer sends its widget
    # states with every tick, and a stale one must never keep a playback going for ever.
    session.put(TICKS_LEFT_KEY, n - 1 - int(session.get(POS_KEY, 0)))


def _replay_fragment(entry: StoredRun) -> None:
    """Everything below the run picker; reruns alone when the slider moves or Play ticks."""
    run, n = entry.run, len(entry.run.events)
    if session.get(PLAYING_KEY) and n > 1 and session.get(TICK_KEY) == (entry.id, True):
        # A timer tick (the fragment's previous run was playing this run too): one step on.
        nxt = int(session.get(POS_KEY, 0)) + 1
        left = int(session.get(TICKS_LEFT_KEY, n)) - 1
        session.put(POS_KEY, min(nxt, n - 1))
        session.put(TICKS_LEFT_KEY, left)
        if nxt >= n - 1 or left <= 0:
            session.put(PLAYING_KEY, False)
    session.put(TICK_KEY, (entry.id, bool(session.get(PLAYING_KEY))))
    if _replay_interval(n) != session.get(INTERVAL_KEY):
        st.rerun()  # play, pause, a new speed or the end: a full rerun re-creates the fragment's timer
    step = min(int(session.get(POS_KEY, n - 1)), max(0, n - 1))
    _status(entry, step)
    slots, opts = layout((run.n_layer, run.n_head, run.n_kv_head), replay=lambda: _replay_row(entry))
    # One key per run, not per step. A stepped run's charts are kept in the browser and redrawn in
    # place on each Step press (kept_chart.py); st.plotly_chart's would be rebuilt (a new figure is a
    # new element in Streamlit 1.67 whatever its key).
    draw(run.upto(step), slots, opts, f"{entry.id}-replay", kept=entry.stepping)


def _replay_row(entry: StoredRun) -> None:
    """Play/pause, speed and the step slider, in one row between the numbers and the charts."""
    n = len(entry.run.events)
    if n < 2 or entry.stepping:  # step mode moves with the Step button
        return
    playing = bool(session.get(PLAYING_KEY))
    c_play, c_speed, c_step = st.columns([1.1, 1.7, 5.2], vertical_alignment="bottom")
    c_play.button("Pause" if playing else "Play", key="replay_play", width="stretch", on_click=_toggle_play,
                  args=(n,), icon=":material/pause:" if playing else ":material/replay:",
                  help="Animate the replay from the current step (from the start when at the end).")
    kept = persist.keep("replay_speed", 2.0, options=REPLAY_SPEEDS)
    c_speed.select_slider("Replay speed (tokens/s)", REPLAY_SPEEDS, value=kept, key="replay_speed",
                          format_func=lambda v: f"{v:g}", help="How fast Play advances the replay.")
    persist.remember("replay_speed")
    pos = min(int(session.get(POS_KEY, n - 1)), n - 1)
    if playing:
        # No slider while playing: the browser would send its (older) slider value with every tick.
        c_step.progress(pos / (n - 1), text=f"Playing: step {pos} of {n - 1}")
        return
    session.put("replay_step", pos)
    c_step.slider("Replay: show the state after step", 0, n - 1, key="replay_step", on_change=_on_scrub,
                  help="Scrub through the run: every view shows the state after this step (0 = the prefill).")


def _on_scrub() -> None:
    if session.get(PLAYING_KEY):
        # No slider is drawn while playing, so a value now is a stale one the browser sent with a
        # timer tick: taking it would jump the playback back, again and again.
        return
    session.put(POS_KEY, int(session.read("replay_step")))


def _status(entry: StoredRun, step: int) -> None:
    """One line about the shown run; its keyed container is the done marker browser tests wait on."""
    run = entry.run
    n = len(run.events)
    if entry.stepping:
        text = (f"Run #{entry.id}: step mode, {n} of {run.max_new_tokens} steps so far. Press Step for the "
                "next token.")
    else:
        # A stopped run's note says who or what stopped it ("stopped by the user" only after a
        # Stop click); a run never blames the user for a reconnect or a server-side end.
        eos = md_plain(run.events[-1].token_text) if run.events else "EOS"  # model text: plain
        reason = {"max_new_tokens": "reached max_new_tokens",
                  "eos": f"the model emitted its end token {eos} (EOS), as a finished answer does",
                  "stop_string": "hit a stop string", "stopped": md_plain(run.note or "stopped"),
                  "error": "ended by an error"}.get(run.stop_reason or "", str(run.stop_reason))
        text = f"Run #{entry.id} finished: {n} tokens, {reason}."
        if step < n - 1:
            text += f" Replaying step {step} of {n - 1}."
    cost = run.meta.get("live_cost")
    live = LiveCost(**cost).sentence(n) if isinstance(cost, dict) and not entry.stepping else ""
    if present.active():
        live = ""  # one line on a projector: the speed figures stay in the normal layout
    notes = [x for x in (run.note if run.stop_reason == "error" else "", run.meta.get("capture_note", ""), live,
                         "Its captures were dropped to keep the session small: replay shows text and timings."
                         if entry.captures_dropped else "") if x]
    marker = f"run_done_{entry.id}" if not entry.stepping else f"run_stepping_{entry.id}"
    with st.container(key=marker):
        st.markdown(f"**{text}**")
        for note in notes:
            st.caption(md_plain(note))  # an error text or a model name: plain text
