"""The bytes of kvviz's own compressed KV caches (engine/kvcache/compressed_caches.py), from the calculator's formulas.

The live caches count their tensors; this counts the same thing from the shapes, with the
calculator's ``KVFormat`` (packed payload plus fp16 group scales and zero points) and its
``stored_tokens`` (a window keeps at most its span). A test holds the two equal at every step.

What each option stores, per layer, KV head and position, for K and for V:
- the model's dtype: head_dim values;
- int8 / int4: head_dim bytes / head_dim / 2 bytes, plus head_dim / group fp16 scales
  (and as many fp16 zero points when asymmetric);
- fp8: head_dim bytes; its fp32 scales (one per layer, or per layer and KV head, for K and V)
  do not grow with positions.
A window of W positions with S sinks holds min(positions, S + W): flat once full.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvviz.calculator.formulas import stored_tokens
from kvviz.calculator.spec import KVFormat


@dataclass(frozen=True)
class CacheShape:
    n_layer: int
    n_kv_heads: int
    head_dim: int
    elem_bytes: int = 4  # the model's own dtype (fp32: 4), used when nothing is quantized
    batch: int = 1


@dataclass(frozen=True)
class Compression:
    kv_dtype: str | None = None  # None | int8 | int4 | fp8
    group_size: int | None = None  # None: head_dim
    zero_point: bool = False
    fp8_scale: str = "tensor"  # tensor | head
    window: int | None = None
    sinks: int = 0


def vector_bytes(shape: CacheShape, c: Compression) -> int:
    """One head's K (or V) vector for one position."""
    if c.kv_dtype is None:
        return shape.head_dim * shape.elem_bytes
    group = shape.head_dim if c.group_size is None else c.group_size
    return KVFormat(c.kv_dtype, group, "fp16", c.zero_point).vector_bytes(shape.head_dim)


def position_bytes(shape: CacheShape, c: Compression) -> int:
    """One position across every layer, K and V, every batch row."""
    return 2 * shape.n_layer * shape.n_kv_heads * shape.batch * vector_bytes(shape, c)


def fixed_bytes(shape: CacheShape, c: Compression) -> int:
    """fp8's fp32 scales, K and V per layer (and per KV head)."""
    if c.kv_dtype != "fp8":
        return 0
    return 2 * shape.n_layer * (shape.n_kv_heads if c.fp8_scale == "head" else 1) * 4


def held_positions(c: Compression, seq_len: int) -> int:
    return stored_tokens(seq_len, None if c.window is None else c.sinks + c.window)


def cache_bytes(shape: CacheShape, c: Compression, seq_len: int) -> int:
    """What the cache holds after ``seq_len`` tokens: payload, scales and zero points."""
    return held_positions(c, seq_len) * position_bytes(shape, c) + fixed_bytes(shape, c)
