"""argparse value types shared by the CLIs: each rejects bad text with a message, never a traceback."""
from __future__ import annotations

import argparse
import math


def _int_at_least(s: str, low: int, what: str) -> int:
    try:
        # "8,192" and "8_192" read as 8192: people paste numbers the way they write them.
        v = int(s.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
    return v


def positive_int(s: str) -> int:
    return _int_at_least(s, 1, "a positive integer")


def nonneg_int(s: str) -> int:
    return _int_at_least(s, 0, "an integer >= 0")


def finite_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
    return v
