"""The arithmetic: bytes per token, per layer and for the whole cache; weights; the GPU fit.

What one token costs, per layer, for one sequence:
- standard attention (MHA / GQA / MQA): 2 (K and V) x n_kv_heads x head_dim x bytes
  (kvviz.units.kv_bytes_per_token, the formula the engine's cache uses too);
- MLA (DeepSeek-V2/V3): one latent of (kv_lora_rank + qk_rope_head_dim) x bytes;
- int8 / int4 add one scale (optionally one zero point too) per group of ``group_size`` values.
A layer with sliding window W stores min(T, W) tokens; paging rounds each layer's tokens up to
whole blocks. Everything is integer arithmetic, so results are exact to the byte.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Iterable

from kvviz.memory.spec import (
    MAX_SEQ_LEN, MLA, SCALE_DTYPE_BYTES, Fit, KVFormat, MemoryRequest, MemoryResult, ModelSpec,
)
from kvviz.units import DTYPE_BITS, GB, GIB, dtype_bytes, kv_bytes_per_token

# ----------------------------------------------------------------------------- the arithmetic
def layer_token_bytes(spec: ModelSpec, fmt: KVFormat) -> int:
    """Bytes one token adds to one layer's cache for one sequence."""
    if spec.mla is not None:
        return fmt.vector_bytes(spec.mla.latent_dim)  # one latent, shared by every head
    if not fmt.grouped:
        return int(kv_bytes_per_token(1, spec.n_kv_heads, spec.head_dim, dtype_bytes(fmt.dtype)))
    # Grouped formats carry scales per head vector, so the unit is a whole packed vector:
    # the shared formula with head_dim 1 and that vector's bytes as the element size.
    return int(kv_bytes_per_token(1, spec.n_kv_heads, 1, fmt.vector_bytes(spec.head_dim)))


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
    return -(-params * DTYPE_BITS[dtype] // 8)  # ceil: an odd count of int4 weights still fills a byte


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

