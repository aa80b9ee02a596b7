"""Tables for st.dataframe that take any value the inputs allow.

Streamlit sends a table to the browser as Arrow, whose integers are 64-bit: a Python int past
2^63 - 1 (a calculator cache at 10^12 tokens x 2^30 requests is ~10^26 bytes) fails the whole page
with StreamlitDataframeConversionError. A column holding such a value is shown as exact text
instead ("131,072,000,001,862,645,150,720"); floats past 2^53, where float64 no longer holds every
integer, keep their 15 true significant digits. Other columns stay numbers, so they still sort.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import pandas as pd

INT64_MAX = 2**63 - 1
FLOAT_EXACT = 2**53  # float64 holds every integer up to here, and 15 significant digits beyond


def _too_big(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return not -INT64_MAX - 1 <= v <= INT64_MAX
    return isinstance(v, float) and math.isfinite(v) and abs(v) >= FLOAT_EXACT


def _text(v: Any) -> str | None:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) < FLOAT_EXACT and v.is_integer() else f"{v:.15g}"
    return str(v)


def safe_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """``pd.DataFrame(rows)`` with every column Arrow cannot carry exactly written as exact text.

    Read from the rows, before pandas converts them: pandas turns [2**63, None] into float64 and
    loses the last digits before any check could see them."""
    rows = list(rows)
    big = {k for row in rows for k, v in row.items() if _too_big(v)}
    if not big:
        return pd.DataFrame(rows)
    df = pd.DataFrame([{k: (_text(v) if k in big else v) for k, v in row.items()} for row in rows])
    for k in big:
        df[k] = df[k].astype(object).where(df[k].notna(), None)
    return df
