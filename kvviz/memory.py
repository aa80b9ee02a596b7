"""KV-cache memory calculator: exact bytes for real model configs.

Pure Python on purpose (no torch, no streamlit): the CLI, the page and the tests all call the
same functions, and a config.json can be sized without installing a deep-learning stack.

What one token costs, per layer, for one sequence:
- standard attention (MHA / GQA / MQA): 2 (K and V) x n_kv_heads x head_dim x bytes;
- MLA (DeepSeek-V2/V3): one latent of (kv_lora_rank + qk_rope_head_dim) x bytes;
- int8 / int4 add one scale (optionally one zero point too) per group of ``group_size`` values.
A layer with sliding window W stores min(T, W) tokens; paging rounds each layer's tokens up to
whole blocks. Everything is integer arithmetic, so results are exact to the byte.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

ASSETS = Path(__file__).resolve().parent.parent / "assets"
PRESETS_PATH = ASSETS / "memory_presets.json"
MAX_CONFIG_BYTES = 1_000_000  # a real config.json is a few KB; refuse anything bigger unparsed

GIB = 1024**3  # binary: what nvidia-smi and torch report
GB = 10**9  # decimal: what blog posts and spec sheets usually mean

DTYPE_BITS: dict[str, int] = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}
DTYPES: tuple[str, ...] = tuple(DTYPE_BITS)
GROUPED_DTYPES = frozenset({"int8", "int4"})  # integer formats need per-group scales to be usable
SCALE_DTYPE_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4}
# Nominal GPU sizes. The label is read as GiB: an "80 GB" A100 has 81,920 MiB = 80 GiB.
GPU_PRESETS_GIB: tuple[int, ...] = (16, 24, 40, 48, 80, 94, 141)
DEFAULT_BLOCK_SIZE = 16  # vLLM's default block (page) size in tokens
DEFAULT_GROUP_SIZE = 64
DEFAULT_RESERVE = 0.10  # vLLM's default gpu_memory_utilization=0.9 leaves 10% free

# Sanity bounds: far above any real model, low enough that nothing here loops for long.
_MAX_LAYERS = 10_000
_MAX_DIM = 10_000_000
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
    """A config.json that cannot be sized: malformed JSON, missing fields or nonsense values."""


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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def request_problems(r: MemoryRequest) -> list[str]:
    """Every problem with a request, as sentences; empty when it is valid."""
    out: list[str] = []
    for name, hi in (("seq_len", MAX_SEQ_LEN), ("batch", MAX_BATCH), ("beams", 4096),
                     ("group_size", 1 << 20), ("block_size", 1 << 20)):
        v = getattr(r, name)
        if not _is_int(v) or not 1 <= v <= hi:
            out.append(f"{name} must be an integer from 1 to {hi:,} (got {v!r})")
    for name, allowed in (("kv_dtype", DTYPES), ("weight_dtype", DTYPES), ("scale_dtype", tuple(SCALE_DTYPE_BYTES))):
        if getattr(r, name) not in allowed:
            out.append(f"{name} must be one of {', '.join(allowed)} (got {getattr(r, name)!r})")
    if r.params is not None and (not _is_int(r.params) or not 1 <= r.params <= 10**15):
        out.append(f"params must be a positive integer (got {r.params!r})")
    if r.gpu_gib is not None and (not isinstance(r.gpu_gib, (int, float)) or isinstance(r.gpu_gib, bool)
                                  or not 0 < r.gpu_gib <= 1_000_000 or math.isnan(r.gpu_gib)):
        out.append(f"gpu_gib must be a positive number of GiB (got {r.gpu_gib!r})")
    if not isinstance(r.reserve, (int, float)) or isinstance(r.reserve, bool) or not 0 <= r.reserve < 1:
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


# ----------------------------------------------------------------------------- the arithmetic
def layer_token_bytes(spec: ModelSpec, fmt: KVFormat) -> int:
    """Bytes one token adds to one layer's cache for one sequence."""
    if spec.mla is not None:
        return fmt.vector_bytes(spec.mla.latent_dim)  # one latent, shared by every head
    return 2 * spec.n_kv_heads * fmt.vector_bytes(spec.head_dim)  # K and V, per KV head


def stored_tokens(seq_len: int, window: int | None, use_windows: bool = True, block_size: int | None = None) -> int:
    """Tokens one layer keeps for one sequence, rounded up to whole blocks when paged."""
    t = min(seq_len, window) if (window is not None and use_windows) else seq_len
    if block_size:
        t = -(-t // block_size) * block_size
    return t


def _token_slots(spec: ModelSpec, seq_len: int, use_windows: bool, block_size: int | None) -> int:
    """Sum over layers of the tokens each layer stores (one sequence)."""
    counts = Counter(spec.windows or (None,) * spec.n_layers)  # layers grouped by window: O(#windows)
    return sum(n * stored_tokens(seq_len, w, use_windows, block_size) for w, n in counts.items())


def kv_bytes(spec: ModelSpec, fmt: KVFormat, seq_len: int, sequences: int = 1, use_windows: bool = True,
             block_size: int | None = None) -> int:
    """The whole cache in bytes. Every layer has the same shape, so it factors exactly."""
    return sequences * layer_token_bytes(spec, fmt) * _token_slots(spec, seq_len, use_windows, block_size)


def mha_layer_token_bytes(spec: ModelSpec, fmt: KVFormat) -> int:
    """Per layer per token if every query head kept its own K and V. For MLA this is the naive,
    decompressed cache (K of qk_nope + qk_rope and V of v_head_dim per head), as transformers'
    eager DeepSeek code keeps it."""
    if spec.mla is None:
        return 2 * spec.n_heads * fmt.vector_bytes(spec.head_dim)
    m = spec.mla
    return spec.n_heads * (fmt.vector_bytes(m.qk_nope_head_dim + m.qk_rope_head_dim) + fmt.vector_bytes(m.v_head_dim))


def weight_bytes(params: int, dtype: str) -> int:
    return -(-params * DTYPE_BITS[dtype] // 8)


def max_seq_len_for(spec: ModelSpec, fmt: KVFormat, budget: int, sequences: int, use_windows: bool,
                    block_size: int | None) -> int | None:
    """Largest T whose cache fits ``budget`` bytes; None when the cache stops growing (all windowed)."""
    if budget < kv_bytes(spec, fmt, 1, sequences, use_windows, block_size):
        return 0
    if use_windows and spec.windows and all(w is not None for w in spec.windows):
        cap = max(w for w in spec.windows if w is not None)
        if kv_bytes(spec, fmt, cap + (block_size or 0), sequences, use_windows, block_size) <= budget:
            return None  # the cache saturates at the window and still fits: any context does
    lo, hi = 1, 2
    while hi < MAX_SEQ_LEN and kv_bytes(spec, fmt, hi, sequences, use_windows, block_size) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # invariant: kv(lo) fits, kv(hi) does not (kv is non-decreasing in T)
        mid = (lo + hi) // 2
        if kv_bytes(spec, fmt, mid, sequences, use_windows, block_size) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


COUNTED = (
    "K and V (or MLA's latent) for every layer, token, sequence and beam, at the chosen dtype",
    "int8/int4: one scale per group of group_size values (plus a zero point when asked)",
    "paging: each layer's tokens rounded up to whole blocks",
    "weights: parameters x weight dtype (every expert of an MoE model is resident)",
)
NOT_COUNTED = (
    "activations, logits and the CUDA context (that is what the GPU reserve is for)",
    "allocator fragmentation and block-table metadata",
    "fp8: per-tensor scales (a few bytes per layer)",
    "the full-precision residual window some quantized caches keep (e.g. transformers' QuantizedCache)",
    "prefix sharing between beams or requests: each beam holds its own copy",
    "weight quantization scales and layers left in 16-bit by int8/int4 weight schemes",
)


def calculate(spec: ModelSpec, req: MemoryRequest) -> MemoryResult:
    """KV cache, weights and GPU fit for one model and one request."""
    fmt = req.kv_format
    block = req.block_size if req.paged else None
    seqs = req.sequences
    per_layer = layer_token_bytes(spec, fmt)
    per_token = per_layer * spec.n_layers
    kv_unpaged = kv_bytes(spec, fmt, req.seq_len, seqs, req.use_windows, None)
    kv = kv_bytes(spec, fmt, req.seq_len, seqs, req.use_windows, block)
    kv_mha = seqs * mha_layer_token_bytes(spec, fmt) * _token_slots(spec, req.seq_len, req.use_windows, block)

    warnings: list[str] = []
    if spec.max_positions is not None and req.seq_len > spec.max_positions:
        warnings.append(f"seq_len {req.seq_len:,} is beyond this model's max_position_embeddings "
                        f"({spec.max_positions:,}): computed anyway, but the model was not trained that long")
    if not req.use_windows and spec.has_windows:
        warnings.append("sliding windows ignored: every layer keeps every token (as a runtime without "
                        "window support would)")

    if req.params is not None:
        params, psrc = req.params, "entered by the user"
    else:
        params, psrc = spec.params, spec.params_note
    weights = weight_bytes(params, req.weight_dtype) if params is not None else None
    if weights is None:
        warnings.append("weights unknown for this config: enter a parameter count (--params) to include them")
    total = kv + (weights or 0) if weights is not None else None

    fit = None
    if req.gpu_gib is not None:
        gpu = int(round(req.gpu_gib * GIB))
        usable = int(gpu * (1 - req.reserve))
        need = kv + (weights or 0)
        budget = usable - (weights or 0)
        per_request = kv_bytes(spec, fmt, req.seq_len, req.beams, req.use_windows, block)
        max_batch = max(budget, 0) // per_request
        max_t = max_seq_len_for(spec, fmt, budget, seqs, req.use_windows, block) if budget > 0 else 0
        fit = Fit(gpu, usable, need <= usable, usable - need, max_batch, max_t)
        if weights is not None and weights > usable:
            warnings.append(f"the weights alone ({weights / GIB:,.2f} GiB) do not fit in the usable "
                            f"{usable / GIB:,.2f} GiB of this GPU")
        elif need > usable:
            warnings.append(f"does not fit: needs {need / GIB:,.2f} GiB, the GPU has {usable / GIB:,.2f} GiB usable")

    return MemoryResult(
        spec=spec, request=req, layer_token_bytes=per_layer, kv_bytes_per_token=per_token, kv_bytes=kv,
        kv_bytes_unpaged=kv_unpaged, paging_waste_bytes=kv - kv_unpaged, kv_bytes_mha=kv_mha,
        weights_bytes=weights, params=params, params_source=psrc if params is not None else "unknown",
        total_bytes=total, fit=fit, formula=tuple(formula_lines(spec, req)), warnings=tuple(warnings),
        counted=COUNTED, not_counted=NOT_COUNTED,
    )


def formula_lines(spec: ModelSpec, req: MemoryRequest) -> list[str]:
    """The arithmetic with this model's numbers substituted, one step per line."""
    fmt = req.kv_format
    bits = DTYPE_BITS[fmt.dtype]
    width = spec.mla.latent_dim if spec.mla else spec.head_dim
    vec = fmt.vector_bytes(width)
    per_layer = layer_token_bytes(spec, fmt)
    lines: list[str] = []
    if fmt.grouped:
        sb = SCALE_DTYPE_BYTES[fmt.scale_dtype] * (2 if fmt.zero_point else 1)
        what = "scale + zero point" if fmt.zero_point else "scale"
        lines.append(f"one vector of {width} values = ceil({width} x {bits} bits / 8) B + ceil({width} / "
                     f"{fmt.group_size}) groups x {sb} B {what} = {vec:,} B")
    if spec.mla:
        m = spec.mla
        size = ("" if fmt.grouped else
                f" = ({m.kv_lora_rank} kv_lora_rank + {m.qk_rope_head_dim} qk_rope_head_dim) x {bits // 8} B ({fmt.dtype})")
        lines.append(f"per layer per token = 1 MLA latent{size} = {per_layer:,} B")
    else:
        size = f"{vec:,} B" if fmt.grouped else f"{spec.head_dim} head_dim x {bits // 8} B ({fmt.dtype})"
        lines.append(f"per layer per token = 2 (K, V) x {spec.n_kv_heads} KV heads x {size} = {per_layer:,} B")
    lines.append(f"per token = {per_layer:,} B x {spec.n_layers} layers = {per_layer * spec.n_layers:,} B")
    block = req.block_size if req.paged else None
    counts = Counter(spec.windows or (None,) * spec.n_layers)
    terms = []
    for w, n in sorted(counts.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        t = f"min({req.seq_len:,}, {w:,})" if (w is not None and req.use_windows) else f"{req.seq_len:,}"
        if block:
            t = f"ceil({t} / {block}) x {block}"
        terms.append(f"{n} x {t}" if len(counts) > 1 else t)
    slots = _token_slots(spec, req.seq_len, req.use_windows, block)
    tokens = " + ".join(terms)
    mult = f" x {req.batch:,} batch x {req.beams} beam{'s' if req.beams != 1 else ''}"
    total = kv_bytes(spec, fmt, req.seq_len, req.sequences, req.use_windows, block)
    if len(counts) > 1:
        lines.append(f"token-layers = {tokens} = {slots:,}")
        lines.append(f"KV total = {per_layer:,} B x {slots:,}{mult} = {total:,} B = {total / GB:,.2f} GB = "
                     f"{total / GIB:,.2f} GiB")
    else:
        lines.append(f"KV total = {per_layer * spec.n_layers:,} B x {tokens} tokens{mult} = {total:,} B = "
                     f"{total / GB:,.2f} GB = {total / GIB:,.2f} GiB")
    return lines


def attention_variants(spec: ModelSpec, req: MemoryRequest) -> list[tuple[str, int]]:
    """The same shape under MHA, GQA, MQA and MLA, at the request's settings: (label, KV bytes).

    For an MLA model the shape is (layers, heads, qk_nope_head_dim), as in the DeepSeek-V2 paper's
    comparison; for the others, MLA uses DeepSeek-V2's ratios d_c = 4 d_h and d_h^R = d_h / 2.
    """
    fmt = req.kv_format
    block = req.block_size if req.paged else None
    h = spec.n_heads
    hd = spec.mla.qk_nope_head_dim if spec.mla else spec.head_dim
    base = replace(spec, mla=None, head_dim=hd)

    def size(s: ModelSpec) -> int:
        return kv_bytes(s, fmt, req.seq_len, req.sequences, req.use_windows, block)

    out = [(f"MHA ({h} KV heads)", size(replace(base, n_kv_heads=h)))]
    if spec.mla is None and 1 < spec.n_kv_heads < h:
        groups = spec.n_kv_heads
    else:
        divisors = [d for d in range(2, h) if h % d == 0]
        groups = min(divisors, key=lambda d: (abs(d - 8), d)) if divisors else 0
    if groups:
        out.append((f"GQA ({groups} KV heads)", size(replace(base, n_kv_heads=groups))))
    out.append(("MQA (1 KV head)", size(replace(base, n_kv_heads=1))))
    mla = spec.mla or MLA(kv_lora_rank=4 * hd, qk_rope_head_dim=max(hd // 2, 1), qk_nope_head_dim=hd, v_head_dim=hd)
    out.append((f"MLA ({mla.kv_lora_rank} + {mla.qk_rope_head_dim} latent)", size(replace(base, mla=mla))))
    return out


def context_curve(spec: ModelSpec, req: MemoryRequest, contexts: Iterable[int], dtype: str | None = None) -> list[int]:
    """KV bytes at each context length, everything else as in ``req``."""
    fmt = replace(req.kv_format, dtype=dtype) if dtype else req.kv_format
    block = req.block_size if req.paged else None
    return [kv_bytes(spec, fmt, t, req.sequences, req.use_windows, block) for t in contexts]


# ----------------------------------------------------------------------------- config.json parsing
_LLAMA_LIKE = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"})
KVVIZ_MODEL_TYPE = "kvviz-gpt"
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "falcon", "opt",
    "deepseek_v2", "deepseek_v3", KVVIZ_MODEL_TYPE,
)
# Generic fallbacks, first present key wins.
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_KV_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_head", "n_head_kv", "n_kv_heads")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim")
_POS_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx", "block_size")
# Defaults of the transformers config classes, used when a key is absent from config.json.
_TIE_DEFAULT = {"gemma": True, "gemma2": True, "falcon": True, "opt": True, "gpt2": True, KVVIZ_MODEL_TYPE: True}


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


class _Reader:
    """Reads typed fields from a raw config, collecting every problem instead of stopping at the first."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw
        self.problems: list[str] = []

    def _find(self, keys: Sequence[str]) -> tuple[str, Any]:
        for k in keys:
            if self.raw.get(k) is not None:
                return k, self.raw[k]
        return keys[0], None

    def int(self, keys: str | Sequence[str], required: bool = True, default: int | None = None,
            minimum: int = 1, maximum: int = _MAX_DIM) -> int | None:
        keys = (keys,) if isinstance(keys, str) else tuple(keys)
        k, v = self._find(keys)
        if v is None:
            if required and default is None:
                names = " / ".join(keys[:3])
                self.problems.append(f"missing {names}")
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not _is_int(v):
            self.problems.append(f"{k} must be an integer (got {_short(v)})")
            return None
        if v < minimum:
            what = "positive" if minimum == 1 else f">= {minimum}"
            self.problems.append(f"{k} must be {what} (got {v})")
            return None
        if v > maximum:
            self.problems.append(f"{k} = {v:,} is implausibly large (limit {maximum:,})")
            return None
        return v

    def bool(self, key: str, default: bool) -> bool:
        v = self.raw.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.problems.append(f"{key} must be true or false (got {_short(v)})")
            return default
        return v


@dataclass(frozen=True)
class _Shape:
    layers: int
    heads: int
    kv: int
    head_dim: int
    hidden: int


def parse_config(raw: Any, where: str = "config.json", name: str | None = None, source: str = "",
                 key: str = "") -> ModelSpec:
    """A ModelSpec from a Hugging Face (or kvviz) config.json object; ConfigError names every problem."""
    if not isinstance(raw, dict):
        raise ConfigError([f"must hold a JSON object, got {type(raw).__name__}"], where)
    notes: list[str] = []
    mtype = raw.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES and isinstance(raw.get("text_config"), dict):
        notes.append("read the decoder from text_config")  # multimodal wrappers nest the LM config
        raw = {**raw["text_config"]}
        mtype = raw.get("model_type")
    if not isinstance(mtype, str):
        mtype = "unknown"
    rd = _Reader(raw)
    if mtype == "falcon":
        shape, more = _falcon_shape(rd, notes)
    elif mtype in ("deepseek_v2", "deepseek_v3"):
        shape, more = _deepseek_shape(rd, notes)
    else:
        if mtype not in SUPPORTED_MODEL_TYPES:
            notes.append(f"model_type {mtype!r} is not one kvviz knows: read the generic keys "
                         f"({', '.join(SUPPORTED_MODEL_TYPES[:-1])} are recognised)")
        shape, more = _standard_shape(rd, mtype)
    max_pos = rd.int(_POS_KEYS, required=False, maximum=MAX_SEQ_LEN)
    vocab = rd.int(("vocab_size", "padded_vocab_size"), required=False)
    if max_pos is None and mtype == "falcon":
        max_pos = 2048  # FalconConfig's default; falcon-7b's config.json leaves it out
    windows = _windows(rd, mtype, shape.layers if shape else 0, notes) if shape else ()
    if rd.problems or shape is None:
        raise ConfigError(rd.problems or ["could not read the attention shape"], where)
    spec = ModelSpec(
        name=name or str(raw.get("_name_or_path") or mtype), model_type=mtype, n_layers=shape.layers,
        n_heads=shape.heads, n_kv_heads=shape.kv, head_dim=shape.head_dim, hidden=shape.hidden,
        max_positions=max_pos, windows=windows, mla=more.get("mla"), vocab_size=vocab,
        source=source, key=key,
    )
    params, active, pnote = _params(raw, mtype, spec, notes)
    return replace(spec, params=params, active_params=active, params_note=pnote, notes=tuple(notes))


def _standard_shape(rd: _Reader, mtype: str) -> tuple[_Shape | None, dict[str, Any]]:
    layers = rd.int(_LAYER_KEYS, maximum=_MAX_LAYERS)
    heads = rd.int(_HEAD_KEYS)
    hidden = rd.int(_HIDDEN_KEYS)
    head_dim = rd.int("head_dim", required=False)
    kv = rd.int(_KV_KEYS, required=False) if mtype != "gpt2" else None
    if kv is None:
        kv = heads  # absent (or null) means MHA in every transformers config class
    if heads and hidden and head_dim is None:
        if hidden % heads:
            rd.problems.append(f"{heads} attention heads do not divide hidden size {hidden} (and no head_dim is given)")
        head_dim = hidden // heads
    if heads and kv:
        if kv > heads:
            rd.problems.append(f"{kv} key/value heads is more than the {heads} attention heads")
        elif heads % kv:
            rd.problems.append(f"{kv} key/value heads do not divide the {heads} attention heads")
    if None in (layers, heads, hidden, head_dim, kv):
        return None, {}
    return _Shape(layers, heads, kv, head_dim, hidden), {}  # type: ignore[arg-type]


def _falcon_shape(rd: _Reader, notes: list[str]) -> tuple[_Shape | None, dict[str, Any]]:
    layers = rd.int(_LAYER_KEYS, maximum=_MAX_LAYERS)
    heads = rd.int(_HEAD_KEYS)
    hidden = rd.int(_HIDDEN_KEYS)
    new_arch = rd.bool("new_decoder_architecture", False)
    multi_query = rd.bool("multi_query", True)  # FalconConfig's default is True
    kv_raw = rd.int(("num_kv_heads", "n_head_kv"), required=False)
    if new_arch:
        kv = kv_raw if kv_raw is not None else heads
        notes.append(f"falcon new_decoder_architecture: {kv} K/V groups from num_kv_heads")
    elif multi_query:
        kv = 1
        if kv_raw not in (None, 1):
            notes.append(f"falcon: num_kv_heads {kv_raw} ignored because multi_query is true (one K/V head)")
    else:
        kv = heads
    head_dim = rd.int("head_dim", required=False)
    if heads and hidden and head_dim is None:
        if hidden % heads:
            rd.problems.append(f"{heads} attention heads do not divide hidden size {hidden}")
        head_dim = hidden // heads
    if heads and kv and heads % kv:
        rd.problems.append(f"{kv} key/value heads do not divide the {heads} attention heads")
    if None in (layers, heads, hidden, head_dim, kv):
        return None, {}
    return _Shape(layers, heads, kv, head_dim, hidden), {}  # type: ignore[arg-type]


def _deepseek_shape(rd: _Reader, notes: list[str]) -> tuple[_Shape | None, dict[str, Any]]:
    layers = rd.int(_LAYER_KEYS, maximum=_MAX_LAYERS)
    heads = rd.int(_HEAD_KEYS)
    hidden = rd.int(_HIDDEN_KEYS)
    kv_lora = rd.int("kv_lora_rank")
    rope = rd.int("qk_rope_head_dim")
    nope = rd.int("qk_nope_head_dim")
    v_dim = rd.int("v_head_dim")
    if None in (layers, heads, hidden, kv_lora, rope, nope, v_dim):
        return None, {}
    notes.append("MLA: the cache holds one (kv_lora_rank + qk_rope_head_dim) latent per layer per token; "
                 "num_key_value_heads does not apply")
    mla = MLA(kv_lora, rope, nope, v_dim)  # type: ignore[arg-type]
    return _Shape(layers, heads, heads, nope + rope, hidden), {"mla": mla}  # type: ignore[arg-type]


def _windows(rd: _Reader, mtype: str, n_layers: int, notes: list[str]) -> tuple[int | None, ...]:
    """Per-layer sliding windows, following each model's transformers implementation."""
    raw = rd.raw
    win = rd.int("sliding_window", required=False, maximum=MAX_SEQ_LEN)
    layer_types = raw.get("layer_types")
    if win is None and mtype == "gemma2" and "sliding_window" not in raw:
        win = 4096  # Gemma2Config's default
    if win is None:
        return ()
    if isinstance(layer_types, list) and len(layer_types) == n_layers and all(isinstance(t, str) for t in layer_types):
        notes.append("sliding layers taken from layer_types")
        return tuple(win if t == "sliding_attention" else None for t in layer_types)
    if mtype in ("qwen2", "qwen3"):
        if not rd.bool("use_sliding_window", False):
            notes.append(f"use_sliding_window is false: sliding_window {win:,} does not apply")
            return ()
        first = rd.int("max_window_layers", required=False, minimum=0, maximum=_MAX_LAYERS)
        first = n_layers if first is None else first
        return tuple(win if i >= first else None for i in range(n_layers))  # as in Qwen2Config.layer_types
    if mtype == "gemma2":
        notes.append(f"Gemma 2: even-indexed layers slide ({win:,} tokens), odd ones are global")
        return tuple(win if i % 2 == 0 else None for i in range(n_layers))
    if mtype in ("llama", "gemma", "gpt2", "opt", "falcon", "deepseek_v2", "deepseek_v3", KVVIZ_MODEL_TYPE):
        return ()  # these implementations never use a window
    if mtype == "phi3":
        notes.append(f"Phi-3 declares sliding_window {win:,} on every layer; transformers' cache honours it, "
                     "some servers keep every token (turn windows off to see that)")
    return (win,) * n_layers


# ----------------------------------------------------------------------------- parameter counts
def _params(raw: Mapping[str, Any], mtype: str, s: ModelSpec, notes: list[str]) -> tuple[int | None, int | None, str]:
    """(total, active, how) for the architectures whose layout is known; (None, None, why) otherwise."""
    rd = _Reader(raw)
    v = s.vocab_size
    if mtype == "gpt2" or mtype == KVVIZ_MODEL_TYPE:
        fn = _gpt2_params
    elif mtype in _LLAMA_LIKE:
        fn = _llama_params
    elif mtype == "falcon":
        fn = _falcon_params
    elif mtype == "opt":
        fn = _opt_params
    elif mtype in ("deepseek_v2", "deepseek_v3"):
        fn = _deepseek_params
    else:
        return None, None, "unknown architecture: enter a parameter count"
    if v is None:
        return None, None, "vocab_size missing: enter a parameter count"
    out = fn(rd, mtype, s, v)
    if out is None or rd.problems:
        missing = "; ".join(rd.problems) or "fields missing"
        notes.append(f"parameter count not computed ({missing})")
        return None, None, f"not computed ({missing}): enter a parameter count"
    total, active = out
    if mtype == "deepseek_v3" and raw.get("num_nextn_predict_layers"):
        notes.append("the multi-token-prediction module (num_nextn_predict_layers) is not counted: "
                     "transformers does not load it")
    return total, active, f"computed from the config ({mtype} layout)"


def _tied(rd: _Reader, mtype: str) -> bool:
    return rd.bool("tie_word_embeddings", _TIE_DEFAULT.get(mtype, False))


def _gpt2_params(rd: _Reader, mtype: str, s: ModelSpec, v: int) -> tuple[int, int] | None:
    c, L = s.hidden, s.n_layers
    if mtype == KVVIZ_MODEL_TYPE:
        pos = rd.int("block_size")
        bias = rd.bool("bias", True)
        inner = 4 * c
    else:
        pos = rd.int(("n_positions", "n_ctx"))
        bias = True
        inner = rd.int("n_inner", required=False) or 4 * c
    if pos is None:
        return None
    b = 1 if bias else 0
    qkv = c + 2 * s.n_kv_heads * s.head_dim
    layer = (2 * c * (1 + b)  # ln_1, ln_2
             + c * qkv + b * qkv  # c_attn
             + c * c + b * c  # attn c_proj
             + c * inner + b * inner + inner * c + b * c)  # mlp
    total = v * c + pos * c + L * layer + c * (1 + b)  # wte, wpe, blocks, ln_f; lm_head tied to wte
    return total, total


def _llama_params(rd: _Reader, mtype: str, s: ModelSpec, v: int) -> tuple[int, int] | None:
    c, L, h, kv, hd = s.hidden, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim
    inter = rd.int("intermediate_size")
    if inter is None:
        return None
    attn = c * h * hd + 2 * c * kv * hd + h * hd * c
    if mtype == "qwen2" or rd.bool("attention_bias", False):
        attn += h * hd + 2 * kv * hd  # Qwen2 always has q/k/v biases; llama's attention_bias adds them
        if mtype != "qwen2" and rd.bool("attention_bias", False):
            attn += c  # o_proj bias too (llama's attention_bias covers all four)
    if mtype == "qwen3":
        attn += 2 * hd  # q_norm and k_norm (RMSNorm over head_dim)
    norms = (4 if mtype == "gemma2" else 2) * c  # Gemma 2 adds pre/post feed-forward norms
    mlp = 3 * c * inter + (2 * inter + c if rd.bool("mlp_bias", False) else 0)
    if mtype == "mixtral":
        experts = rd.int("num_local_experts")
        k = rd.int("num_experts_per_tok")
        if experts is None or k is None:
            return None
        layer_total = attn + norms + experts * mlp + c * experts  # experts + router
        layer_active = attn + norms + k * mlp + c * experts
    else:
        layer_total = layer_active = attn + norms + mlp
    emb = v * c * (1 if _tied(rd, mtype) else 2)
    return emb + L * layer_total + c, emb + L * layer_active + c


def _falcon_params(rd: _Reader, mtype: str, s: ModelSpec, v: int) -> tuple[int, int] | None:
    c, L, h, kv, hd = s.hidden, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim
    bias = rd.bool("bias", False)
    ffn = rd.int("ffn_hidden_size", required=False) or 4 * c
    new_arch = rd.bool("new_decoder_architecture", False)
    qkv = (h + 2 * kv) * hd
    layer = c * qkv + h * hd * c + 2 * c * ffn
    if bias:
        layer += qkv + c + ffn + c
    if new_arch:
        n_ln = rd.int("num_ln_in_parallel_attn", required=False) or 2
    else:
        n_ln = 1 if rd.bool("parallel_attn", True) else 2
    layer += n_ln * 2 * c  # LayerNorms with bias
    emb = v * c * (1 if _tied(rd, mtype) else 2)
    total = emb + L * layer + 2 * c
    return total, total


def _opt_params(rd: _Reader, mtype: str, s: ModelSpec, v: int) -> tuple[int, int] | None:
    c, L = s.hidden, s.n_layers
    ffn = rd.int("ffn_dim")
    pos = rd.int("max_position_embeddings")
    if ffn is None or pos is None:
        return None
    proj = rd.int("word_embed_proj_dim", required=False) or c
    b = 1 if rd.bool("enable_bias", True) else 0
    layer = 4 * (c * c + b * c) + (c * ffn + b * ffn) + (ffn * c + b * c) + 2 * 2 * c
    total = v * proj + (pos + 2) * c + L * layer  # OPT's learned positions carry an offset of 2
    if proj != c:
        total += 2 * c * proj  # project_in / project_out
    if rd.bool("do_layer_norm_before", True) and not rd.bool("_remove_final_layer_norm", False):
        total += 2 * c
    if not _tied(rd, mtype):
        total += v * proj
    return total, total


def _deepseek_params(rd: _Reader, mtype: str, s: ModelSpec, v: int) -> tuple[int, int] | None:
    assert s.mla is not None
    c, L, h, m = s.hidden, s.n_layers, s.n_heads, s.mla
    q_rank = rd.int("q_lora_rank", required=False)
    inter = rd.int("intermediate_size")
    moe_inter = rd.int("moe_intermediate_size", required=False)
    n_routed = rd.int("n_routed_experts", required=False)
    n_shared = rd.int("n_shared_experts", required=False, minimum=0) or 0
    k = rd.int("num_experts_per_tok", required=False)
    first_dense = rd.int("first_k_dense_replace", required=False, minimum=0) or 0
    freq = rd.int("moe_layer_freq", required=False) or 1
    if inter is None:
        return None
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = c * q_rank + q_rank + q_rank * h * qk if q_rank else c * h * qk  # low-rank q with its norm
    attn = q + c * m.latent_dim + m.kv_lora_rank + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) \
        + h * m.v_head_dim * c
    dense_mlp = 3 * c * inter
    total = active = v * c * (1 if _tied(rd, mtype) else 2) + c
    for i in range(L):
        total += attn + 2 * c
        active += attn + 2 * c
        if n_routed and moe_inter and i >= first_dense and i % freq == 0:
            expert = 3 * c * moe_inter
            router = c * n_routed + (n_routed if mtype == "deepseek_v3" else 0)  # V3's score-correction bias
            total += (n_routed + n_shared) * expert + router
            active += ((k or 0) + n_shared) * expert + router
        else:
            total += dense_mlp
            active += dense_mlp
    return total, active


# ----------------------------------------------------------------------------- files and presets
def parse_config_text(text: str | bytes, where: str = "config.json", **kw: Any) -> ModelSpec:
    """Parse config.json text, bounded in size; every failure is a ConfigError, never a traceback."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError([f"is {len(text):,} bytes; a config.json is at most {MAX_CONFIG_BYTES:,}"], where)
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(["is not UTF-8 text"], where) from None
    if not text.strip():
        raise ConfigError(["is empty"], where)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError([f"is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"], where) from None
    except RecursionError:
        raise ConfigError(["is nested too deeply to be a config"], where) from None
    return parse_config(raw, where, **kw)


def load_config_file(path: str | Path, **kw: Any) -> ModelSpec:
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError([f"is {size:,} bytes; a config.json is at most {MAX_CONFIG_BYTES:,}"], p.name)
        data = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(["no such file"], str(p)) from None
    except IsADirectoryError:
        raise ConfigError(["is a folder, not a config.json file"], str(p)) from None
    except OSError as e:
        raise ConfigError([f"cannot be read ({e.strerror})"], str(p)) from None
    return parse_config_text(data, p.name, **kw)


@lru_cache(maxsize=4)
def load_presets(path: Path = PRESETS_PATH) -> dict[str, ModelSpec]:
    """Preset key -> ModelSpec, parsed from the shipped config excerpts (same parser as imports)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    out: dict[str, ModelSpec] = {}
    for entry in data["presets"]:
        out[entry["key"]] = parse_config(entry["config"], f"preset {entry['key']}", name=entry["name"],
                                         source=entry["source"], key=entry["key"])
    return out


def find_preset(name: str, presets: Mapping[str, ModelSpec]) -> ModelSpec:
    """Case-insensitive lookup by key or display name."""
    want = name.strip().lower()
    for key, spec in presets.items():
        if want in (key.lower(), spec.name.lower()):
            return spec
    close = [k for k in presets if want and (want in k.lower() or k.lower() in want)]
    hint = f"; did you mean {', '.join(close[:5])}?" if close else f"; choose one of {', '.join(presets)}"
    raise CalcError([f"unknown preset {name!r}{hint}"])


# ----------------------------------------------------------------------------- display helpers
def fmt_bytes(n: int | None) -> str:
    """Both units, labelled: '1.07 GB (1.00 GiB)'."""
    if n is None:
        return "unknown"
    if n < 10**6:
        return f"{n:,} B ({n / 1024:,.1f} KiB)"
    if n < 10**9:
        return f"{n / 10**6:,.2f} MB ({n / 2**20:,.2f} MiB)"
    return f"{n / GB:,.2f} GB ({n / GIB:,.2f} GiB)"


def summary_text(res: MemoryResult) -> str:
    """The human-readable report the CLI prints without --json."""
    s, r = res.spec, res.request
    lines = [
        f"{s.name}: {s.attention}, {s.n_layers} layers, {s.n_heads} heads"
        + ("" if s.mla else f", {s.n_kv_heads} KV heads") + f", head_dim {s.head_dim}",
        f"context {r.seq_len:,} x batch {r.batch:,} x beams {r.beams}, KV {r.kv_dtype}, weights {r.weight_dtype}",
        f"KV per token:  {fmt_bytes(res.kv_bytes_per_token)}",
        f"KV total:      {fmt_bytes(res.kv_bytes)}",
    ]
    if r.paged:
        lines.append(f"paging waste:  {fmt_bytes(res.paging_waste_bytes)} (block {r.block_size})")
    lines.append(f"weights:       {fmt_bytes(res.weights_bytes)} ({res.params_source})")
    lines.append(f"total:         {fmt_bytes(res.total_bytes)}")
    if res.fit is not None:
        f = res.fit
        mt = "unbounded (every layer windowed)" if f.max_seq_len is None else f"{f.max_seq_len:,}"
        lines.append(f"GPU {r.gpu_gib:g} GiB, {r.reserve:.0%} reserved: {'fits' if f.fits else 'does NOT fit'}; "
                     f"max batch at this context {f.max_batch:,}; max context at this batch {mt}")
    lines.append("formula:")
    lines += [f"  {ln}" for ln in res.formula]
    lines += [f"note: {n}" for n in s.notes]
    lines += [f"warning: {w}" for w in res.warnings]
    return "\n".join(lines)
