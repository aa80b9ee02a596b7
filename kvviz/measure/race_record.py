"""One race's result as it is kept while the race runs: its runs so far, whether every mode
finished, what competed for the CPU, and an event that says the record is final.

The race runs on a script's thread; a Stop click starts the next script run on another thread at
once, while the race is still finishing its step. So the record is made (and handed to whoever
reads it) before the race starts and only written after it ends: ``keep`` fills it and sets
``settled``, whatever happens, and a reader waits on ``settled`` before it reads the runs.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvviz.measure.measuring import BusyWindow
from kvviz.measure.stats import MODES


@dataclass
class RaceRecord:
    id: int  # the race's number in its session: the charts' keys
    runs: dict[str, Any] = field(default_factory=dict)  # mode -> its Run, as far as it got
    complete: bool = False  # every mode ran to its end
    busy: str | None = None  # cpu_load.busy_during's clause over the race, if other work competed
    settled: threading.Event = field(default_factory=threading.Event)

    def keep(self, streams: Mapping[str, Any], finished: set[str], window: BusyWindow) -> None:
        """The race is over (finished or stopped): keep each mode's run (``streams``: mode -> its
        GenerationStream), whether all of ``stats.MODES`` finished, and the CPU window's clause."""
        try:
            self.runs = {mode: stream.run for mode, stream in streams.items()}
            self.complete = finished == set(MODES)
            self.busy = window.clause()
        finally:
            self.settled.set()  # never leave the next script run waiting
