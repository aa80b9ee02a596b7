"""first_stop: the earliest stop string completed by the newest characters, found by hand."""
from __future__ import annotations

from kvviz.engine.generation.stops import first_stop


def test_match_spanning_the_boundary_and_earliest_wins() -> None:
    assert first_stop("Hello wor", 3, ["world"]) is None
    assert first_stop("Hello world", 2, ["world"]) == (6, "world")  # "wor" was old, "ld" new
    assert first_stop("a.b\n\nc", 3, ["c", "\n\n"]) == (3, "\n\n")  # both new: the earlier offset wins


def test_old_matches_are_not_searched_and_empty_stops() -> None:
    # "END" ended before the new characters began: not a new match, and not looked for
    assert first_stop("END and more text", 4, ["END"]) is None
    assert first_stop("anything", 8, []) is None
