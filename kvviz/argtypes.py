"""argparse value types shared by the CLIs: each rejects bad text with a message, never a traceback."""
from __future__ import annotations

import argparse
import math


def _int(s: str) -> int:
    # "8,192" and "8_192" read as 8192: people paste numbers the way they write them.
    return int(s.replace(",", "").replace("_", ""))


def positive_int(s: str) -> int:
    try:
        v = _int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def nonneg_int(s: str) -> int:
    try:
        v = _int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def finite_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
    return v
