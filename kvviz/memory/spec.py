"""The calculator's vocabulary: a model's shape (ModelSpec), one calculation's settings
(MemoryRequest) and its answer (MemoryResult), plus the errors a user can cause.

Pure data, validated where it is built: everything downstream may assume sane integers.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from kvviz.units import DTYPE_BITS, GB, GIB

DTYPES: tuple[str, ...] = tuple(DTYPE_BITS)
GROUPED_DTYPES = frozenset({"int8", "int4"})  # integer formats need per-group scales to be usable
SCALE_DTYPE_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4}
# Nominal GPU sizes. The label is read as GiB: an "80 GB" A100 has 81,920 MiB = 80 GiB.
GPU_PRESETS_GIB: tuple[int, ...] = (16, 24, 40, 48, 80, 94, 141)
DEFAULT_BLOCK_SIZE = 16  # vLLM's default block (page) size in tokens
DEFAULT_GROUP_SIZE = 64
DEFAULT_RESERVE = 0.10  # vLLM's default gpu_memory_utilization=0.9 leaves 10% free

# Sanity bounds: far above any real model, low enough that nothing here loops for long.
MAX_LAYERS = 10_000
MAX_DIM = 10_000_000
MAX_SEQ_LEN = 1 << 40
MAX_BATCH = 1 << 30


class CalcError(ValueError):
    """Bad calculator input; ``problems`` lists each one as a sentence for the user."""

    def __init__(self, problems: Sequence[str], where: str = "") -> None:
        self.problems = tuple(problems)
        self.where = where
        prefix = f"{where}: " if where else ""
        super().__init__(prefix + "; ".join(self.problems))


class ConfigError(CalcError):
    """A config.json that cannot be sized: unreadable, malformed JSON, missing fields or nonsense values."""


def is_int(v: Any) -> bool:
    """A JSON integer: bool is an int subclass in Python but never a size."""
    return isinstance(v, int) and not isinstance(v, bool)


# ----------------------------------------------------------------------------- model shape
@dataclass(frozen=True)
class MLA:
    """DeepSeek's multi-head latent attention: the cache holds one compressed latent per token."""

    kv_lora_rank: int  # d_c: the compressed K/V latent
    qk_rope_head_dim: int  # d_h^R: the decoupled RoPE key, shared by all heads
    qk_nope_head_dim: int  # per-head K without RoPE (only in the naive, decompressed cache)
    v_head_dim: int  # per-head V (only in the naive cache)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelSpec:
    """Everything the calculator needs about one model, normalised from its config.json."""

    name: str
    model_type: str
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # K/V heads: n_heads = MHA, fewer = GQA, 1 = MQA (ignored under MLA)
    head_dim: int
    hidden: int
    max_positions: int | None = None  # max_position_embeddings (or n_positions / block_size)
    windows: tuple[int | None, ...] = ()  # per layer: sliding window in tokens, None = global
    mla: MLA | None = None
    params: int | None = None  # parameter count, when known
    params_note: str = ""  # where the count came from
    active_params: int | None = None  # MoE: parameters used per token
    vocab_size: int | None = None
    source: str = ""  # URL of the config.json it came from
    key: str = ""  # preset key, when it is a preset
    notes: tuple[str, ...] = ()  # what the parser decided and why

    @property
    def attention(self) -> str:
        if self.mla is not None:
            return "MLA"
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"

    def window_of(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    @property
    def has_windows(self) -> bool:
        return any(w is not None for w in self.windows)

    def window_summary(self) -> str:
        counts = Counter(self.windows or (None,) * self.n_layers)
        if list(counts) == [None]:
            return "none (every layer global)"
        parts = [f"{n} layers x {w:,}" if w is not None else f"{n} global layers" for w, n in sorted(
            counts.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))]
        return ", ".join(parts)


# ----------------------------------------------------------------------------- request / result
@dataclass(frozen=True)
class KVFormat:
    """How each cached value is stored."""

    dtype: str = "fp16"
    group_size: int = DEFAULT_GROUP_SIZE  # int8/int4 only: values sharing one scale
    scale_dtype: str = "fp16"  # int8/int4 only
    zero_point: bool = False  # int8/int4 only: asymmetric formats store a zero point per group too

    @property
    def grouped(self) -> bool:
        return self.dtype in GROUPED_DTYPES

    def vector_bytes(self, length: int) -> int:
        """Bytes for one vector of ``length`` values, packed, plus its group scales."""
        data = -(-length * DTYPE_BITS[self.dtype] // 8)  # ceil: an odd int4 vector still fills a byte
        if not self.grouped:
            return data
        per_group = SCALE_DTYPE_BYTES[self.scale_dtype] * (2 if self.zero_point else 1)
        return data + -(-length // self.group_size) * per_group


@dataclass(frozen=True)
class MemoryRequest:
    """One calculation: context, multipliers, formats and the GPU to fit it on."""

    seq_len: int  # tokens per sequence: prompt + output
    batch: int = 1  # concurrent requests
    beams: int = 1  # parallel samples / beams per request, each with its own cache
    kv_dtype: str = "fp16"
    weight_dtype: str = "fp16"
    group_size: int = DEFAULT_GROUP_SIZE
    scale_dtype: str = "fp16"
    zero_point: bool = False
    paged: bool = False  # vLLM-style: each layer's tokens rounded up to whole blocks
    block_size: int = DEFAULT_BLOCK_SIZE
    use_windows: bool = True  # False: every layer keeps every token (a runtime without windows)
    params: int | None = None  # user-entered parameter count; overrides the config's
    gpu_gib: float | None = None  # GPU memory in GiB; None = no fit check
    reserve: float = DEFAULT_RESERVE  # fraction of the GPU kept free (CUDA context, activations)

    def __post_init__(self) -> None:
        problems = request_problems(self)
        if problems:
            raise CalcError(problems)

    @property
    def kv_format(self) -> KVFormat:
        return KVFormat(self.kv_dtype, self.group_size, self.scale_dtype, self.zero_point)

    @property
    def sequences(self) -> int:
        return self.batch * self.beams


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v))


def request_problems(r: MemoryRequest) -> list[str]:
    """Every problem with a request, as sentences; empty when it is valid."""
    out: list[str] = []
    for name, hi in (("seq_len", MAX_SEQ_LEN), ("batch", MAX_BATCH), ("beams", 4096),
                     ("group_size", 1 << 20), ("block_size", 1 << 20)):
        v = getattr(r, name)
        if not is_int(v) or not 1 <= v <= hi:
            out.append(f"{name} must be an integer from 1 to {hi:,} (got {v!r})")
    for name, allowed in (("kv_dtype", DTYPES), ("weight_dtype", DTYPES), ("scale_dtype", tuple(SCALE_DTYPE_BYTES))):
        if getattr(r, name) not in allowed:
            out.append(f"{name} must be one of {', '.join(allowed)} (got {getattr(r, name)!r})")
    if r.params is not None and (not is_int(r.params) or not 1 <= r.params <= 10**15):
        out.append(f"params must be a positive integer (got {r.params!r})")
    if r.gpu_gib is not None and (not _is_number(r.gpu_gib) or not 0 < r.gpu_gib <= 1_000_000):
        out.append(f"gpu_gib must be a positive number of GiB (got {r.gpu_gib!r})")
    if not _is_number(r.reserve) or not 0 <= r.reserve < 1:
        out.append(f"reserve must be a fraction in [0, 1) (got {r.reserve!r})")
    return out


@dataclass(frozen=True)
class Fit:
    """Whether weights + KV fit on one GPU, and how far the settings could stretch."""

    gpu_bytes: int
    usable_bytes: int  # gpu_bytes minus the reserve
    fits: bool
    headroom_bytes: int  # usable - total (negative when it does not fit)
    max_batch: int  # requests at the chosen context (each with `beams` sequences)
    max_seq_len: int | None  # at the chosen batch; None = unbounded (every layer windowed)

    def to_dict(self) -> dict[str, Any]:
        return {"gpu_bytes": self.gpu_bytes, "usable_bytes": self.usable_bytes, "fits": self.fits,
                "headroom_bytes": self.headroom_bytes, "max_batch": self.max_batch,
                "max_seq_len": self.max_seq_len}


@dataclass(frozen=True)
class MemoryResult:
    spec: ModelSpec
    request: MemoryRequest
    layer_token_bytes: int  # one token, one layer, one sequence
    kv_bytes_per_token: int  # one token, all layers, one sequence (before any window cap)
    kv_bytes: int  # the whole cache: every layer, sequence and token (paged when asked)
    kv_bytes_unpaged: int
    paging_waste_bytes: int  # kv_bytes - kv_bytes_unpaged
    kv_bytes_mha: int  # the same cache if every query head had its own K/V (naive per-head for MLA)
    weights_bytes: int | None
    params: int | None
    params_source: str
    total_bytes: int | None
    fit: Fit | None
    formula: tuple[str, ...]
    warnings: tuple[str, ...]
    counted: tuple[str, ...]
    not_counted: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        s, r = self.spec, self.request
        return {
            "model": s.name, "preset": s.key or None, "source": s.source or None, "model_type": s.model_type,
            "attention": s.attention, "n_layers": s.n_layers, "n_heads": s.n_heads,
            "n_kv_heads": None if s.mla else s.n_kv_heads, "head_dim": s.head_dim, "hidden_size": s.hidden,
            "mla": None if s.mla is None else {"kv_lora_rank": s.mla.kv_lora_rank,
                                               "qk_rope_head_dim": s.mla.qk_rope_head_dim},
            "max_position_embeddings": s.max_positions, "sliding_windows": s.window_summary(),
            "seq_len": r.seq_len, "batch": r.batch, "beams": r.beams, "sequences": r.sequences,
            "dtype": r.kv_dtype, "weight_dtype": r.weight_dtype,
            "group_size": r.group_size if r.kv_dtype in GROUPED_DTYPES else None,
            "scale_dtype": r.scale_dtype if r.kv_dtype in GROUPED_DTYPES else None,
            "zero_point": r.zero_point if r.kv_dtype in GROUPED_DTYPES else None,
            "paged": r.paged, "block_size": r.block_size if r.paged else None, "use_windows": r.use_windows,
            "kv_bytes_per_token_per_layer": self.layer_token_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token, "kv_bytes": self.kv_bytes,
            "kv_bytes_unpaged": self.kv_bytes_unpaged, "paging_waste_bytes": self.paging_waste_bytes,
            "kv_bytes_mha": self.kv_bytes_mha,
            "params": self.params, "params_source": self.params_source,
            "active_params": s.active_params, "weights_bytes": self.weights_bytes,
            "total_bytes": self.total_bytes,
            "kv_gib": self.kv_bytes / GIB, "kv_gb": self.kv_bytes / GB,
            "gpu": None if self.fit is None else {"gib": r.gpu_gib, "reserve": r.reserve, **self.fit.to_dict()},
            "formula": list(self.formula), "counted": list(self.counted), "not_counted": list(self.not_counted),
            "notes": list(s.notes), "warnings": list(self.warnings),
        }
