"""When a timing page's own measurements contradict the shape they should have, say so, in words.

The measurement pages explain their results (why the speedup is not the FLOP ratio, which phase
is memory-bound). Those explanations assume steady timings. Under contention they are not, and
an explanation built on them teaches the wrong lesson: a cached step of 81.7 ms blamed on "fixed
overhead", a cached slope of 1.78 printed next to "expect about 1". So each page first checks its
own numbers, and where they fail it states what it observed and gives no cause:
- the spread: repeats of one thing (a kind of step, one point of a sweep) far apart;
- the shape: a cached log-log slope far from 1, recomputation steeper than quadratic, a time to
  first token that does not grow with the prompt;
- the machine: other processes keeping a core busy while it measured (from ``cpu_load``).

Pure arithmetic over plain numbers: no torch, no streamlit.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

WIDE_STEP_SPREAD = 2.0  # 90th / 10th percentile of one kind of step; a steady machine stays well inside
WIDE_REPEAT_SPREAD = 1.5  # max / min over the repeats of one point, typical over the points
SLOPE_TOLERANCE = 0.3  # how far a fitted log-log slope may stray from its expected value
MIN_VALUES = 16  # fewer steps than this say nothing about a spread (the first ones warm caches)


def _positive(values: Iterable[float]) -> np.ndarray:
    a = np.asarray(list(values), dtype=np.float64)
    return a[np.isfinite(a) & (a > 0)]


def step_spread(latencies_ms: Iterable[float], what: str) -> str | None:
    """A sentence when one kind of step's timings spread too widely (p90 / p10), else None."""
    a = _positive(latencies_ms)
    if a.size < MIN_VALUES:
        return None
    p10, p90 = (float(v) for v in np.percentile(a, [10, 90]))
    factor = p90 / p10
    if factor <= WIDE_STEP_SPREAD:
        return None
    return (f"The spread is too wide: {what} took from {p10:,.2f} to {p90:,.2f} ms (10th to 90th percentile), "
            f"{factor:,.1f}× apart, for the same work.")


def repeat_spread(lo: Sequence[float], hi: Sequence[float], what: str = "the repeats of one point") -> str | None:
    """A sentence when repeats of the same point typically differ by more than WIDE_REPEAT_SPREAD."""
    lo_a, hi_a = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
    ok = np.isfinite(lo_a) & np.isfinite(hi_a) & (lo_a > 0)
    if ok.sum() < 2:
        return None
    ratios = hi_a[ok] / lo_a[ok]
    typical, worst = float(np.median(ratios)), float(ratios.max())
    if typical <= WIDE_REPEAT_SPREAD:
        return None
    return (f"The spread is too wide: {what} differ by {typical:,.1f}× (median over the points; up to "
            f"{worst:,.1f}×), for the same work.")


def slope(label: str, fitted: float, expected: float, x_min: float, x_max: float) -> str | None:
    """A sentence when a fitted log-log slope strays from ``expected`` by more than SLOPE_TOLERANCE."""
    if abs(fitted - expected) <= SLOPE_TOLERANCE:
        return None
    return (f"The {label} slope is {fitted:.2f} (N = {x_min:,.0f}…{x_max:,.0f}), far from the {expected:g} it should "
            f"have: this sweep's times do not grow the way the work does.")


def rises(xs: Sequence[float], ys: Sequence[float], what: str) -> str | None:
    """A sentence when ``ys`` does not grow with ``xs`` overall (it should: more tokens, more work)."""
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    x, y = x[ok], y[ok]
    if x.size < 3:
        return None
    order = np.argsort(x)
    x, y = x[order], y[order]
    falls = int((np.diff(y) < 0).sum())
    if y[-1] > y[0] and falls <= (x.size - 1) // 3:
        return None
    return (f"The shape is wrong: {what} should grow with the prompt, but it falls {falls} times between "
            f"{x.size} lengths ({y[0]:,.2f} ms at {x[0]:,.0f} tokens, {y[-1]:,.2f} ms at {x[-1]:,.0f}).")


def busy(clause: str | None) -> str | None:
    """The machine's part: ``cpu_load.busy_during``'s clause, as a sentence."""
    return f"Another process was using a core: {clause}." if clause else None


def cache_slopes(fits: Mapping[str, Any]) -> list[str | None]:
    """A cache-vs-recompute sweep's fitted slopes (``stats.Fit`` by series) against their shapes: the
    cached ("static") about 1; no cache ("none") at most 2 (below 2 at small N is expected)."""
    found: list[str | None] = []
    if "static" in fits:
        f = fits["static"]
        found.append(slope("cached (static)", f.slope, 1.0, f.x_min, f.x_max))
    if "none" in fits and fits["none"].slope > 2.0 + SLOPE_TOLERANCE:
        f = fits["none"]
        found.append(slope("no-cache", f.slope, 2.0, f.x_min, f.x_max))
    return found


def sweep(shape: Iterable[str | None], spreads: Iterable[tuple[Any, str]], busy_clause: str | None) -> list[str]:
    """What a sweep page found, in the order it is told: its own shape checks, then the repeat spread
    of each aggregated frame (``stats.aggregate``'s min and max; None or empty says nothing) named by
    its words, then the machine's load."""
    found = list(shape)
    for frame, what in spreads:
        if frame is not None and len(frame):
            found.append(repeat_spread(frame["min"].to_numpy(), frame["max"].to_numpy(), what))
    found.append(busy(busy_clause))
    return [f for f in found if f]


def verdict(found: Iterable[str | None]) -> str:
    """The paragraph a page shows instead of an explanation, or "" when nothing was found."""
    found = [f for f in found if f]
    if not found:
        return ""
    return ("**These timings contradict what they should show, so this page does not explain them.** "
            + " ".join(found) + " Measure again on a quiet machine: close other work, and on a small machine give "
            "the model fewer threads (the sidebar's CPU threads).")
