"""Facts shared by the engine, the calculator and the UI: bytes per dtype, KV bytes per token,
and how a byte count is written. Pure Python (no torch), so the calculator can use it too.

Each fact lives here once; the cache, the live metrics, the FLOP/byte model and the memory
calculator all call these functions, so their figures cannot drift apart.
"""
from __future__ import annotations

import math

GIB = 1024**3  # binary: what nvidia-smi and torch report; every page, the CLI and the docs use it
MIB = 1024**2
GB = 10**9  # decimal: what spec sheets usually mean

# Bits per stored element, by dtype name. int4 packs two values per byte.
DTYPE_BITS: dict[str, int] = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}


def dtype_bytes(name: str) -> int:
    """Whole bytes per element for a byte-aligned dtype name ('fp32' -> 4); int4 has none."""
    bits = DTYPE_BITS[name]
    if bits % 8:
        raise ValueError(f"{name} is not byte-aligned ({bits} bits); count its bytes per group instead")
    return bits // 8


def kv_bytes_per_token(n_layer: int, n_kv_heads: int, head_dim: int, elem_bytes: float, batch: int = 1) -> float:
    """K and V for one token across all layers: 2 x layers x KV heads x head_dim x bytes x batch.

    ``elem_bytes`` may be fractional (0.5 for int4); callers with whole bytes get an int back.
    """
    n = 2 * n_layer * n_kv_heads * head_dim * elem_bytes * batch
    return int(n) if float(n).is_integer() else n


def exact_ratio(n: int, div: int, places: int = 2) -> str:
    """``n / div`` to ``places`` decimals with thousands separators, in exact integer arithmetic
    (half rounds up): a float has 15-17 significant digits, so ``f"{n / div:,.2f}"`` of a 10^20-byte
    cache prints digits that are not true (131,072,000,001,862,640.00 GiB for ...862,645.15)."""
    scale = 10**places
    q = (abs(n) * scale * 2 + div) // (2 * div)
    whole, frac = divmod(q, scale)
    sign = "-" if n < 0 and q else ""
    return f"{sign}{whole:,}" + (f".{frac:0{places}d}" if places else "")


MAX_SHOWN_DIGITS = 24  # past this a number is shown by its size: nobody reads 300 digits


def fmt_count(v: int) -> str:
    """An integer for a message: '8,192', or for one of more than MAX_SHOWN_DIGITS digits its size and
    leading digits ('about 1.00e+308 (a 309-digit number)'), so a 10^308 config value gives one short line."""
    digits = str(abs(v))
    if len(digits) <= MAX_SHOWN_DIGITS:
        return f"{v:,}"
    sign = "-" if v < 0 else ""
    return f"about {sign}{digits[0]}.{digits[1:3]}e+{len(digits) - 1} (a {len(digits):,}-digit number)"


def fmt_bytes(n: float | None, both_units: bool = False) -> str:
    """A byte count for people: '12.5 MiB', or with ``both_units`` '12.50 MiB (13.11 MB)'.

    Binary units everywhere (pages, CLI, docs), as torch and nvidia-smi count; the long form adds the
    decimal figure in brackets for the calculator, whose readers meet GB on spec sheets.
    """
    if n is None:
        return "unknown"
    if both_units:
        if n < MIB:
            return f"{n:,.0f} B ({n / 1024:,.1f} KiB)"
        if n < GIB:
            return f"{n / MIB:,.2f} MiB ({n / 10**6:,.2f} MB)"
        if isinstance(n, int):  # exact to the last digit shown, however large
            return f"{exact_ratio(n, GIB)} GiB ({exact_ratio(n, GB)} GB)"
        return f"{n / GIB:,.2f} GiB ({n / GB:,.2f} GB)"
    for unit, div in (("GiB", GIB), ("MiB", MIB), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:,.1f} {unit}"
    return f"{n:,.0f} B"

def fmt_usd(x: float | None) -> str:
    """Money for people: to the cent ('$23.17', '$1,234.50'), and 3 significant figures below a
    cent ('$0.00412'), where cents would read as free. None (no price, or nothing fits) is '—'."""
    if x is None or x != x:
        return "—"
    if x == 0 or abs(x) >= 0.00995:  # what rounds to a cent or more is shown in cents
        return f"${x:,.2f}"
    digits = 2 - math.floor(math.log10(abs(x)))  # 0.00412: 2 - (-3) = 5 decimals -> 3 figures
    return f"${x:.{digits}f}"


# safetensors' names for the floating-point dtypes kvviz loads weights from (both model families).
SAFETENSORS_FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})
