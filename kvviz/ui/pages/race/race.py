"""Cache vs no cache: a live race of the three modes, its charts, an N sweep, static vs concat bytes."""
from __future__ import annotations

import time
from typing import Any

import streamlit as st

from kvviz import KVVizError, LoadedModel, Run
from kvviz.charts import perf as pc
from kvviz.engine.generation.flops import weight_bytes
from kvviz.units import fmt_bytes
from kvviz.engine.core.loop import GenerationStream
from kvviz.measure.sweeps import Request, compare_outputs, iter_race, sweep_ns, sweep_total_time
from kvviz.measure.sweeps import start as start_stream
from kvviz.measure import doubts
from kvviz.measure.stats import MODE_LABELS, MODES, Sample, aggregate, fits_by_series, race_explanation, speedup_table
from kvviz.measure.measuring import BusyWindow
from kvviz.measure.race_record import RaceRecord
from kvviz.ui.common.busy_notes import acquire_or_warn, busy_note
from kvviz.ui.common.measuring_page import page_model, prompt_ids, results_key, where
from kvviz.ui.common.session_probes import estimator, machine_probe
from kvviz.ui.common.sweep_driver import SweepState, drive, time_left
from kvviz.measure.sizing import Estimator, pick_ns, pick_race_tokens
from kvviz.ui.common.plain_text import md_plain
from kvviz.ui.settings import ENGINES, Settings
from kvviz.ui.common.figs import show
from kvviz.ui.state import session

SETTLE_WAIT_S = 10.0  # how long a script run waits for an interrupted race to store its runs
LIVE_REDRAW_S = 0.2  # live latency chart: about 5 redraws a second; the text updates every token
OUT_HEIGHT = 150  # px per output box: long runs scroll inside it instead of pushing the charts down

INTRO = (
    "One click generates the same continuation three times: with the **static** KV cache (preallocated, "
    "written in place), the **concat** cache (grows by `torch.cat`) and **no cache** (re-runs the whole "
    "sequence every step). Same prompt, seed and sampling, run one after another so the timings stay clean. "
    "The text must come out identical; the work does not."
)


def page() -> None:
    got = page_model("Cache vs no cache", INTRO)
    if got is None:
        return
    s, model = got
    race_state = SweepState("race_status")
    sweep_state = SweepState("race_sweep_status")
    race_state.settle()
    sweep_state.settle()
    busy_note()
    _race(s, model, race_state)
    st.divider()
    _sweep(s, model, sweep_state)


# --- the race ---------------------------------------------------------------------------------

def _request(s: Settings, model: LoadedModel, n_new: int) -> Request:
    ids, text = prompt_ids(s, model)
    return Request(prompt_ids=(ids,), max_new_tokens=n_new, prompt=text, backend=s.engine, sampling=s.sampling())


def shown(text: str) -> str:
    """Plain text for the output boxes: control characters (an untrained model emits plenty) as
    <0xNN>, the tokenizer's own notation, instead of invisible or tofu glyphs; newlines and tabs stay."""
    return "".join(f"<0x{ord(c):02X}>" if (ord(c) < 32 and c not in "\n\t") or ord(c) == 127 else c
                   for c in text) or " "


def _sampling_text(s: Settings) -> str:
    if s.greedy:
        return "greedy"
    parts = [f"temperature {s.temperature:g}"]
    if s.top_k:
        parts.append(f"top-k {s.top_k}")
    if s.top_p:
        parts.append(f"top-p {s.top_p:g}")
    return ", ".join(parts) + f", seed {s.seed}"


def _race(s: Settings, model: LoadedModel, state: SweepState) -> None:
    st.subheader("The race")
    est = estimator(model, s.engine == "fast")
    n_prompt = len(prompt_ids(s, model)[0])
    n_new, shortened = _race_tokens(s, est, n_prompt)
    secs = est.race_s(n_prompt, n_new) if est is not None and n_prompt else None
    cost = f" · {est.here(secs)}" if est is not None and secs is not None else ""
    st.caption(f"{n_new} new tokens per mode, EOS ignored so every run generates {n_new} "
               f"tokens{shortened}{cost} · {_sampling_text(s)} · {where(model)} · engine: "
               f"{ENGINES[s.engine]}, for all three modes, so they compare like with like · prompt and "
               "settings come from the sidebar")
    with st.container(horizontal=True):
        # No help tooltips: a tooltip stays over the page after the click. The caption says it.
        start = st.button("Start the race", key="race_start", type="primary")
        st.button("Stop", key="race_stop")
        st.caption("Runs the static cache, the concat cache and no cache, one after another. Stop ends the race "
                   "after the current step and keeps what ran.")

    key = results_key("race_runs", model)
    cols = st.columns(3)
    slots: dict[str, tuple[Any, Any]] = {}
    for col, mode in zip(cols, MODES):
        with col:
            st.markdown(f"**{MODE_LABELS[mode]}**")
            slots[mode] = (st.empty(), st.container(key=f"race_out_{mode}").empty())
    progress = st.empty()  # the race's progress bar while it runs (always one element: the layout stays put)
    live_chart = st.empty()

    if start:
        _run_race(s, model, n_new, key, slots, (progress, live_chart), state, est)
    stored: RaceRecord | None = session.get(key)
    if stored and not stored.settled.wait(SETTLE_WAIT_S):
        # A Stop click started this script run on a new thread while the race's thread is still
        # finishing its current step; its partial runs land in `stored` when it does.
        st.info("Stopping: the race is finishing its current step…")
        st.rerun()
    if not stored or not stored.runs:
        tip = "Tip: 200+ new tokens (the sidebar's *Max new tokens*) make the no-cache slope obvious"
        if est is not None and n_prompt:
            tip += f" ({est.here(est.race_s(n_prompt, 200))} for 200)"
        st.info(f"Press **Start the race**. {tip}.")
        return
    if not start:
        for mode, run in stored.runs.items():
            status, text = slots[mode]
            status.caption(_status_line(run))
            text.code(shown(run.text), language=None, wrap_lines=True, height=OUT_HEIGHT)
    if state.status == "stopped" and not stored.complete:
        st.warning("The race was stopped: the charts show the steps that ran.")
    _results(model, stored)


def _race_tokens(s: Settings, est: Estimator | None, n_prompt: int) -> tuple[int, str]:
    """(new tokens per mode, the words that say why they are fewer than the sidebar's, or "").

    The sidebar's N is Generate's too; on a slow or busy machine its race (the no-cache mode's
    steps grow with every token) would take minutes. So the race runs the most tokens that finish in
    about a minute here, unless asked for all of them."""
    asked = s.max_new_tokens
    # The estimate moves as runs calibrate it (a machine probe after the first draw, say), and the
    # Start click reruns the page: the N the caption named is kept for the same inputs, so the race
    # runs the tokens it said it would.
    inputs = (s.model, s.device, s.dtype, s.engine, n_prompt, asked)
    held = session.get(session.RACE_TOKENS)
    if held is not None and held[0] == inputs:
        fit = held[1]
    else:
        fit = pick_race_tokens(est, n_prompt, asked) if est is not None and n_prompt else asked
        session.put(session.RACE_TOKENS, (inputs, fit))
    if fit >= asked:
        return asked, ""
    if st.checkbox(f"All {asked} of the sidebar's new tokens", key="race_all_n",
                   help=f"Race the sidebar's *Max new tokens* ({asked}) instead of the {fit} that finish in about a "
                        f"minute here: {est.here(est.race_s(n_prompt, asked)) if est is not None else ''}"):
        return asked, ""
    return fit, f" (of the sidebar's {asked}: what finishes in about a minute here)"


def _status_line(run: Run, running: bool = False) -> str:
    n = len(run.events)
    if not n:
        return "waiting…"
    tpot = run.median_tpot_ms
    reason = run.stop_reason or "done"
    head = "running" if running else ("done" if reason == "max_new_tokens" else reason)
    return (f"{head} · {n} tokens · total {run.total_ms / 1000:.2f} s · TTFT {run.ttft_ms:.1f} ms"
            + (f" · {tpot:.2f} ms/token (median)" if tpot else ""))


def _run_race(s: Settings, model: LoadedModel, n_new: int, key: str, slots: dict[str, tuple[Any, Any]],
              places: tuple[Any, Any], state: SweepState, est: Estimator | None) -> None:
    progress, live_chart = places
    req = _request(s, model, n_new)
    try:
        start_stream(model, req, "static")  # validates prompt and budget before any compute
    except KVVizError as e:
        st.error(md_plain(e))
        return
    lock = acquire_or_warn()
    if lock is None:
        return
    race_id = session.get(session.RACE_NEXT_ID, 0) + 1
    session.put(session.RACE_NEXT_ID, race_id)
    # Stored before the loop and only mutated after: a Stop click raises StopException at the next
    # Streamlit call, after which assigning to st.session_state raises again, but mutating works.
    # With fast reruns the click's script run starts at once on another thread, before this one
    # has unwound, so it waits on `settled` before reading the runs (as the Generate page does).
    record = RaceRecord(race_id)
    session.put(key, record)
    streams: dict[str, GenerationStream] = {}
    finished: set[str] = set()
    last_draw, draws = 0.0, 0
    state.begin()
    window = BusyWindow()
    t0 = time.monotonic()
    try:
        for tick in iter_race(model, req):
            status, text = slots[tick.mode]
            streams[tick.mode] = tick.stream
            if tick.event is None:
                finished.add(tick.mode)
                status.caption(_status_line(tick.run))
                continue
            text.code(shown(tick.stream.text), language=None, wrap_lines=True, height=OUT_HEIGHT)
            now = time.monotonic()
            if now - last_draw >= LIVE_REDRAW_S:
                run = tick.run
                status.caption(_status_line(run, running=True))
                so_far = {m: st_.run for m, st_ in streams.items()}
                draws += 1
                show(live_chart, pc.race_latency(so_far), key=f"race_live_{race_id}_{draws}")
                if est is not None:  # by estimated time: the no-cache tokens cost more and more
                    frac = est.race_fraction(req.prompt_len, req.max_new_tokens, tick.mode, len(tick.stream.events))
                    progress.progress(frac, text=f"Racing: {MODE_LABELS[tick.mode]}, {len(tick.stream.events)} of "
                                                 f"{req.max_new_tokens} tokens{time_left(now - t0, frac)}")
                last_draw = now
        state.end()
    finally:
        # Runs also when a Stop click interrupts the loop: keep what was measured.
        try:
            lock.release()
        finally:
            record.keep(streams, finished, window)
    live_chart.empty()
    progress.empty()
    machine_probe(model)  # for the explanation below; measured once per session


def _results(model: LoadedModel, stored: RaceRecord) -> None:
    runs: dict[str, Run] = stored.runs
    rid = stored.id
    agree = compare_outputs(runs)
    with st.container(key="race_verdict"):
        if agree.first_diff is None and not stored.complete:
            st.warning(f"Partial race (stopped): {agree.message}; nothing disagreed.", icon=":material/pause_circle:")
        elif agree.identical:
            st.success(f"Identical output: {agree.message}.", icon=":material/check_circle:")
        else:  # tokens differ, or a finished race has runs of different lengths
            st.error(f"BUG: the three modes do not agree. {agree.message}. Cached and uncached generation "
                     "must produce the same tokens; please report this with the prompt and settings.",
                     icon=":material/bug_report:")

    cols = st.columns(len(runs) + 1)
    for col, (mode, run) in zip(cols, runs.items()):
        col.metric(f"{MODE_LABELS[mode]}: total", f"{run.total_ms / 1000:.2f} s",
                   help="Sum of the measured step latencies (forward + sampling), synchronized on CUDA")
    if "static" in runs and "none" in runs and runs["static"].total_ms > 0:
        speed = runs["none"].total_ms / runs["static"].total_ms
        flop = runs["none"].total_flops / max(1, runs["static"].total_flops)
        cols[-1].metric("Speedup (static vs none)", f"{speed:.1f}×", f"FLOP ratio {flop:.1f}×", delta_color="off")

    a, b = st.columns(2)
    show(a, pc.race_latency(runs), key=f"race_latency_{rid}")
    show(b, pc.race_cumulative(runs), key=f"race_cumulative_{rid}")
    a, b = st.columns(2)
    show(a, pc.race_tokens(runs), key=f"race_tokens_{rid}")
    show(b, pc.race_flops(runs), key=f"race_flops_{rid}")
    a, b = st.columns([3, 2])
    show(a, pc.race_speedup(runs), key=f"race_speedup_{rid}")
    with b:
        st.markdown("**Why the measured speedup is not the FLOP ratio**")
        if "static" in runs and "none" in runs:
            probes = session.get(session.MACHINE_PROBES, {})
            probe = probes.get((str(model.device), model.dtype_name))
            nbytes = model.dtype.itemsize
            st.markdown(race_explanation(runs["static"], runs["none"], weight_bytes(model.config, nbytes), probe,
                                         busy=stored.busy))

    st.subheader("Static vs concat cache: what the bytes do")
    st.markdown(
        "The **static** cache allocates K/V buffers for the whole context up front and writes one column per "
        "step in place: O(T) bytes written. The **concat** cache holds exactly what is used, but every step "
        "`torch.cat` allocates a new tensor and copies the whole history: O(T²) bytes copied."
    )
    if "static" in runs and "concat" in runs and runs["static"].events and runs["concat"].events:
        ls, lc = runs["static"].events[-1], runs["concat"].events[-1]
        m = st.columns(4)
        m[0].metric("Static: allocated", fmt_bytes(ls.cache_bytes_allocated))
        m[1].metric("Concat: allocated", fmt_bytes(lc.cache_bytes_allocated))
        m[2].metric("Static: bytes written", fmt_bytes(ls.cache_bytes_copied))
        m[3].metric("Concat: bytes copied", fmt_bytes(lc.cache_bytes_copied),
                    f"{lc.cache_bytes_copied / max(1, ls.cache_bytes_copied):,.1f}× static", delta_color="off")
    a, b = st.columns(2)
    show(a, pc.cache_bytes(runs), key=f"race_bytes_{rid}")
    show(b, pc.cache_copied(runs), key=f"race_copied_{rid}")


# --- the sweep --------------------------------------------------------------------------------

def _sweep(s: Settings, model: LoadedModel, state: SweepState) -> None:
    st.subheader("Sweep: total time vs N")
    st.markdown(
        "Runs the static cache and no cache at several numbers of new tokens N, each repeated, and fits "
        "the slope of log(time) vs log(N) on the large-N points: about **1** means linear (the cache), "
        "about **2** quadratic (recomputing everything). Medians over repeats, min–max bars."
    )
    ids, _ = prompt_ids(s, model)
    options = sweep_ns(len(ids), model.config.block_size)
    if not ids or not options:
        st.warning("The sweep needs a prompt that leaves room for at least 32 new tokens in the context.")
        return
    est = estimator(model, s.engine == "fast")
    # Sized to this machine: the most Ns (smallest first) and repeats that finish in about a minute.
    default_ns, default_repeats = pick_ns(est, len(ids), options) if est is not None else (options[:3], 1)
    with st.container(horizontal=True, vertical_alignment="bottom"):
        ns = st.multiselect("New tokens N", options, default=default_ns, key="race_sweep_ns", width=420,
                            help="Bounded by the context: prompt + N must fit. The default is what finishes in "
                                 "about a minute on this machine; add larger N for a clearer slope")
        repeats = st.number_input("Repeats", 1, 10, default_repeats, key="race_sweep_repeats", width=140,
                                  help="Each point is the median of this many runs; bars show min–max")
        run_it = st.button("Run the sweep", key="race_sweep", type="primary")
        st.button("Stop", key="race_sweep_stop", help="Stop the sweep; the points measured so far are kept")
    if est is not None and ns:
        secs = est.total_time_sweep_s(len(ids), sorted(ns), int(repeats))
        st.caption(f"EOS ignored so every run generates its N tokens · {len(ns)} values of N × {int(repeats)} "
                   f"repeat{'s' if int(repeats) != 1 else ''} × 2 modes: {est.here(secs)}")

    key = results_key("race_sweep", model)
    charts = st.empty()
    if run_it and ns:
        req = Request(prompt_ids=(ids,), max_new_tokens=max(ns), backend=s.engine, sampling=s.sampling())
        lock = acquire_or_warn()
        if lock is None:
            return
        samples: list[Sample] = []
        session.put(key, samples)
        session.put(key + session.BUSY_SUFFIX, None)
        state.begin()
        window = BusyWindow()
        draws = [0]

        def redraw(store: list[Sample]) -> None:
            draws[0] += 1
            agg = aggregate(store, "total_ms")
            show(charts, pc.sweep_time(agg, {}, False, where(model)), key=f"race_sweep_live_{draws[0]}")

        try:
            drive(sweep_total_time(model, req, sorted(ns), int(repeats)), samples, "Measuring…", redraw)
            state.end()
        finally:
            lock.release()
            session.put(key + session.BUSY_SUFFIX, window.clause())
        charts.empty()
    samples = session.get(key)
    if not samples:
        return
    if state.status == "stopped":
        st.warning(f"The sweep was stopped after {len(samples)} runs; these are the points it measured.")
    _sweep_results(model, samples, session.get(key + session.BUSY_SUFFIX))


def _sweep_results(model: LoadedModel, samples: list[Sample], busy: str | None = None) -> None:
    agg = aggregate(samples, "total_ms")
    fits = fits_by_series(agg)
    sub = where(model)
    a, b = st.columns(2)
    show(a, pc.sweep_time(agg, fits, False, sub), key=f"race_sweep_lin_{len(samples)}")
    show(b, pc.sweep_time(agg, fits, True, sub), key=f"race_sweep_log_{len(samples)}")
    found = sweep_doubts(agg, fits, busy)
    if fits:
        parts = [f"**{MODE_LABELS.get(m, m)}**: slope {f.slope:.2f} (fitted on N = {f.x_min:.0f}…{f.x_max:.0f})"
                 for m, f in fits.items()]
        # The expectation and its cause only where the timings are not in doubt (the box below says why).
        why = "" if found else (" Expect ≈1 with the cache and ≈2 without, once N is large enough that fixed costs "
                                "stop dominating.")
        st.markdown("Fitted log-log slopes: " + " · ".join(parts) + "." + why)
    if found:
        with st.container(key="race_sweep_doubts"):
            st.warning(doubts.verdict(found), icon=":material/report:")
    table = speedup_table(agg)
    if len(table):
        st.dataframe(table, hide_index=True, key="race_sweep_table",
                     column_config={"speedup": st.column_config.NumberColumn(format="%.2f×")})


def sweep_doubts(agg: Any, fits: dict[str, Any], busy: str | None) -> list[str]:
    """What in the sweep contradicts its expected shape: a cached slope far from 1, recomputation
    steeper than quadratic, repeats far apart, a busy CPU (kvviz.measure.doubts)."""
    return doubts.sweep(doubts.cache_slopes(fits), [(agg, "repeats of the same N and mode")], busy)
