"""The measurement lock and the race's record (kvviz/measure/measuring.py, race_record.py): library
code the pages call, with no streamlit in it."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from kvviz.measure.measuring import BusyWindow, measurement_lock, try_lock
from kvviz.measure.race_record import RaceRecord


def test_one_lock_and_a_second_taker_is_refused_until_it_is_free() -> None:
    assert measurement_lock() is measurement_lock()
    held = try_lock(0.1)
    assert held is measurement_lock()
    try:
        got: list[object] = []
        other = threading.Thread(target=lambda: got.append(try_lock(0.05)))
        other.start()
        other.join()
        assert got == [None]  # another session measuring: refused after the timeout, never blocked
    finally:
        held.release()
    again = try_lock(0.1)
    assert again is not None
    again.release()


class _Window(BusyWindow):
    def __init__(self, clause: str | None = None, fail: bool = False) -> None:
        self._clause, self._fail = clause, fail

    def clause(self) -> str | None:
        if self._fail:
            raise OSError("/proc went away")
        return self._clause


def test_a_finished_race_keeps_every_run_and_settles() -> None:
    record = RaceRecord(7)
    assert not record.settled.is_set() and record.runs == {} and not record.complete
    streams = {m: SimpleNamespace(run=f"run of {m}") for m in ("static", "concat", "none")}
    record.keep(streams, {"static", "concat", "none"}, _Window("other work"))
    assert record.runs == {"static": "run of static", "concat": "run of concat", "none": "run of none"}
    assert record.complete and record.busy == "other work" and record.settled.is_set() and record.id == 7


def test_a_stopped_race_keeps_what_ran_and_settles_even_when_the_window_fails() -> None:
    record = RaceRecord(1)
    with pytest.raises(OSError):
        record.keep({"static": SimpleNamespace(run="half")}, set(), _Window(fail=True))
    assert record.runs == {"static": "half"} and not record.complete
    assert record.settled.is_set()  # the next script run never waits on a record nobody will finish
