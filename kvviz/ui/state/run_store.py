"""The runs of a session and the live runs of the process.

``RunStore`` keeps the last runs of a session in the session state (a plain mapping here, so it is
testable without Streamlit) and keeps their captures under a byte budget; ``live_runs`` counts the
live runs of every session, so the live loop can space its redraws.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import streamlit as st

from kvviz import Run
from kvviz.ui.common.budget import SESSION_CAPTURE_BUDGET, strip_captures
from kvviz.ui.state import session


# --- live runs across sessions ---------------------------------------------------------------------

class LiveRuns:
    """How many live runs this server process is drawing now, over every session.

    The live loop spaces its redraws by this number, so N generating sessions send about what one
    would: under load, browsers that cannot keep up stop reading their WebSocket, the server's
    keepalive ping then times out and the connection drops (measured: docs/load-test.md).
    """

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return self._n

    def __enter__(self) -> "LiveRuns":
        with self._lock:
            self._n += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._n -= 1


@st.cache_resource
def live_runs() -> LiveRuns:
    """The process-wide counter (one object shared by every session, like the model cache)."""
    return LiveRuns()


# --- the run store -------------------------------------------------------------------------------

@dataclass(frozen=True)
class StoredRun:
    id: int  # per session, from 1; also part of every chart key of this run
    run: Run
    stepping: bool = False  # a step-mode run that can still advance
    captures_dropped: bool = False  # older run whose captures were dropped to fit the budget

    @property
    def label(self) -> str:
        status = "stepping" if self.stepping else (self.run.stop_reason or "running")
        if status == "stopped" and self.run.note:  # why: "stopped by the user", "ended when a setting changed"
            status = self.run.note
        return f"#{self.id} · {self.run.label()} · {status}"


class RunStore:
    """The last ``keep`` runs of one session, newest last, captures under ``budget`` bytes.

    It holds a plain dict that lives in the session state. Methods touch only that dict, never
    ``st.session_state`` itself: when a click interrupts a live run, Streamlit starts the new run
    on another thread at once and makes every session-state access of the old one raise, so the
    old run's ``finally`` can still record its partial run here (and ``live`` tells the new run
    to wait for that).
    """

    def __init__(self, state: MutableMapping[str, Any], name: str = "live", keep: int = 8,
                 budget: int = SESSION_CAPTURE_BUDGET) -> None:
        key = session.RUNS_PREFIX + name
        if key not in state:
            state[key] = {"next_id": 1, "runs": []}
        self._data: dict[str, Any] = state[key]
        self._data.setdefault("live", None)
        self._data.setdefault("inbox", {})
        self.keep = keep
        self.budget = budget

    # --- a live run in progress (possibly on another thread) ---
    def begin_live(self, run_id: int) -> None:
        self._data["live"] = (run_id, threading.Event())

    def end_live(self) -> None:
        live = self._data.get("live")
        self._data["live"] = None
        if live is not None:
            live[1].set()

    def wait_live(self, timeout: float = 5.0) -> bool:
        """Block until a live run that a click interrupted has stored its partial run."""
        live = self._data.get("live")
        return True if live is None else live[1].wait(timeout)

    # --- messages for the next script run (set where session state cannot be written) ---
    def post(self, name: str, value: Any) -> None:
        self._data["inbox"][name] = value

    def take(self, name: str) -> Any:
        return self._data["inbox"].pop(name, None)

    def new_id(self) -> int:
        rid = self._data["next_id"]
        self._data["next_id"] = rid + 1
        return rid

    def runs(self) -> list[StoredRun]:
        return list(self._data["runs"])

    def get(self, run_id: int | None) -> StoredRun | None:
        return next((r for r in self._data["runs"] if r.id == run_id), None)

    def latest(self) -> StoredRun | None:
        runs = self._data["runs"]
        return runs[-1] if runs else None

    def put(self, run_id: int, run: Run, stepping: bool = False, trim: bool = True) -> StoredRun:
        """Add or replace run ``run_id``, then drop the oldest runs and captures that do not fit.

        ``trim=False`` skips the byte accounting (a live run updates its entry on every token).
        """
        entry = StoredRun(run_id, run, stepping)
        runs = [r for r in self._data["runs"] if r.id != run_id] + [entry]
        runs = runs[-self.keep:]
        if not trim:
            self._data["runs"] = runs
            return entry
        # Oldest first: strip captures until the session fits (the newest run always keeps its own).
        total = sum(r.run.capture_nbytes() for r in runs)
        for i, r in enumerate(runs[:-1]):
            if total <= self.budget:
                break
            nbytes = r.run.capture_nbytes()
            if nbytes:
                runs[i] = dataclasses.replace(r, run=strip_captures(r.run), captures_dropped=True)
                total -= nbytes
        self._data["runs"] = runs
        return entry

    def capture_nbytes(self) -> int:
        return sum(r.run.capture_nbytes() for r in self._data["runs"])


def run_store(name: str = "live") -> RunStore:
    """This session's store (pages share it by name)."""
    return RunStore(session.mapping(), name)
