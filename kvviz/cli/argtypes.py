"""argparse value types shared by the CLIs: each rejects bad text with a message, never a traceback.

Every numeric option of every subcommand takes one of these, so a value past its bound is refused
by the parser (``kvviz <cmd>: error: argument --threads: ...``, exit 2) before a model loads or a
thread starts. The bounds themselves live in kvviz/limits.py, shared with the engine's checks.
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Callable

from kvviz.limits import (
    MAX_BEAMS, MAX_BINS, MAX_DRAFT, MAX_HEAD_DIM, MAX_INT, MAX_KV_BLOCK_SIZE, MAX_KV_BLOCKS, MAX_NGRAM, MAX_REPEATS,
    MAX_SEED, MAX_SINKS, MAX_TOKEN_ID, MAX_TOKENS,
)
from kvviz.safeio import out_file_problem


def _parse_int(s: str, what: str) -> int:
    t = s.strip().replace(",", "").replace("_", "")  # "8,192" and "8_192" read as 8192, as people write them
    if len(t.lstrip("+-")) > 30:  # int() of a 100,000-digit string is slow; no bound here has 30 digits
        raise argparse.ArgumentTypeError(f"expected {what}, got a {len(t):,}-digit number")
    try:
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None


def int_in(low: int, high: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]; ``why`` says where the upper bound comes from."""
    what = f"an integer from {low:,} to {high:,}" + (f" ({why})" if why else "")

    def parse(s: str) -> int:
        v = _parse_int(s, what)
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"expected {what}, got {v:,}")
        return v
    parse.__name__ = f"int_{low}_{high}"  # argparse names the type in some messages
    return parse


def _int_at_least(s: str, low: int, what: str) -> int:
    v = _parse_int(s, what)
    if not low <= v <= MAX_INT:
        raise argparse.ArgumentTypeError(f"expected {what}, got {v:,}")
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


def float_in(low: float, high: float, what: str, example: str, *, low_open: bool = False,
             high_open: bool = False, strip: Callable[[str], str] = str.strip) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high] (either end open, ``math.inf`` for none).

    ``what`` names the quantity in messages ("GPU memory in GiB"), ``example`` shows one value;
    ``strip`` removes what people type around the number (a "$", a "GiB").
    """
    def parse(s: str) -> float:
        try:
            v = float(strip(s))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} such as {example}, got {s!r}") from None
        ok = math.isfinite(v) and (low < v if low_open else low <= v) and (v < high if high_open else v <= high)
        if not ok:
            if high == math.inf:
                bound = f"a positive {what}" if low == 0 and low_open else f"{what} >= {low:g}"
            else:
                bound = f"{what} in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            raise argparse.ArgumentTypeError(f"expected {bound}, got {s!r}")
        return v
    return parse


_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def param_count(s: str) -> int:
    """A parameter count: '6738415616', '6,738,415,616', '6.7e9' or '6.7B'."""
    t = s.strip().lower().replace(",", "").replace("_", "")
    mult = 1
    if t and t[-1] in _SUFFIXES:
        t, mult = t[:-1], _SUFFIXES[t[-1]]
    try:
        v = float(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a parameter count like 6738415616 or 6.7B, got {s!r}") from None
    if not math.isfinite(v) or v < 1 or v > 1e15:
        raise argparse.ArgumentTypeError(f"expected a parameter count between 1 and 1e15, got {s!r}")
    return int(round(v))


def unit_strip(*suffixes: str) -> Callable[[str], str]:
    """A ``strip`` for ``float_in``: what people type around a number ("80 GiB", "$2.5") removed."""
    def strip(s: str) -> str:
        t = s.strip().lower()
        for suffix in suffixes:
            t = t.removeprefix(suffix) if suffix == "$" else t.removesuffix(suffix)
        return t.strip()
    return strip


gib = float_in(0, math.inf, "amount of GiB", "80", low_open=True, strip=unit_strip("gib", "gb"))
fraction = float_in(0, 1, "a fraction", "0.1", high_open=True)
bandwidth = float_in(0, math.inf, "GB/s", "3350", low_open=True)
price = float_in(0, math.inf, "a price in dollars per GPU-hour", "2.5", strip=unit_strip("$"))
efficiency = float_in(0, 1, "a fraction", "0.7", low_open=True)


def cpu_count() -> int:
    return os.cpu_count() or 1


def threads(s: str) -> int:
    """Intra-op threads: 1 to this machine's CPUs (torch.set_num_threads(1_000_000) segfaults, and
    more threads than CPUs only oversubscribes them)."""
    return int_in(1, cpu_count(), "this machine's CPUs")(s)


def threads_or_default(s: str) -> int:
    """As ``threads``, or 0 for torch's default."""
    return int_in(0, cpu_count(), "this machine's CPUs; 0: torch's default")(s)


# The shared bounds, one type per kind of count (kvviz/limits.py says why each is where it is).
token_count = int_in(1, MAX_TOKENS)
token_count_or_zero = int_in(0, MAX_TOKENS)
seed = int_in(0, MAX_SEED, "a signed 64-bit seed")
repeats = int_in(1, MAX_REPEATS)
beams = int_in(1, MAX_BEAMS)
draft_tokens = int_in(1, MAX_DRAFT)
ngram = int_in(1, MAX_NGRAM)
kv_block_size = int_in(1, MAX_KV_BLOCK_SIZE)
kv_blocks = int_in(1, MAX_KV_BLOCKS)
sinks = int_in(0, MAX_SINKS)
group_size = int_in(1, MAX_HEAD_DIM, "a group lies within one head vector")
top_k = int_in(1, MAX_TOKEN_ID, "no vocabulary is larger")
bins = int_in(1, MAX_BINS)


token_id = int_in(0, MAX_TOKEN_ID - 1, "no vocabulary is larger")


def out_file(s: str) -> Path:
    """``--out``: a regular file to create or replace, in a folder that exists and may be written
    (kvviz/safeio.py says what is refused). Checked here, before any work; written atomically."""
    problem = out_file_problem(s)
    if problem:
        raise argparse.ArgumentTypeError(f"cannot write the results to {s}: {problem}")
    return Path(s)


port = int_in(1, 65535, "a TCP port")
