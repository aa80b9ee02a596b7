"""Advance a GenerationStream across Streamlit reruns (step mode), and close one safely.

Why torch here: the engine's generator enters ``torch.inference_mode()`` once and holds it
across its ``yield``s. Streamlit runs every rerun on a fresh thread, where inference mode is off,
so resuming the generator there fails ("Inplace update to inference tensor outside
InferenceMode"). Entering inference mode around each ``next``/``close`` on the calling thread
makes resumption work, and leaves the thread's grad mode as it found it.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvviz import StepEvent
from kvviz.generate import GenerationStream


@dataclass
class Stepper:
    """A stream being advanced one event per click; lives in st.session_state between reruns."""

    run_id: int
    stream: GenerationStream
    meta: dict = field(default_factory=dict)
    signature: tuple = ()  # the settings it was started with: a change starts a new stream
    finished: bool = False
    _it: Iterator[StepEvent] | None = None

    def advance(self) -> StepEvent | None:
        """The next event, or None once the run has ended (then ``finished`` is True)."""
        if self.finished:
            return None
        if self._it is None:
            self._it = iter(self.stream)
        with torch.inference_mode():
            try:
                return next(self._it)
            except StopIteration:
                self.finished = True
                return None

    def close(self) -> None:
        close_iterator(self._it)
        self._it = None


def close_iterator(it: Iterator[StepEvent] | None) -> None:
    """Close a generator now, on this thread, so its cache tensors are freed and grad mode restored."""
    close = getattr(it, "close", None)
    if close is not None:
        with torch.inference_mode():
            close()
