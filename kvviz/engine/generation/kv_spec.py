"""How a compressed KV cache is asked for (quantized rows, a sliding window, sinks), and its checks.

Pure Python: the UI, the CLI and the calculator page validate a request with the same
sentences before anything is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvviz.errors import KVVizError
from kvviz.limits import MAX_SINKS  # shared with the CLI's --sinks

KV_DTYPES = ("int8", "int4", "fp8")
FP8_SCALES = ("tensor", "head")
POSITIONS = ("cache", "original")


@dataclass(frozen=True)
class KVSpec:
    kv_dtype: str | None = None  # None: rows kept in the model's dtype; else int8 | int4 | fp8
    group_size: int | None = None  # int8/int4: values sharing one fp16 scale along head_dim (None: head_dim)
    zero_point: bool = False  # int8/int4: asymmetric, an fp16 zero point per group beside the scale
    fp8_scale: str = "tensor"  # fp8: one fp32 scale per layer ("tensor") or per layer and KV head ("head")
    window: int | None = None  # keep only the last `window` positions (a ring buffer); None: all
    sinks: int = 0  # with a window: the first `sinks` positions are kept forever (StreamingLLM)
    positions: str | None = None  # RoPE positions once positions are evicted: "cache" | "original" (None: auto)
    track_errors: bool = False  # quantized: measure each write's K/V error (costs a dequantize per write)

    @property
    def quantized(self) -> bool:
        return self.kv_dtype is not None

    @property
    def windowed(self) -> bool:
        return self.window is not None

    @property
    def active(self) -> bool:
        return self.quantized or self.windowed

    def group_for(self, head_dim: int) -> int:
        return head_dim if self.group_size is None else self.group_size

    def label(self) -> str:
        """Short name for a run, e.g. 'int4 g32 zp' or 'window 64 + 4 sinks'."""
        parts = []
        if self.kv_dtype:
            q = self.kv_dtype
            if self.kv_dtype == "fp8":
                q += f" per-{self.fp8_scale}"
            else:
                q += "" if self.group_size is None else f" g{self.group_size}"
                q += " zp" if self.zero_point else ""
            parts.append(q)
        if self.window is not None:
            w = f"window {self.window}"
            w += f" + {self.sinks} sinks" if self.sinks else ""
            if self.positions == "original":
                w += " (original positions)"
            parts.append(w)
        return ", ".join(parts) or "full"


def check_group(dtype: str, group: int, head_dim: int) -> str | None:
    """Why ``group`` cannot be used for ``dtype`` on vectors of ``head_dim`` values, or None."""
    if dtype not in ("int8", "int4"):
        return None
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        return f"the quantization group size must be a positive integer (got {group!r})"
    if head_dim % group:
        return f"the group size {group} must divide the head dimension {head_dim}"
    if dtype == "int4" and group % 2:
        return (f"int4 packs two values per byte, so its group size must be even (got {group}): "
                "a byte would straddle two groups with different scales")
    return None


ROPE_FAMILIES = ("llama", "gemma3")  # K is rotated by its position after the projection (RoPE)


def rotates_keys(family: str) -> bool:
    """Whether a model family positions its keys by RoPE, so a window cache may renumber them
    (``positions="cache"``, StreamingLLM); GPT-2 adds learned positions at the input instead."""
    return family in ROPE_FAMILIES


def position_rules(family: str) -> list[str]:
    """The position conventions a window cache offers on ``family``, the default first."""
    return list(POSITIONS) if rotates_keys(family) else ["original"]


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def resolve(spec: KVSpec, family: str, head_dim: int, block_size: int) -> KVSpec:
    """The spec with ``positions`` filled in, or a KVVizError saying what cannot work and why.

    ``family`` is the model's ``model_type`` ("llama" and "gemma3" rotate K by position; GPT-2 adds
    learned absolute positions to the input). Gemma 3's sliding layers keep their own window besides:
    the model masks the window cache's rows outside it (``WindowKVCache.ring_positions``).
    """
    if spec.kv_dtype is not None and spec.kv_dtype not in KV_DTYPES:
        raise KVVizError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} (got {spec.kv_dtype!r})")
    if spec.kv_dtype is not None:
        problem = check_group(spec.kv_dtype, spec.group_for(head_dim), head_dim)
        if problem:
            raise KVVizError(problem)
    if spec.fp8_scale not in FP8_SCALES:
        raise KVVizError(f"the fp8 scale is per 'tensor' or per 'head' (got {spec.fp8_scale!r})")
    if spec.window is None:
        if spec.sinks:
            raise KVVizError("sinks need a window: the sink positions are what a sliding window keeps besides "
                             "its last W positions")
        return spec
    if not _int(spec.window) or spec.window < 1:
        raise KVVizError(f"the window must be a positive number of positions (got {spec.window!r})")
    if spec.window > block_size:
        raise KVVizError(f"a window of {spec.window} positions is larger than the model's context of "
                         f"{block_size}: nothing would ever be evicted; choose at most {block_size}")
    if not _int(spec.sinks) or spec.sinks < 0 or spec.sinks > MAX_SINKS:
        raise KVVizError(f"sinks must be 0..{MAX_SINKS} positions (got {spec.sinks!r})")
    if spec.sinks >= spec.window:
        raise KVVizError(f"sinks ({spec.sinks}) must be fewer than the window ({spec.window}): StreamingLLM keeps a "
                         "few sink positions (4) beside a much longer recent window")
    positions = spec.positions
    rope = rotates_keys(family)
    if positions is None:
        positions = "cache" if rope else "original"
    if positions not in POSITIONS:
        raise KVVizError(f"positions must be 'cache' or 'original' (got {positions!r})")
    if positions == "cache" and not rope:
        raise KVVizError("GPT-2-family models add a learned position embedding to each token at the input, so "
                         "every cached K/V row already carries its position: the cache cannot reassign positions "
                         "as StreamingLLM does with RoPE. Keep the original positions (positions='original', --kv-positions original): a plain sliding window.")
    return KVSpec(spec.kv_dtype, spec.group_size, spec.zero_point, spec.fp8_scale, spec.window, spec.sinks,
                  positions, spec.track_errors)
