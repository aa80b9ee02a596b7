"""Stop strings: where the first one completes in generated text. Shared by every generation stream."""
from __future__ import annotations

from typing import Sequence


def first_stop(text: str, new_chars: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """(offset, stop string) of the earliest stop string that the last ``new_chars`` characters of
    ``text`` completed, or None. Only the tail can hold a new match: a stop string ending in the new
    characters starts at most ``longest - 1`` characters before them, so earlier text is not searched."""
    if not stops:
        return None
    longest = max(len(s) for s in stops)
    tail = max(0, len(text) - new_chars - longest + 1)
    hits = [(at, s) for s in stops if (at := text.find(s, tail)) >= 0]
    return min(hits) if hits else None
