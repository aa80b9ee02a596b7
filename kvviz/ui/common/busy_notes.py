"""What a page says when the machine is not free to measure: another browser session holds the
measurement lock (kvviz/measure/measuring.py), or other processes keep cores busy (cpu_load)."""
from __future__ import annotations

import threading

import streamlit as st

from kvviz.measure.cpu_load import busy_warning
from kvviz.measure.measuring import try_lock


def acquire_or_warn(timeout_s: float = 2.0) -> threading.Lock | None:
    """The measurement lock, or None after telling the user that another session is measuring
    (two sessions timing at once would slow each other down and spoil both results)."""
    lock = try_lock(timeout_s)
    if lock is None:
        st.warning("another browser session is measuring right now; try again when it has finished, "
                   "so the two do not slow each other down")
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
