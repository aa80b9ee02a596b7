"""The calculator's vocabulary: a model's shape (ModelSpec, with a kind for every layer), one
calculation's settings (MemoryRequest) and the errors a user can cause. Results live in result.py.

Pure data, validated where it is built: everything downstream may assume sane integers.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from kvviz.units import DTYPE_BITS

DTYPES: tuple[str, ...] = tuple(DTYPE_BITS)
GROUPED_DTYPES = frozenset({"int8", "int4"})  # integer formats need per-group scales to be usable
SCALE_DTYPE_BYTES: dict[str, int] = {"fp16": 2, "bf16": 2, "fp32": 4}
# Nominal GPU sizes. The label is read as GiB: an "80 GB" A100 has 81,920 MiB = 80 GiB.
GPU_PRESETS_GIB: tuple[int, ...] = (16, 24, 40, 48, 80, 94, 141)
DEFAULT_BLOCK_SIZE = 16  # vLLM's default block (page) size in tokens
DEFAULT_GROUP_SIZE = 64
DEFAULT_RESERVE = 0.10  # vLLM's default gpu_memory_utilization=0.9 leaves 10% free
DEFAULT_EFFICIENCY = 0.7  # share of peak bandwidth a good decode kernel sustains (the roofline's MBU)
STATE_DTYPES: tuple[str, ...] = ("auto", "fp32", "fp16", "bf16")  # auto: the model's float dtype, as vLLM
MAX_TP = 1024

# Sanity bounds: far above any real model, low enough that nothing here loops for long.
MAX_LAYERS = 10_000
MAX_DIM = 10_000_000
MAX_SEQ_LEN = 1 << 40
MAX_BATCH = 1 << 30
MAX_BEAMS = 4096  # parallel samples per request
MAX_GROUP_SIZE = 1 << 20  # values per quantization scale
MAX_BLOCK_SIZE = 1 << 20  # tokens per paging block


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


# What each layer keeps for one sequence of T tokens:
#   full: T tokens; sliding (window W) and chunked (chunk C): min(T, W or C) tokens;
#   linear (linear attention / Mamba): no KV at all, a fixed-size recurrent state instead.
LAYER_KINDS: tuple[str, ...] = ("full", "sliding", "chunked", "linear")


@dataclass(frozen=True)
class Layer:
    """One layer's attention kind and, for sliding and chunked layers, its span in tokens."""

    kind: str = "full"
    span: int | None = None  # the sliding window or the chunk size; None for full and linear
    sinks: int = 0  # a StreamingLLM cache window: of the span, these first positions are kept forever

    @property
    def caps(self) -> bool:
        """Whether the tokens it keeps stop growing at ``span``."""
        return self.kind in ("sliding", "chunked")

    @property
    def has_kv(self) -> bool:
        return self.kind != "linear"

    def label(self) -> str:
        if self.kind == "sliding" and self.sinks:
            return f"sliding (window {self.span - self.sinks:,} + {self.sinks:,} sinks)"
        if self.kind == "sliding":
            return f"sliding (window {self.span:,})"
        if self.kind == "chunked":
            return f"chunked (chunk {self.span:,})"
        return self.kind


FULL = Layer("full")


@dataclass(frozen=True)
class StateShape:
    """The fixed per-sequence state of one linear-attention or Mamba layer (it never grows with T).

    Two buffers, as vLLM allocates them: the causal conv's last (kernel - 1) inputs per channel,
    and the recurrent state of ``heads`` x ``head_k`` x ``head_v`` values. Tensor parallelism
    splits the channels and heads; Mamba2's B/C groups are split only when TP divides them and
    are otherwise replicated (one group per GPU, vLLM's rule for n_groups = 1).
    """

    kind: str  # "gated_deltanet" (Qwen3-Next), "mamba" (Mamba1: Jamba), "mamba2"
    conv_channels: int  # conv channels split across GPUs
    conv_width: int  # kernel - 1 past inputs kept per channel
    heads: int  # recurrent heads (Mamba1: channels), split across GPUs
    head_k: int  # each head's state is head_k x head_v values
    head_v: int
    n_groups: int = 0  # mamba2: B/C groups, each adding group_channels conv channels
    group_channels: int = 0  # mamba2: 2 x d_state per group (B and C)
    split: tuple[tuple[str, int], ...] = ()  # (config field, count) that TP must divide

    def groups_per_gpu(self, tp: int) -> int:
        if not self.n_groups:
            return 0
        return self.n_groups // tp if self.n_groups % tp == 0 else 1  # replicated when TP does not divide

    def conv_elements(self, tp: int = 1) -> int:
        return (self.conv_channels // tp + self.groups_per_gpu(tp) * self.group_channels) * self.conv_width

    def recurrent_elements(self, tp: int = 1) -> int:
        return (self.heads // tp) * self.head_k * self.head_v

    def elements(self, tp: int = 1) -> int:
        return self.conv_elements(tp) + self.recurrent_elements(tp)


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
    layers: tuple[Layer, ...] = ()  # one per layer; () = every layer full
    mla: MLA | None = None
    state: StateShape | None = None  # the shape of every linear layer's state (None: no linear layers)
    params: int | None = None  # parameter count, when known
    params_note: str = ""  # where the count came from
    active_params: int | None = None  # MoE: parameters used per token
    vocab_size: int | None = None
    source: str = ""  # URL of the config.json it came from
    key: str = ""  # preset key, when it is a preset
    notes: tuple[str, ...] = ()  # what the parser decided and why
    provenance: tuple[tuple[str, str], ...] = ()  # (figure, the config field or class default it came from)
    kv_shared_layers: int = 0  # Gemma 3n / Gemma 4 num_kv_shared_layers: the last N reuse earlier layers' K/V

    def own_kv(self, i: int) -> bool:
        """Whether layer i allocates K/V of its own in an engine: not linear, and not one of the last
        ``kv_shared_layers`` that read an earlier layer's cache (llama.cpp's has_kv, vLLM's kv sharing)."""
        return self.layer(i).has_kv and i < self.n_layers - self.kv_shared_layers

    @property
    def attention(self) -> str:
        if self.mla is not None:
            return "MLA"
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"

    def layer(self, i: int) -> Layer:
        return self.layers[i] if self.layers else FULL

    def layer_counts(self) -> list[tuple[Layer, int]]:
        """(layer, how many) in a stable order: sliding and chunked by span, then full, then linear.
        Grouping makes every sum O(kinds), not O(layers)."""
        counts = Counter(self.layers or (FULL,) * self.n_layers)
        order = {"sliding": 0, "chunked": 1, "full": 2, "linear": 3}
        return sorted(counts.items(), key=lambda kv: (order[kv[0].kind], kv[0].span or 0))

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per layer: the span that caps its tokens (sliding window or chunk), None otherwise;
        () when no layer is capped."""
        if not any(layer.caps for layer in self.layers):
            return ()
        return tuple(layer.span if layer.caps else None for layer in self.layers)

    @property
    def has_windows(self) -> bool:
        return any(layer.caps for layer in self.layers)

    @property
    def kv_layers(self) -> int:
        """Layers that keep K/V (every kind but linear)."""
        return sum(n for layer, n in self.layer_counts() if layer.has_kv)

    @property
    def linear_layers(self) -> int:
        return self.n_layers - self.kv_layers

    def window_summary(self) -> str:
        counts = self.layer_counts()
        if [layer.kind for layer, _ in counts] == ["full"]:
            return "none (every layer global)"
        parts = []
        for layer, n in counts:
            if layer.kind == "sliding" and layer.sinks:
                parts.append(f"{n} layers x ({layer.span - layer.sinks:,} + {layer.sinks:,} sinks)")
            elif layer.kind == "sliding":
                parts.append(f"{n} layers x {layer.span:,}")
            elif layer.kind == "chunked":
                parts.append(f"{n} chunked layers x {layer.span:,}")
            elif layer.kind == "full":
                parts.append(f"{n} global layers")
            else:
                parts.append(f"{n} linear layers (no KV)")
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
    gpu_gib: float | None = None  # GPU memory in GiB (each GPU, under TP); None = no fit check
    reserve: float = DEFAULT_RESERVE  # fraction of the GPU kept free (CUDA context, activations)
    tp: int = 1  # tensor-parallel GPUs: KV heads, state heads and weights split across them
    state_dtype: str = "auto"  # linear layers' state: auto = the weight dtype when it is a float, else bf16
    bandwidth_gbs: float | None = None  # peak memory bandwidth of one GPU, GB/s (decimal); None = no cost
    efficiency: float = DEFAULT_EFFICIENCY  # achieved / peak bandwidth in the roofline
    price_per_gpu_hour: float | None = None  # $ per GPU-hour; None = throughput only

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

    @property
    def resolved_state_dtype(self) -> str:
        if self.state_dtype != "auto":
            return self.state_dtype
        return self.weight_dtype if self.weight_dtype in ("fp32", "fp16", "bf16") else "bf16"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v))


def request_problems(r: MemoryRequest) -> list[str]:
    """Every problem with a request, as sentences; empty when it is valid."""
    out: list[str] = []
    for name, hi in (("seq_len", MAX_SEQ_LEN), ("batch", MAX_BATCH), ("beams", MAX_BEAMS),
                     ("group_size", MAX_GROUP_SIZE), ("block_size", MAX_BLOCK_SIZE)):
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
    if not is_int(r.tp) or not 1 <= r.tp <= MAX_TP:
        out.append(f"tp must be an integer from 1 to {MAX_TP:,} (got {r.tp!r})")
    if r.state_dtype not in STATE_DTYPES:
        out.append(f"state_dtype must be one of {', '.join(STATE_DTYPES)} (got {r.state_dtype!r})")
    if r.bandwidth_gbs is not None and (not _is_number(r.bandwidth_gbs) or not 0 < r.bandwidth_gbs <= 1e6):
        out.append(f"bandwidth_gbs must be a positive number of GB/s (got {r.bandwidth_gbs!r})")
    if not _is_number(r.efficiency) or not 0 < r.efficiency <= 1:
        out.append(f"efficiency must be a fraction in (0, 1] (got {r.efficiency!r})")
    if r.price_per_gpu_hour is not None and (not _is_number(r.price_per_gpu_hour)
                                             or not 0 <= r.price_per_gpu_hour <= 1e6):
        out.append(f"price_per_gpu_hour must be a number of dollars >= 0 (got {r.price_per_gpu_hour!r})")
    return out
