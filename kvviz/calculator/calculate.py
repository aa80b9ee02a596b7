"""One calculation: a ModelSpec and a MemoryRequest in, a MemoryResult out (cache, state, weights,
tensor-parallel split, GPU fit, cost and the formula that produced them)."""
from __future__ import annotations

from kvviz.calculator.cost import request_cost
from kvviz.calculator.formulas import (
    kv_bytes, kv_heads_per_gpu, kv_replication, layer_token_bytes, max_seq_len_for, mha_layer_token_bytes,
    state_bytes, state_layer_bytes, token_slots, tokens_held, tp_problems, weight_bytes, weights_per_gpu,
)
from kvviz.calculator.report import COUNTED, NOT_COUNTED, formula_lines
from kvviz.calculator.result import Fit, LayerGroup, MemoryResult
from kvviz.calculator.spec import MAX_BATCH, CalcError, MemoryRequest, ModelSpec
from kvviz.units import GIB


def layer_groups(spec: ModelSpec, req: MemoryRequest) -> tuple[LayerGroup, ...]:
    """The per-kind breakdown: what each group of layers holds at the request's context."""
    fmt, block, seqs = req.kv_format, (req.block_size if req.paged else None), req.sequences
    per_layer, per_layer_gpu = layer_token_bytes(spec, fmt), layer_token_bytes(spec, fmt, req.tp)
    per_state = state_layer_bytes(spec, req.resolved_state_dtype)
    out = []
    for layer, n in spec.layer_counts():
        held = tokens_held(layer, req.seq_len, req.use_windows, block)
        kind = "mla" if (spec.mla is not None and layer.kind == "full") else layer.kind
        out.append(LayerGroup(kind, layer.span, n, held, seqs * n * held * per_layer, seqs * n * held * per_layer_gpu,
                              0 if layer.has_kv else seqs * n * per_state))
    return tuple(out)


def _fit(spec: ModelSpec, req: MemoryRequest, weights_gpu: int | None, kv_gpu: int, state_gpu: int,
         warnings: list[str]) -> Fit | None:
    """Per GPU: weights + KV + state against the usable memory, and how far batch and context stretch."""
    if req.gpu_gib is None:
        return None
    fmt, block, tp = req.kv_format, (req.block_size if req.paged else None), req.tp
    gpu = int(round(req.gpu_gib * GIB))
    usable = int(gpu * (1 - req.reserve))
    w = weights_gpu or 0
    need = w + kv_gpu + state_gpu
    budget = usable - w
    per_request = (kv_bytes(spec, fmt, req.seq_len, req.beams, req.use_windows, block, tp)
                   + state_bytes(spec, req.resolved_state_dtype, req.beams, tp))
    max_batch = min(max(budget, 0) // per_request, MAX_BATCH) if per_request else (MAX_BATCH if budget >= 0 else 0)
    kv_budget = budget - state_gpu  # the state does not grow with the context
    max_t = max_seq_len_for(spec, fmt, kv_budget, req.sequences, req.use_windows, block, tp) if kv_budget > 0 else 0
    each = " on each GPU" if tp > 1 else ""
    if weights_gpu is not None and weights_gpu > usable:
        warnings.append(f"the weights alone ({weights_gpu / GIB:,.2f} GiB{each}) do not fit in the usable "
                        f"{usable / GIB:,.2f} GiB of this GPU")
    elif need > usable:
        warnings.append(f"does not fit: needs {need / GIB:,.2f} GiB{each}, the GPU has {usable / GIB:,.2f} GiB usable")
    return Fit(gpu, usable, need <= usable, usable - need, max_batch, max_t)


def calculate(spec: ModelSpec, req: MemoryRequest) -> MemoryResult:
    """KV cache, linear state, weights, per-GPU split, GPU fit and cost for one model and one request."""
    problems = tp_problems(spec, req.tp)
    if problems:
        raise CalcError(problems)
    fmt, block, seqs, tp = req.kv_format, (req.block_size if req.paged else None), req.sequences, req.tp
    sdt = req.resolved_state_dtype
    per_layer = layer_token_bytes(spec, fmt)
    kv_unpaged = kv_bytes(spec, fmt, req.seq_len, seqs, req.use_windows, None)
    kv = kv_bytes(spec, fmt, req.seq_len, seqs, req.use_windows, block)
    kv_gpu = kv_bytes(spec, fmt, req.seq_len, seqs, req.use_windows, block, tp)
    kv_mha = seqs * mha_layer_token_bytes(spec, fmt) * token_slots(spec, req.seq_len, req.use_windows, block)
    state, state_gpu = state_bytes(spec, sdt, seqs), state_bytes(spec, sdt, seqs, tp)
    replication = kv_replication(spec, tp)

    warnings: list[str] = []
    if spec.max_positions is not None and req.seq_len > spec.max_positions:
        warnings.append(f"seq_len {req.seq_len:,} is beyond this model's max_position_embeddings "
                        f"({spec.max_positions:,}): computed anyway, but the model was not trained that long")
    if not req.use_windows and spec.has_windows:
        warnings.append("sliding windows and chunks ignored: every KV layer keeps every token (as a runtime "
                        "without window support would)")
    if tp > 1 and spec.mla is not None:
        warnings.append(f"MLA's latent is not split by tensor parallelism: each of the {tp} GPUs holds the whole "
                        f"latent cache ({tp} copies)")
    elif replication > 1:
        warnings.append(f"KV heads replicated {replication}x: tp {tp} is more than the {spec.n_kv_heads} KV heads, "
                        f"so each GPU holds 1 head and every head is stored on {replication} GPUs")

    if req.params is not None:
        params, psrc = req.params, "entered by the user"
    else:
        params, psrc = spec.params, spec.params_note
    weights = weight_bytes(params, req.weight_dtype) if params is not None else None
    weights_gpu = weights_per_gpu(weights, tp) if weights is not None else None
    if weights is None:
        warnings.append("weights unknown for this config: enter a parameter count (--params) to include them")
    total = kv + state + weights if weights is not None else None
    fit = _fit(spec, req, weights_gpu, kv_gpu, state_gpu, warnings)
    cost = request_cost(spec, req, weights)
    if req.bandwidth_gbs is not None and cost is None:
        warnings.append("no cost per token without the weights: enter a parameter count")

    return MemoryResult(
        spec=spec, request=req, layer_token_bytes=per_layer, kv_bytes_per_token=per_layer * spec.kv_layers,
        kv_bytes=kv, kv_bytes_unpaged=kv_unpaged, paging_waste_bytes=kv - kv_unpaged, kv_bytes_mha=kv_mha,
        layers=layer_groups(spec, req), state_bytes=state,
        kv_heads_per_gpu=None if (spec.mla is not None or not spec.kv_layers) else kv_heads_per_gpu(spec, tp),
        kv_head_replication=replication, kv_bytes_per_gpu=kv_gpu, state_bytes_per_gpu=state_gpu,
        weights_bytes=weights, weights_bytes_per_gpu=weights_gpu, params=params,
        params_source=psrc if params is not None else "unknown", total_bytes=total, fit=fit, cost=cost,
        formula=tuple(formula_lines(spec, req)), warnings=tuple(warnings), counted=COUNTED, not_counted=NOT_COUNTED,
    )
