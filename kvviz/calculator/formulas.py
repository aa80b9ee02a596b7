"""The arithmetic: bytes per token, per layer, per GPU and for the whole cache; the linear layers'
state; weights; the largest context that fits. Everything is integer arithmetic, exact to the byte.

What one token costs, per KV layer, for one sequence:
- standard attention (MHA / GQA / MQA): 2 (K and V) x n_kv_heads x head_dim x bytes
  (kvviz.units.kv_bytes_per_token, the formula the engine's cache uses too);
- MLA (DeepSeek-V2/V3): one latent of (kv_lora_rank + qk_rope_head_dim) x bytes;
- int8 / int4 add one scale (optionally one zero point too) per group of ``group_size`` values.
What a layer keeps for T tokens: full T; sliding (window W) min(T, W); chunked (chunk C)
min(T, C), the whole chunk an engine allocates; linear none (a fixed state, counted apart).
Paging rounds each layer's tokens up to whole blocks.

Under tensor parallelism over N GPUs each GPU holds max(1, n_kv_heads / N) KV heads per layer
(so heads are replicated when N > n_kv_heads), and the whole MLA latent (it has no heads to split).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from kvviz.calculator.spec import (
    MAX_SEQ_LEN, MLA, KVFormat, Layer, MemoryRequest, ModelSpec,
)
from kvviz.units import DTYPE_BITS, dtype_bytes, kv_bytes_per_token


# ----------------------------------------------------------------------------- tensor parallelism
def tp_problems(spec: ModelSpec, tp: int) -> list[str]:
    """Why ``tp`` GPUs cannot split this model, as sentences (vLLM's rules); empty when they can."""
    if tp == 1:
        return []
    out: list[str] = []
    if spec.n_heads % tp:
        out.append(f"tp {tp} does not divide the {spec.n_heads} attention heads")
    kv = spec.n_kv_heads
    if spec.mla is None and spec.kv_layers and kv % tp and tp % kv:
        out.append(f"tp {tp} neither divides nor is a multiple of the {kv} KV heads, so the heads cannot be "
                   f"split or replicated evenly (vLLM refuses it too)")
    if spec.state is not None:
        for field, count in spec.state.split:
            if count % tp:
                out.append(f"tp {tp} does not divide the linear layers' {count} {field}")
        st = spec.state
        if st.n_groups and st.n_groups % tp and st.n_groups != 1:
            out.append(f"tp {tp} does not divide the linear layers' {st.n_groups} groups")
    return out


def kv_heads_per_gpu(spec: ModelSpec, tp: int = 1) -> int:
    """KV heads each GPU holds per layer: split when tp divides them, one (replicated) when tp exceeds them."""
    return max(1, spec.n_kv_heads // tp)


def kv_replication(spec: ModelSpec, tp: int = 1) -> int:
    """How many GPUs hold a copy of each KV head (or of the MLA latent)."""
    if spec.mla is not None:
        return tp
    return tp * kv_heads_per_gpu(spec, tp) // spec.n_kv_heads if spec.kv_layers else 1


# ----------------------------------------------------------------------------- per token and layer
def layer_token_bytes(spec: ModelSpec, fmt: KVFormat, tp: int = 1) -> int:
    """Bytes one token adds to one KV layer's cache for one sequence, on one GPU of ``tp``."""
    if spec.mla is not None:
        return fmt.vector_bytes(spec.mla.latent_dim)  # one latent, shared by every head, never split
    heads = kv_heads_per_gpu(spec, tp)
    if not fmt.grouped:
        return int(kv_bytes_per_token(1, heads, spec.head_dim, dtype_bytes(fmt.dtype)))
    # Grouped formats carry scales per head vector, so the unit is a whole packed vector:
    # the shared formula with head_dim 1 and that vector's bytes as the element size.
    return int(kv_bytes_per_token(1, heads, 1, fmt.vector_bytes(spec.head_dim)))


def stored_tokens(seq_len: int, window: int | None, use_windows: bool = True, block_size: int | None = None) -> int:
    """Tokens one layer with cap ``window`` (None: full) keeps for one sequence, rounded up to whole blocks when paged."""
    t = min(seq_len, window) if (window is not None and use_windows) else seq_len
    if block_size:
        t = -(-t // block_size) * block_size
    return t


def tokens_held(layer: Layer, seq_len: int, use_windows: bool = True, block_size: int | None = None) -> int:
    """Tokens ``layer`` keeps for one sequence of ``seq_len`` tokens; a linear layer keeps none."""
    if not layer.has_kv:
        return 0
    return stored_tokens(seq_len, layer.span if layer.caps else None, use_windows, block_size)


def token_slots(spec: ModelSpec, seq_len: int, use_windows: bool = True, block_size: int | None = None) -> int:
    """Sum over layers of the tokens each keeps (one sequence); grouped by kind, so O(kinds)."""
    return sum(n * tokens_held(layer, seq_len, use_windows, block_size) for layer, n in spec.layer_counts())


def kv_bytes(spec: ModelSpec, fmt: KVFormat, seq_len: int, sequences: int = 1, use_windows: bool = True,
             block_size: int | None = None, tp: int = 1) -> int:
    """The cache in bytes (on each GPU of ``tp``). Every KV layer has the same width, so it factors exactly."""
    return sequences * layer_token_bytes(spec, fmt, tp) * token_slots(spec, seq_len, use_windows, block_size)


def mha_layer_token_bytes(spec: ModelSpec, fmt: KVFormat) -> int:
    """Per layer per token if every query head kept its own K and V. For MLA this is the naive,
    decompressed cache (K of qk_nope + qk_rope and V of v_head_dim per head), as transformers'
    eager DeepSeek code keeps it."""
    if spec.mla is None:
        return 2 * spec.n_heads * fmt.vector_bytes(spec.head_dim)
    m = spec.mla
    return spec.n_heads * (fmt.vector_bytes(m.qk_nope_head_dim + m.qk_rope_head_dim) + fmt.vector_bytes(m.v_head_dim))


# ----------------------------------------------------------------------------- linear layers' state
def state_layer_bytes(spec: ModelSpec, state_dtype: str, tp: int = 1) -> int:
    """One linear layer's state for one sequence, on one GPU of ``tp``."""
    if spec.state is None:
        return 0
    return spec.state.elements(tp) * dtype_bytes(state_dtype)


def state_bytes(spec: ModelSpec, state_dtype: str, sequences: int = 1, tp: int = 1) -> int:
    """Every linear layer's state, for ``sequences`` sequences; it does not depend on the context."""
    return sequences * spec.linear_layers * state_layer_bytes(spec, state_dtype, tp)


# ----------------------------------------------------------------------------- weights and limits
def weight_bytes(params: int, dtype: str) -> int:
    return -(-params * DTYPE_BITS[dtype] // 8)  # ceil: an odd count of int4 weights still fills a byte


def weights_per_gpu(weights: int, tp: int = 1) -> int:
    """Weights evenly split over ``tp`` GPUs, rounded up (norms and biases are really replicated: bytes)."""
    return -(-weights // tp)


def cache_saturates(spec: ModelSpec, use_windows: bool) -> bool:
    """True when no layer keeps more than a fixed number of tokens: every KV layer sliding or chunked."""
    return use_windows and all(layer.caps or not layer.has_kv for layer, _ in spec.layer_counts())


def max_seq_len_for(spec: ModelSpec, fmt: KVFormat, budget: int, sequences: int, use_windows: bool,
                    block_size: int | None, tp: int = 1) -> int | None:
    """Largest T whose cache fits ``budget`` bytes; None when the cache stops growing and fits."""
    if budget < kv_bytes(spec, fmt, 1, sequences, use_windows, block_size, tp):
        return 0
    if cache_saturates(spec, use_windows):
        cap = max((layer.span or 0 for layer, _ in spec.layer_counts() if layer.caps), default=0)
        if kv_bytes(spec, fmt, cap + (block_size or 0), sequences, use_windows, block_size, tp) <= budget:
            return None  # the cache saturates at the largest span and still fits: any context does
    lo, hi = 1, 2
    while hi < MAX_SEQ_LEN and kv_bytes(spec, fmt, hi, sequences, use_windows, block_size, tp) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # invariant: kv(lo) fits, kv(hi) does not (kv is non-decreasing in T)
        mid = (lo + hi) // 2
        if kv_bytes(spec, fmt, mid, sequences, use_windows, block_size, tp) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


# ----------------------------------------------------------------------------- comparisons and curves
def attention_variants(spec: ModelSpec, req: MemoryRequest) -> list[tuple[str, int]]:
    """The same shape under MHA, GQA, MQA and MLA, at the request's settings: (label, KV bytes).

    For an MLA model the shape is (layers, heads, qk_nope_head_dim), as in the DeepSeek-V2 paper's
    comparison; for the others, MLA uses DeepSeek-V2's ratios d_c = 4 d_h and d_h^R = d_h / 2.
    The layer layout (sliding, chunked, linear layers) is kept.
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
    """KV bytes at each context length, everything else as in ``req`` (whole model, before TP)."""
    fmt = replace(req.kv_format, dtype=dtype) if dtype else req.kv_format
    block = req.block_size if req.paged else None
    return [kv_bytes(spec, fmt, t, req.sequences, req.use_windows, block) for t in contexts]
