"""The calculator's explanations: the formula with the model's numbers substituted, what is and
is not counted, and the human-readable report the CLI prints without --json."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvviz.calculator.formulas import (
    kv_bytes, kv_heads_per_gpu, kv_replication, layer_token_bytes, state_bytes, state_layer_bytes, token_slots,
)
from kvviz.calculator.spec import SCALE_DTYPE_BYTES, MemoryRequest, ModelSpec
from kvviz.units import DTYPE_BITS, GB, GIB, dtype_bytes, fmt_bytes, fmt_usd

if TYPE_CHECKING:  # result.py does not import this module; the annotation alone needs it
    from kvviz.calculator.result import MemoryResult

COUNTED = (
    "K and V (or MLA's latent) for every KV layer, token, sequence and beam, at the chosen dtype",
    "sliding and chunked layers: only the tokens in their window or chunk",
    "linear-attention and Mamba layers: their fixed state (conv + recurrent), reported apart from the KV cache",
    "int8/int4: one scale per group of group_size values (plus a zero point when asked)",
    "paging: each layer's tokens rounded up to whole blocks",
    "tensor parallelism: KV heads split (or replicated) per GPU, weights split evenly",
    "weights: parameters x weight dtype (every expert of an MoE model is resident)",
)
NOT_COUNTED = (
    "activations, logits, CUDA graphs and the CUDA context (that is what the GPU reserve is for)",
    "allocator fragmentation and block-table metadata",
    "fp8: its fp32 scales, K and V per layer (per KV head with per-head scales): 8 bytes per KV layer, "
    "240 B for SmolLM2; kvviz's own fp8 cache counts them (calculator/compressed.py, the Compression lab)",
    "the full-precision residual window some quantized caches keep (e.g. transformers' QuantizedCache)",
    "prefix sharing between beams or requests: each beam holds its own copy",
    "weight quantization scales and layers left in 16-bit by int8/int4 weight schemes",
    "a vision tower or multi-token-prediction head that the config's language model does not load",
)


def _per_layer_line(spec: ModelSpec, req: MemoryRequest, tp: int) -> str:
    fmt = req.kv_format
    bits = DTYPE_BITS[fmt.dtype]
    vec = fmt.vector_bytes(spec.mla.latent_dim if spec.mla else spec.head_dim)
    per_layer = layer_token_bytes(spec, fmt, tp)
    if spec.mla:
        m = spec.mla
        size = ("" if fmt.grouped else
                f" = ({m.kv_lora_rank} kv_lora_rank + {m.qk_rope_head_dim} qk_rope_head_dim) x {bits // 8} B ({fmt.dtype})")
        return f"per layer per token = 1 MLA latent{size} = {per_layer:,} B"
    size = f"{vec:,} B" if fmt.grouped else f"{spec.head_dim} head_dim x {bits // 8} B ({fmt.dtype})"
    heads = kv_heads_per_gpu(spec, tp)
    what = "KV heads" if heads != 1 or tp == 1 else "KV head"
    where = "" if tp == 1 else " per GPU"
    return f"per layer per token{where} = 2 (K, V) x {heads} {what} x {size} = {per_layer:,} B"


def _state_lines(spec: ModelSpec, req: MemoryRequest) -> list[str]:
    st, sdt = spec.state, req.resolved_state_dtype
    if st is None or not spec.linear_layers:
        return []
    b = dtype_bytes(sdt)
    conv = f"conv {st.conv_channels:,}" + (f" + {st.n_groups} x {st.group_channels}" if st.n_groups else "")
    one = state_layer_bytes(spec, sdt)
    total = state_bytes(spec, sdt, req.sequences)
    lines = [f"state per linear layer per sequence ({st.kind}) = ({conv} channels x {st.conv_width} past inputs "
             f"+ {st.heads:,} heads x {st.head_k} x {st.head_v}) x {b} B ({sdt}) = {one:,} B",
             f"state total = {one:,} B x {spec.linear_layers} linear layers x {req.sequences:,} sequences = {total:,} B "
             f"(fixed: it does not grow with the context; not part of the KV cache)"]
    if req.tp > 1:
        lines.append(f"state per GPU = {state_bytes(spec, sdt, req.sequences, req.tp):,} B (channels and heads / {req.tp})")
    return lines


def formula_lines(spec: ModelSpec, req: MemoryRequest) -> list[str]:
    """The arithmetic with this model's numbers substituted, one step per line."""
    fmt = req.kv_format
    bits = DTYPE_BITS[fmt.dtype]
    width = spec.mla.latent_dim if spec.mla else spec.head_dim
    per_layer = layer_token_bytes(spec, fmt)
    lines: list[str] = []
    if fmt.grouped:
        sb = SCALE_DTYPE_BYTES[fmt.scale_dtype] * (2 if fmt.zero_point else 1)
        what = "scale + zero point" if fmt.zero_point else "scale"
        lines.append(f"one vector of {width} values = ceil({width} x {bits} bits / 8) B + ceil({width} / "
                     f"{fmt.group_size}) groups x {sb} B {what} = {fmt.vector_bytes(width):,} B")
    lines.append(_per_layer_line(spec, req, 1))
    kv_layers, linear = spec.kv_layers, spec.linear_layers
    layers = f"{kv_layers} layers" if not linear else f"{kv_layers} KV layers ({linear} linear layers keep no KV)"
    lines.append(f"per token = {per_layer:,} B x {layers} = {per_layer * kv_layers:,} B")
    block = req.block_size if req.paged else None
    counts = [(layer, n) for layer, n in spec.layer_counts() if layer.has_kv]
    terms = []
    for layer, n in counts:
        capped = layer.caps and req.use_windows
        t = f"min({req.seq_len:,}, {layer.span:,})" if capped else f"{req.seq_len:,}"
        if block:
            t = f"ceil({t} / {block}) x {block}"
        terms.append(f"{n} x {t}" if len(counts) > 1 else t)
    slots = token_slots(spec, req.seq_len, req.use_windows, block)
    mult = f" x {req.batch:,} batch x {req.beams} beam{'s' if req.beams != 1 else ''}"
    total = kv_bytes(spec, fmt, req.seq_len, req.sequences, req.use_windows, block)
    if len(counts) > 1:
        lines.append(f"token-layers = {' + '.join(terms)} = {slots:,}")
        lines.append(f"KV total = {per_layer:,} B x {slots:,}{mult} = {total:,} B = {total / GIB:,.2f} GiB "
                     f"({total / GB:,.2f} GB)")
    elif counts:
        lines.append(f"KV total = {per_layer * kv_layers:,} B x {terms[0]} tokens{mult} = {total:,} B = "
                     f"{total / GIB:,.2f} GiB ({total / GB:,.2f} GB)")
    else:
        lines.append("KV total = 0 B (no layer keeps K/V)")
    if req.tp > 1 and counts:
        lines += _tp_lines(spec, req, block)
    return lines + _state_lines(spec, req)


def _tp_lines(spec: ModelSpec, req: MemoryRequest, block: int | None) -> list[str]:
    tp, fmt = req.tp, req.kv_format
    gpu = kv_bytes(spec, fmt, req.seq_len, req.sequences, req.use_windows, block, tp)
    if spec.mla:
        head = f"tensor parallel {tp}: the MLA latent has no heads to split, so every GPU holds all of it"
    elif spec.n_kv_heads >= tp:
        head = (f"tensor parallel {tp}: {spec.n_kv_heads} KV heads / {tp} GPUs = {kv_heads_per_gpu(spec, tp)} "
                f"per GPU")
    else:
        head = (f"tensor parallel {tp} > {spec.n_kv_heads} KV heads: 1 KV head per GPU, each head replicated "
                f"{kv_replication(spec, tp)}x")
    return [head, _per_layer_line(spec, req, tp),
            f"KV per GPU = {layer_token_bytes(spec, fmt, tp):,} B x "
            f"{token_slots(spec, req.seq_len, req.use_windows, block):,} token-layers x {req.sequences:,} sequences "
            f"= {gpu:,} B = {gpu / GIB:,.2f} GiB"]


def no_cost_reason(res: "MemoryResult") -> str | None:
    """Why the roofline's tokens/s and $ are no figures for this request, or None when they are.

    A request that does not fit on the GPU never runs: its roofline (30 tokens/s, $23 per 1M
    tokens) would price a run that cannot start, so the page and the CLI show "—" and this reason.
    """
    f = res.fit
    if f is None or f.fits:
        return None
    r = res.request
    why = next((w for w in res.warnings if "fit" in w), "it does not fit on this GPU").removeprefix("does not fit: ")
    if f.max_batch < 1:
        return f"nothing fits: {why}"
    return (f"batch {r.batch:,} does not fit ({why}); at most {f.max_batch:,} request"
            f"{'s' if f.max_batch != 1 else ''} fit at this context")


def _both(n: int | None) -> str:
    return fmt_bytes(n, both_units=True)  # '1.00 GiB (1.07 GB)': readers mix GB and GiB


def summary_text(res: "MemoryResult") -> str:
    """The report: shape, settings, each figure in both units, the fit, the formula, notes and warnings."""
    s, r = res.spec, res.request
    lines = [
        f"{s.name}: {s.attention}, {s.n_layers} layers, {s.n_heads} heads"
        + ("" if s.mla else f", {s.n_kv_heads} KV heads") + f", head_dim {s.head_dim}",
        f"context {r.seq_len:,} x batch {r.batch:,} x beams {r.beams}, KV {r.kv_dtype}, weights {r.weight_dtype}",
        f"KV per token:  {_both(res.kv_bytes_per_token)}",
        f"KV total:      {_both(res.kv_bytes)}",
    ]
    if len(res.layers) > 1:
        for g in res.layers:
            what = {"sliding": f"sliding (window {g.span or 0:,})", "chunked": f"chunked (chunk {g.span or 0:,})"}
            if g.kind == "linear":
                held = f"state {_both(g.state_bytes)}"
            else:
                held = f"{g.tokens_held:,} tokens each, {_both(g.bytes)}"
            lines.append(f"  {g.count:>4} {what.get(g.kind, g.kind)} layers: {held}")
    if res.state_bytes:
        lines.append(f"state:         {_both(res.state_bytes)} ({r.resolved_state_dtype}; not in the KV total)")
    if r.paged:
        lines.append(f"paging waste:  {_both(res.paging_waste_bytes)} (block {r.block_size})")
    lines.append(f"weights:       {_both(res.weights_bytes)} ({res.params_source})")
    lines.append(f"total:         {_both(res.total_bytes)}")
    if r.tp > 1:
        lines.append(f"per GPU (tp {r.tp}): KV {_both(res.kv_bytes_per_gpu)}, weights {_both(res.weights_bytes_per_gpu)}"
                     + (f", state {_both(res.state_bytes_per_gpu)}" if res.state_bytes else ""))
    if res.fit is not None:
        f = res.fit
        mt = "unbounded (every layer windowed)" if f.max_seq_len is None else f"{f.max_seq_len:,}"
        each = " each" if r.tp > 1 else ""
        lines.append(f"GPU {r.gpu_gib:g} GiB{each}, {r.reserve:.0%} reserved: {'fits' if f.fits else 'does NOT fit'}; "
                     f"max batch at this context {f.max_batch:,}; max context at this batch {mt}")
    if res.cost is not None:
        c = res.cost
        price = "" if c.usd_per_million_tokens is None else f", {fmt_usd(c.usd_per_million_tokens)} per 1M output tokens"
        why = no_cost_reason(res)
        if why:  # a roofline for a run that cannot start is no figure
            lines.append(f"decode roofline: — tokens/s, — per 1M output tokens ({why})")
        else:
            lines.append(f"decode roofline (upper bound): {c.tokens_per_s:,.1f} tokens/s{price}")
    lines.append("formula:")
    lines += [f"  {ln}" for ln in res.formula]
    if res.cost is not None:
        lines += [f"  {ln}" for ln in res.cost.formula]
    lines += [f"note: {n}" for n in s.notes]
    lines += [f"warning: {w}" for w in res.warnings]
    return "\n".join(lines)
