"""Facts shared by the engine, the calculator and the UI: bytes per dtype, KV bytes per token,
and how a byte count is written. Pure Python (no torch), so the calculator can use it too.

Each fact lives here once; the cache, the live metrics, the FLOP/byte model and the memory
calculator all call these functions, so their figures cannot drift apart.
"""
from __future__ import annotations

GIB = 1024**3  # binary: what nvidia-smi and torch report
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


def fmt_bytes(n: float | None, both_units: bool = False) -> str:
    """A byte count for people: '12.5 MiB', or with ``both_units`` '13.11 MB (12.50 MiB)'.

    The short form suits a metric tile; the long one the calculator, whose readers mix GB and GiB.
    """
    if n is None:
        return "unknown"
    if both_units:
        if n < 10**6:
            return f"{n:,.0f} B ({n / 1024:,.1f} KiB)"
        if n < 10**9:
            return f"{n / 10**6:,.2f} MB ({n / 2**20:,.2f} MiB)"
        return f"{n / GB:,.2f} GB ({n / GIB:,.2f} GiB)"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:,.1f} {unit}"
    return f"{n:,.0f} B"

# safetensors' names for the floating-point dtypes kvviz loads weights from (both model families).
SAFETENSORS_FLOAT_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})
