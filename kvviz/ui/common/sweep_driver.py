"""A sweep run from a page: ``drive`` (a progress bar, every sample stored in the session as it
arrives, so a Stop click, which interrupts the script, keeps what was measured), ``time_left`` (the
bar's "about 40 s left") and ``SweepState`` (running / stopped / done across script runs)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import streamlit as st

from kvviz.measure.sizing import about
from kvviz.measure.stats import Sample
from kvviz.ui.state import session

REDRAW_S = 0.5  # sweeps redraw their live chart at most twice a second


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
