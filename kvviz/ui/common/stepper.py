"""Advance a GenerationStream across Streamlit reruns (step mode), and close one safely.

Streamlit runs every rerun on a fresh thread; that is safe because the engine enters
inference mode per step and never holds it across a ``yield``. With fast reruns the old thread
may still be inside a step when the new one clicks on: a lock makes the second step (or the
close) wait for the first, where the generator would raise "already executing".
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvviz import StepEvent
from kvviz.engine.core.loop import GenerationStream


@dataclass
class Stepper:
    """A stream being advanced one event per click; lives in st.session_state between reruns."""

    run_id: int
    stream: GenerationStream
    meta: dict = field(default_factory=dict)
    signature: tuple = ()  # the settings it was started with: a change starts a new stream
    finished: bool = False
    _it: Iterator[StepEvent] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def advance(self) -> StepEvent | None:
        """The next event, or None once the run has ended (then ``finished`` is True)."""
        with self._lock:
            if self.finished:
                return None
            if self._it is None:
                self._it = iter(self.stream)
            try:
                return next(self._it)
            except StopIteration:
                self.finished = True
                return None

    def close(self) -> None:
        with self._lock:
            close_iterator(self._it)
            self._it = None


def close_iterator(it: Iterator[StepEvent] | None) -> None:
    """Close a generator now, on this thread, so its cache tensors are freed and grad mode restored."""
    close = getattr(it, "close", None)
    if close is not None:
        close()
