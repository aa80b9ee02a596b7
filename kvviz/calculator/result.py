"""What a calculation returns: the cache, per layer kind and per GPU, the weights, the fit and the cost.

Plain frozen dataclasses; ``to_dict`` is the CLI's JSON contract.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvviz.calculator.spec import GROUPED_DTYPES, MemoryRequest, ModelSpec
from kvviz.units import GB, GIB


@dataclass(frozen=True)
class Fit:
    """Whether weights + KV (+ state) fit on each GPU, and how far the settings could stretch."""

    gpu_bytes: int
    usable_bytes: int  # gpu_bytes minus the reserve
    fits: bool
    headroom_bytes: int  # usable - needed per GPU (negative when it does not fit)
    max_batch: int  # requests at the chosen context (each with `beams` sequences)
    max_seq_len: int | None  # at the chosen batch; None = unbounded (the cache stops growing)

    def to_dict(self) -> dict[str, Any]:
        return {"gpu_bytes": self.gpu_bytes, "usable_bytes": self.usable_bytes, "fits": self.fits,
                "headroom_bytes": self.headroom_bytes, "max_batch": self.max_batch,
                "max_seq_len": self.max_seq_len}


@dataclass(frozen=True)
class LayerGroup:
    """Layers of one kind (and span) and what they hold at the request's context."""

    kind: str  # full, sliding, chunked, linear; "mla" for MLA's full-context latent layers
    span: int | None  # window or chunk size
    count: int
    tokens_held: int  # per layer and sequence (rounded up to whole blocks when paged); 0 for linear
    bytes: int  # KV of these layers, all sequences, the whole model (0 for linear)
    bytes_per_gpu: int
    state_bytes: int  # linear layers' fixed state, all sequences, the whole model

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "span": self.span, "count": self.count, "tokens_held": self.tokens_held,
                "bytes": self.bytes, "bytes_per_gpu": self.bytes_per_gpu, "state_bytes": self.state_bytes}


@dataclass(frozen=True)
class Cost:
    """The decode roofline: one step reads each GPU's weights and every sequence's KV + state once.

    An upper bound on throughput (a lower bound on cost): compute, launches, the prefill and
    scheduling are left out, and an MoE model's weights are counted whole.
    """

    bandwidth_bytes_per_s: float  # peak, per GPU
    efficiency: float
    sequences: int
    bytes_per_step: int  # per GPU
    step_s: float
    tokens_per_s: float  # all GPUs together: one token per sequence per step
    price_per_gpu_hour: float | None
    usd_per_million_tokens: float | None
    formula: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "efficiency": self.efficiency,
                "sequences": self.sequences, "bytes_per_step_per_gpu": self.bytes_per_step, "step_s": self.step_s,
                "tokens_per_s": self.tokens_per_s, "price_per_gpu_hour": self.price_per_gpu_hour,
                "usd_per_million_tokens": self.usd_per_million_tokens, "formula": list(self.formula),
                "kind": "upper-bound estimate (bandwidth roofline)"}


@dataclass(frozen=True)
class MemoryResult:
    spec: ModelSpec
    request: MemoryRequest
    layer_token_bytes: int  # one token, one KV layer, one sequence (whole model, before TP)
    kv_bytes_per_token: int  # one token, all KV layers, one sequence (before any window cap)
    kv_bytes: int  # the whole cache: every layer, sequence and token (paged when asked), before TP
    kv_bytes_unpaged: int
    paging_waste_bytes: int  # kv_bytes - kv_bytes_unpaged
    kv_bytes_mha: int  # the same cache if every query head had its own K/V (naive per-head for MLA)
    layers: tuple[LayerGroup, ...]
    state_bytes: int  # linear layers' fixed state, all sequences (not part of kv_bytes)
    kv_heads_per_gpu: int | None  # None under MLA (the latent is not split) or with no KV layers
    kv_head_replication: int  # copies of each KV head (or MLA latent) across the TP group
    kv_bytes_per_gpu: int
    state_bytes_per_gpu: int
    weights_bytes: int | None
    weights_bytes_per_gpu: int | None
    params: int | None
    params_source: str
    total_bytes: int | None  # weights + KV + state, before TP
    fit: Fit | None  # per GPU
    cost: Cost | None
    formula: tuple[str, ...]
    warnings: tuple[str, ...]
    counted: tuple[str, ...]
    not_counted: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        s, r = self.spec, self.request
        grouped = r.kv_dtype in GROUPED_DTYPES
        return {
            "model": s.name, "preset": s.key or None, "source": s.source or None, "model_type": s.model_type,
            "attention": s.attention, "n_layers": s.n_layers, "n_heads": s.n_heads,
            "n_kv_heads": None if s.mla else s.n_kv_heads, "head_dim": s.head_dim, "hidden_size": s.hidden,
            "mla": None if s.mla is None else {"kv_lora_rank": s.mla.kv_lora_rank,
                                               "qk_rope_head_dim": s.mla.qk_rope_head_dim},
            "max_position_embeddings": s.max_positions, "sliding_windows": s.window_summary(),
            "seq_len": r.seq_len, "batch": r.batch, "beams": r.beams, "sequences": r.sequences,
            "dtype": r.kv_dtype, "weight_dtype": r.weight_dtype,
            "group_size": r.group_size if grouped else None, "scale_dtype": r.scale_dtype if grouped else None,
            "zero_point": r.zero_point if grouped else None,
            "paged": r.paged, "block_size": r.block_size if r.paged else None, "use_windows": r.use_windows,
            "kv_bytes_per_token_per_layer": self.layer_token_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token, "kv_bytes": self.kv_bytes,
            "kv_bytes_unpaged": self.kv_bytes_unpaged, "paging_waste_bytes": self.paging_waste_bytes,
            "kv_bytes_mha": self.kv_bytes_mha,
            "layers": [g.to_dict() for g in self.layers],
            "state_bytes": self.state_bytes, "state_dtype": r.resolved_state_dtype if s.state else None,
            "tp": r.tp, "kv_heads_per_gpu": self.kv_heads_per_gpu, "kv_head_replication": self.kv_head_replication,
            "kv_bytes_per_gpu": self.kv_bytes_per_gpu, "state_bytes_per_gpu": self.state_bytes_per_gpu,
            "params": self.params, "params_source": self.params_source,
            "active_params": s.active_params, "weights_bytes": self.weights_bytes,
            "weights_bytes_per_gpu": self.weights_bytes_per_gpu, "total_bytes": self.total_bytes,
            "kv_gib": self.kv_bytes / GIB, "kv_gb": self.kv_bytes / GB,
            "gpu": None if self.fit is None else {"gib": r.gpu_gib, "reserve": r.reserve, **self.fit.to_dict()},
            "cost": None if self.cost is None else self.cost.to_dict(),
            "formula": list(self.formula), "counted": list(self.counted), "not_counted": list(self.not_counted),
            "notes": list(s.notes), "warnings": list(self.warnings), "provenance": dict(s.provenance),
        }
