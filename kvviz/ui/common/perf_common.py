"""What the three measurement pages (race, prefill/decode, batching) share.

- ``page_model``: the sidebar's Settings and the shared model, or a clear message.
- ``measurement_lock``: one lock per server, so measurements from several browser sessions
  never overlap (overlapping runs would time each other).
- ``drive``: runs a measurement generator with a progress bar, storing every sample in the
  session as it arrives, so a Stop click (which interrupts the script) keeps what was measured.
- ``machine_probe``: the roofline probe, measured once per session per (device, dtype).
- ``estimator``: the model timed once per session (``measure.sizing``), so every page can size its
  defaults to finish in about a minute here and say what a bigger setting would cost.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import streamlit as st

from kvviz import KVVizError, LoadedModel
from kvviz.engine.generation.request import resolve_chat
from kvviz.measure import threads
from kvviz.measure.cpu_load import busy_during, busy_warning, load_average, read_cpu
from kvviz.measure.probe import probe_machine
from kvviz.measure.sizing import Estimator, about, calibrate, contention
from kvviz.measure.stats import MachineProbe, Sample
from kvviz.ui.common.plain_text import md_plain
from kvviz.ui.settings import Settings
from kvviz.ui.state import session
from kvviz.ui.state.model_cache import get_model

REDRAW_S = 0.5  # sweeps redraw their live chart at most twice a second


def settings() -> Settings:
    s = session.settings()
    return s if isinstance(s, Settings) else Settings()


def prompt_ids(s: Settings, model: LoadedModel) -> tuple[tuple[int, ...], str]:
    """The sidebar's prompt as the Generate page feeds it, and its text: with Chat on, the question laid out
    by the model's chat template (an instruct model fed the bare question answers with its end token
    at once, and a race of one token shows nothing). () when there is no prompt or no tokenizer."""
    if not s.prompt or not model.has_tokenizer:
        return (), s.prompt
    if s.chat:
        try:
            rows, text = resolve_chat(model, s.prompt, None, None)
            return tuple(rows[0]), text
        except KVVizError:
            pass  # no template or too long: the plain prompt, which the request's own checks then judge
    return tuple(model.tokenizer.encode(s.prompt)), s.prompt


def page_model(title: str, intro: str) -> tuple[Settings, LoadedModel] | None:
    """A measuring page's start: its title and introduction, then the sidebar's settings and model;
    None (with an error shown under the introduction) when the model will not load."""
    st.title(title)
    st.markdown(intro)
    s = settings()
    try:
        return s, get_model(s.model, s.device, s.dtype)
    except KVVizError as e:
        st.error("This model cannot be loaded: " + md_plain(e))
        return None


def where(model: LoadedModel) -> str:
    """Named on every measurement: which model, on which device, in which dtype."""
    return f"{md_plain(model.name)} · {model.device} · {model.dtype_name}"  # a folder name is plain text


def results_key(prefix: str, model: LoadedModel) -> str:
    """Session key for one page's results of one (model, device, dtype)."""
    return f"{prefix}::{model.name}::{model.device}::{model.dtype_name}"


@st.cache_resource
def measurement_lock() -> threading.Lock:
    return threading.Lock()


def acquire_or_warn(timeout_s: float = 2.0) -> threading.Lock | None:
    """The measurement lock, or None after telling the user that another session is measuring
    (two sessions timing at once would slow each other down and spoil both results)."""
    lock = measurement_lock()
    if not lock.acquire(timeout=timeout_s):
        st.warning("another browser session is measuring right now; try again when it has finished, "
                   "so the two do not slow each other down")
        return None
    return lock


def busy_note(free_cores: float | None = None, short: bool = False) -> None:
    """The busy-CPU warning, as a caption (see ``cpu_load.busy_warning`` for ``free_cores``, ``short``)."""
    note = busy_warning(free_cores=free_cores, short=short)
    # Always one element, warning or not: a page whose elements shift between two runs shows the
    # previous run's stale elements in the wrong places while it redraws (the race's Stop button
    # had "no cache" beside it).
    slot = st.empty()
    if note:
        slot.caption(":material/warning: " + note)


class BusyWindow:
    """Other processes' CPU use over one measurement: start it before, ``clause()`` after."""

    def __init__(self) -> None:
        self.start = read_cpu()

    def clause(self) -> str | None:
        """``cpu_load.busy_during``'s clause (None when nothing competed, or it was too short to tell)."""
        choice = threads.ensure()
        return busy_during(self.start, read_cpu(), choice.cores, choice.threads)


def drive(samples: Iterator[Sample], store: list[Sample], progress_text: str,
          redraw: Callable[[list[Sample]], None] | None = None) -> bool:
    """Run a sweep to the end, appending each sample to ``store`` (a list in session_state).

    Returns True when the sweep finished. A Stop click interrupts this at the next Streamlit
    call; the samples already appended stay in the session and the page shows them as stopped.
    """
    bar = st.progress(0.0, text=progress_text)
    last, t0 = 0.0, time.monotonic()
    for s in samples:
        store.append(s)
        frac = s.done / s.total if s.total else 1.0
        bar.progress(min(1.0, frac), text=f"{progress_text} {s.done}/{s.total}{time_left(time.monotonic() - t0, frac)}")
        now = time.monotonic()
        if redraw is not None and (now - last >= REDRAW_S or s.done == s.total):
            redraw(store)
            last = now
    bar.empty()
    return True


def time_left(elapsed_s: float, frac: float) -> str:
    """" · about 40 s left", from the pace so far (nothing until a first piece of the work is done)."""
    if not 0 < frac < 1:
        return ""
    return f" · {about(elapsed_s * (1 - frac) / frac)} left"


def estimator(model: LoadedModel, fast: bool = True) -> Estimator | None:
    """This model timed on this machine (``measure.sizing.calibrate``), once per session and engine;
    None while another session holds the measurement lock (the page keeps its smallest defaults)."""
    cals: dict[Any, Any] = session.setdefault(session.SIZING_CALIBRATION, {})
    key = (model.name, str(model.device), model.dtype_name, bool(fast))
    if key not in cals:
        lock = measurement_lock()
        if not lock.acquire(timeout=2.0):
            return None
        try:
            with st.spinner("Timing this model once, to size the defaults to this machine (a second or two)…"):
                cal = calibrate(model, fast)
            # What the timing was slowed by: the load average right after it (it counts this run too).
            cals[key] = dataclasses.replace(cal, contention=_contention_now()[0])
        finally:
            lock.release()
    # Scaled by how much busier the machine is now than it was then (measure/sizing.py).
    now, others = _contention_now()
    return Estimator(cals[key], model.config, now, others)


def _contention_now() -> tuple[float, float | None]:
    """(``sizing.contention`` now, the load average it comes from, which the busy note names too)."""
    load = load_average()
    return contention(load, threads.ensure().cores), load


def machine_probe(model: LoadedModel, again: bool = False) -> MachineProbe:
    """Peak FLOP/s and bandwidth of this device in the model's dtype, measured once per session
    (``again`` measures anew, e.g. once a competing job has finished)."""
    probes: dict[Any, MachineProbe] = session.setdefault(session.MACHINE_PROBES, {})
    key = (str(model.device), model.dtype_name)
    if again or key not in probes:
        with st.spinner("Measuring this machine's peak matmul FLOP/s and memory bandwidth (a second or two)…"):
            probes[key] = probe_machine(model.device, model.dtype)
    return probes[key]


class SweepState:
    """Running / stopped / done bookkeeping for one sweep, kept in session_state.

    A sweep marks itself running before it starts and done when it ends; if the page is drawn
    while the mark still says running, the sweep was interrupted (Stop or another widget).
    """

    def __init__(self, key: str) -> None:
        self.key = key

    @property
    def status(self) -> str | None:
        return session.get(self.key)

    def begin(self) -> None:
        session.put(self.key, "running")

    def end(self) -> None:
        session.put(self.key, "done")

    def settle(self) -> str | None:
        """On a fresh script run: a sweep still marked running was stopped."""
        if session.get(self.key) == "running":
            session.put(self.key, "stopped")
        return session.get(self.key)
