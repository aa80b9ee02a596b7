"""What a measurement holds while it runs, whoever starts it (a page, a notebook): the process's one
measurement lock, so two measurements never time each other, and a window over other processes' CPU
use, so a result can say it was measured beside other work (``cpu_load.busy_during``).

No streamlit: the pages word a lock they could not get (ui/common/busy_notes.py).
"""
from __future__ import annotations

import threading

from kvviz.measure import threads
from kvviz.measure.cpu_load import busy_during, read_cpu

# One per process, so one per server: every browser session's measurements share it.
_LOCK = threading.Lock()


def measurement_lock() -> threading.Lock:
    """The process's measurement lock (also held while the model is timed once for the defaults)."""
    return _LOCK


def try_lock(timeout_s: float = 2.0) -> threading.Lock | None:
    """The measurement lock, acquired, or None when another measurement held it for ``timeout_s``."""
    return _LOCK if _LOCK.acquire(timeout=timeout_s) else None


class BusyWindow:
    """Other processes' CPU use over one measurement: start it before, ``clause()`` after."""

    def __init__(self) -> None:
        self.start = read_cpu()

    def clause(self) -> str | None:
        """``cpu_load.busy_during``'s clause (None when nothing competed, or it was too short to tell)."""
        choice = threads.ensure()
        return busy_during(self.start, read_cpu(), choice.cores, choice.threads)
