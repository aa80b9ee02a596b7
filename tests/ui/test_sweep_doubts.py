"""The race's and the prefill page's sweep doubts, word for word, on frames built by hand: each page
keeps its own checks (slopes; a rising TTFT) and shares the spread and the busy sentence
(kvviz/measure/doubts.sweep)."""
from __future__ import annotations

import pandas as pd

from kvviz.measure.stats import Fit
from kvviz.ui.pages.prefill import prefill
from kvviz.ui.pages.race import race

BUSY = "2.0 of 4 cores were busy with other work"
WIDE = ("The spread is too wide: {what} differ by 2.0× (median over the points; up to 3.0×), for the same work.")


def _frame(xs: list[float], med: list[float], lo: list[float], hi: list[float]) -> pd.DataFrame:
    return pd.DataFrame({"series": "s", "x": xs, "median": med, "min": lo, "max": hi, "n": 3})


def test_a_steady_race_sweep_has_no_doubt() -> None:
    agg = _frame([32, 64, 128], [1, 2, 4], [1, 2, 4], [1.1, 2.2, 4.4])
    fits = {"static": Fit(1.1, 0.0, 64, 128, 3), "none": Fit(1.8, 0.0, 64, 128, 3)}  # none below 2: expected at small N
    assert race.sweep_doubts(agg, fits, None) == []


def test_the_race_sweep_names_its_slopes_spread_and_load() -> None:
    agg = _frame([32, 64, 128], [1, 2, 4], [1, 1, 1], [2, 2, 3])  # ratios 2, 2, 3: median 2.0, up to 3.0
    fits = {"static": Fit(1.5, 0.0, 64, 256, 3), "none": Fit(2.4, 0.0, 64, 256, 3)}
    assert race.sweep_doubts(agg, fits, BUSY) == [
        "The cached (static) slope is 1.50 (N = 64…256), far from the 1 it should have: this sweep's times do "
        "not grow the way the work does.",
        "The no-cache slope is 2.40 (N = 64…256), far from the 2 it should have: this sweep's times do not grow "
        "the way the work does.",
        WIDE.format(what="repeats of the same N and mode"),
        f"Another process was using a core: {BUSY}.",
    ]
    assert race.sweep_doubts(agg.iloc[:0], {}, None) == []  # nothing measured: nothing to doubt


def test_the_prefill_sweeps_name_their_shape_spreads_and_load() -> None:
    ttft = _frame([16, 32, 64, 128], [4, 3, 2, 1], [1, 1, 1, 1], [2, 2, 3, 2])
    decode = _frame([100, 200, 300], [1, 1, 1], [1, 1, 1], [2, 2, 3])
    assert prefill.sweep_doubts(ttft, decode, BUSY) == [
        "The shape is wrong: the time to first token should grow with the prompt, but it falls 3 times between "
        "4 lengths (4.00 ms at 16 tokens, 1.00 ms at 128).",
        WIDE.format(what="repeats of the same prompt length"),
        WIDE.format(what="repeats of a decode step at the same context"),
        f"Another process was using a core: {BUSY}.",
    ]
    steady = _frame([16, 32, 64], [1, 2, 4], [1, 2, 4], [1, 2, 4])
    assert prefill.sweep_doubts(steady, None, None) == []
