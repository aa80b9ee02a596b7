"""The calculator page's panels below the headline numbers: the per-layer strip, the memory charts,
the cost per token from the decode roofline, and the gap between this estimate and a real engine.

Figures come from kvviz.charts.calculator_charts and numbers from kvviz.calculator; this module lays them out.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Any

import streamlit as st

from kvviz.charts import calculator_charts as charts
from kvviz.calculator import (
    DTYPES, GIB, CalcError, MemoryRequest, MemoryResult, ModelSpec, attention_variants, batch_steps, calculate,
    context_curve,
    cost_curve, kv_bytes, layer_token_bytes, no_cost_reason, state_bytes, state_layer_bytes, tokens_held,
)

from kvviz.ui.pages.calculator.calculator_measured import measure_caches
from kvviz.ui.common.plain_text import md_plain
from kvviz.units import fmt_bytes, fmt_usd
from kvviz.ui.common.figs import show
from kvviz.ui.common.frames import safe_frame
from kvviz.ui.state import persist, session

MAX_STRIP_LAYERS = 2000  # a bar per layer; past this the strip shows the first layers only


# ----------------------------------------------------------------------------- per-layer strip
def layer_strip(spec: ModelSpec, res: MemoryResult) -> None:
    """Which layers are full, sliding, chunked or linear, and what each holds at the context."""
    r = res.request
    block = r.block_size if r.paged else None
    per_kv = layer_token_bytes(spec, r.kv_format)
    per_state = state_layer_bytes(spec, r.resolved_state_dtype)
    bars = []
    for i in range(min(spec.n_layers, MAX_STRIP_LAYERS)):
        layer = spec.layer(i)
        t = tokens_held(layer, r.seq_len, r.use_windows, block)
        kind = "mla" if (spec.mla is not None and layer.kind == "full") else layer.kind
        b = r.sequences * (t * per_kv if layer.has_kv else per_state)
        bars.append(charts.LayerBar(i, kind, layer.label() + (" (MLA latent)" if kind == "mla" else ""), t, b))
    st.subheader("Per-layer layout")
    show(st, charts.layer_strip(bars, f"What each layer holds at {r.seq_len:,} tokens "
                                             f"({r.sequences:,} sequence{'s' if r.sequences != 1 else ''})"),
                    key="mem_chart_layers")
    rows = [{"kind": g.kind, "window or chunk": g.span, "layers": g.count, "tokens held (each)": g.tokens_held,
             "KV bytes": g.bytes, "KV bytes per GPU": g.bytes_per_gpu, "state bytes": g.state_bytes}
            for g in res.layers]
    st.dataframe(safe_frame(rows), hide_index=True, key="mem_layers_table")
    if spec.n_layers > MAX_STRIP_LAYERS:
        st.caption(f"The strip shows the first {MAX_STRIP_LAYERS:,} of {spec.n_layers:,} layers; the table counts all.")


# ----------------------------------------------------------------------------- memory charts
def _contexts(seq_len: int) -> list[int]:
    hi = max(8192, 1 << math.ceil(math.log2(2 * seq_len)))
    return sorted({1 << k for k in range(7, int(math.log2(hi)) + 1)} | {seq_len})


def memory_charts(spec: ModelSpec, req: MemoryRequest, res: MemoryResult,
                  compared: list[tuple[ModelSpec, MemoryResult]], presets: dict[str, ModelSpec]) -> None:
    st.subheader("Charts")
    c1, c2, c3, c4 = st.columns([3, 2, 1, 1])
    c1.multiselect("Compare with", list(presets), default=persist.now("mem_compare"), key="mem_compare",
                   persist_state="session",
                   format_func=lambda k: presets[k].name)
    c2.multiselect("Dtypes to plot", DTYPES, default=persist.now("mem_chart_dtypes"), key="mem_chart_dtypes",
                   persist_state="session")
    c3.checkbox("Log axes", value=persist.now("mem_log", bool), key="mem_log", persist_state="session")
    c4.checkbox("Add weights", value=persist.now("mem_chart_weights", bool), key="mem_chart_weights",
                persist_state="session")
    dtypes = session.read("mem_chart_dtypes") or [req.kv_dtype]
    add_w = session.read("mem_chart_weights")
    ctx = _contexts(req.seq_len)
    curves = []
    for m, r in compared:
        base = (r.weights_bytes or 0) if add_w else 0
        for dt in dtypes:
            ys = context_curve(m, r.request, ctx, dtype=dt)
            curves.append(charts.Curve(f"{m.name} · {dt}", tuple(ctx), tuple(base + y for y in ys), m.name, dt))
    caps = []
    if res.fit is not None:
        caps = [(f"GPU {res.fit.gpu_bytes / GIB:g} GiB", res.fit.gpu_bytes),
                (f"usable after {req.reserve:.0%} reserve", res.fit.usable_bytes)]
    what = "Weights + KV cache" if add_w else "KV cache"
    show(st, charts.memory_vs_context(curves, caps, session.read("mem_log"),
                                             f"{what} vs context (batch {req.batch}, beams {req.beams})"),
                    key="mem_chart_context")
    top = max(64, 1 << math.ceil(math.log2(2 * req.batch)))
    batches = [1 << k for k in range(int(math.log2(min(top, 1 << 20))) + 1)]
    block, tp = (req.block_size if req.paged else None), req.tp
    kvs = [kv_bytes(spec, req.kv_format, req.seq_len, b * req.beams, req.use_windows, block, tp)
           + state_bytes(spec, req.resolved_state_dtype, b * req.beams, tp) for b in batches]
    cap = (f"usable {res.fit.usable_bytes / GIB:,.1f} GiB", res.fit.usable_bytes) if res.fit else None
    weights = res.weights_bytes_per_gpu if tp > 1 else res.weights_bytes
    title = (f"{spec.name}: weights + KV{' + state' if spec.state else ''} vs batch at {req.seq_len:,} tokens"
             + (f", per GPU of {tp}" if tp > 1 else "") + ("" if res.weights_bytes is not None else " (weights unknown)"))
    show(st, charts.weights_and_kv_by_batch(batches, weights or 0, kvs, cap, title), key="mem_chart_batch")
    show(st, charts.attention_variants(attention_variants(spec, req),
                                              f"{spec.name} shape: MHA vs GQA vs MQA vs MLA at {req.seq_len:,} tokens"),
                    key="mem_chart_attention")


# ----------------------------------------------------------------------------- cost per token
def measured_mbu() -> str | None:
    """The decode memory-bandwidth utilisation the Prefill vs decode page measured in this session:
    achieved bytes/s (analytic FLOPs / intensity / time) over the probed peak. None until it has run."""
    probes: Any = session.get(session.MACHINE_PROBES) or {}
    found = []
    for key, results in list(session.items()):
        if not (isinstance(key, str) and key.startswith("pd_results::") and isinstance(results, dict)):
            continue
        for sample in results.get("decode") or []:
            metrics = getattr(sample, "metrics", {})
            probe = probes.get((getattr(sample, "device", None), getattr(sample, "dtype", None)))
            flops, intensity = metrics.get("flops_per_s"), metrics.get("intensity")
            bandwidth = getattr(probe, "bandwidth", None)
            if flops and intensity and bandwidth:
                found.append((flops / intensity / bandwidth, f"{sample.device} · {sample.dtype}"))
    if not found:
        return None
    where = found[-1][1]
    mbu = statistics.median(m for m, w in found if w == where)
    return f"{mbu:.0%} on this machine ({where}, median of the decode sweep)"


def cost(spec: ModelSpec, req: MemoryRequest, res: MemoryResult) -> None:
    st.subheader("Cost per token (decode roofline)")
    st.caption("An upper-bound estimate: each decode step reads every weight on each GPU once, plus every "
               "sequence's KV cache and state, at the GPU's peak bandwidth x efficiency. Compute, launches, the "
               "prefill and scheduling are left out, and an MoE model's experts are all counted as read.")
    mbu = measured_mbu()
    st.caption(f"Efficiency {req.efficiency:g} (achieved / peak bandwidth). "
               + (f"The Prefill vs decode page measured a decode MBU of {mbu}." if mbu else
                  "The Prefill vs decode page measures this machine's decode MBU: run its sweep to compare."))
    c = res.cost
    if c is None:
        st.info("Enter a parameter count (the weights are unknown) to estimate the cost per token.")
        return
    why = no_cost_reason(res)  # a request that does not fit never runs: no speed, no price
    cols = st.columns(3)
    cols[0].metric("Tokens/s (upper bound)", "—" if why else f"{c.tokens_per_s:,.1f}")
    cols[1].metric("Decode step", "—" if why else f"{c.step_s * 1e3:,.2f} ms")
    cols[2].metric("$ per 1M output tokens", "—" if why else
                   ("no price set" if c.usd_per_million_tokens is None else fmt_usd(c.usd_per_million_tokens)))
    if why:
        st.caption(f"— : {why[0].upper() + why[1:]}. The charts below stop at the batch that fits.")
    quant = st.selectbox("Compare with KV dtype", DTYPES, index=persist.index_of("mem_cost_dtype", DTYPES),
                         key="mem_cost_dtype", persist_state="session",
                         help="The same curves with the KV cache in another dtype: smaller KV, bigger batches.")
    series = []
    for dt in dict.fromkeys([req.kv_dtype, quant]):
        try:
            fit = calculate(spec, replace(req, kv_dtype=dt)).fit
        except CalcError:
            continue
        top = fit.max_batch if fit is not None else 1024
        if top < 1:
            st.caption(f"KV {dt}: not even one request fits at this context.")
            continue
        points = cost_curve(spec, req, res.weights_bytes or 0, batch_steps(top), dt)
        series.append(charts.CostSeries(
            f"KV {dt}", tuple(p.sequences // req.beams for p in points),
            tuple(p.usd_per_million_tokens for p in points if p.usd_per_million_tokens is not None),
            tuple(p.tokens_per_s for p in points)))
    gpus = f"{req.tp} GPUs" if req.tp > 1 else "1 GPU"
    a, b = st.columns(2)
    show(a, charts.cost_vs_batch(series, "$ per 1M output tokens vs batch", f"{gpus}, up to the batch that fits"),
                   key="mem_chart_cost")
    show(b, charts.tokens_per_s_vs_batch(series, "Decode tokens/s vs batch", f"{gpus}, upper bound"),
                   key="mem_chart_tokens")
    st.code("\n".join(([f"(not reachable: {why})"] if why else []) + list(c.formula)), language=None, wrap_lines=True)


# ----------------------------------------------------------------------------- the gap to a real engine
def gap(spec: ModelSpec, req: MemoryRequest, res: MemoryResult) -> None:
    """What a serving engine allocates that this estimate leaves out, with this request's numbers."""
    with st.expander("The gap to a real engine", expanded=False):
        paged = calculate(spec, replace(req, paged=True)) if not req.paged else res
        items = [
            f"**gpu_memory_utilization.** vLLM takes {1 - req.reserve:.0%} of the GPU (the reserve here is "
            f"{req.reserve:.0%}), loads the weights, profiles activations and gives what is left to the KV cache: "
            f"it preallocates that whole pool, however short the requests.",
            "**Activations and CUDA graphs.** Not counted here: the engine measures its activation peak at start-up "
            "and captured CUDA graphs keep their own buffers; both come out of the memory before the KV pool is sized.",
            f"**Block rounding.** Paged engines hand out whole blocks of {req.block_size} tokens per layer: at this "
            f"context that wastes {fmt_bytes(paged.paging_waste_bytes, both_units=True)} (the Paged switch adds it).",
        ]
        if len({g.kind for g in res.layers}) > 1 or spec.has_windows:
            full = calculate(spec, replace(req, use_windows=False)).kv_bytes
            items.append(f"**Per-layer-type cache groups.** An engine with a hybrid cache manager gives each layer "
                         f"type its own group of blocks, as counted here ({fmt_bytes(res.kv_bytes, both_units=True)}); "
                         f"one that treats every layer as full keeps every token in each "
                         f"({fmt_bytes(full, both_units=True)}). Linear layers' state lives in a separate pool.")
        if res.kv_head_replication > 1:
            extra = req.tp * res.kv_bytes_per_gpu - res.kv_bytes
            items.append(f"**KV-head replication.** With tp {req.tp}, every "
                         f"{'MLA latent' if spec.mla else 'KV head'} is stored {res.kv_head_replication}x: "
                         f"{fmt_bytes(extra, both_units=True)} more across the GPUs than one copy.")
        else:
            items.append("**KV-head replication.** None at this tensor-parallel size.")
        for text in items:
            st.markdown("- " + text)
        _live_cache(spec, req, res)


def _live_cache(spec: ModelSpec, req: MemoryRequest, res: MemoryResult) -> None:
    measured = measure_caches(spec.key, req.kv_dtype, req.sequences, req.seq_len)
    if measured is None:
        st.caption("Pick a model kvviz runs (smollm2-135m, or the kvviz: presets) with an fp32/fp16/bf16 cache to see the "
                   "calculator next to the engine's live cache here. Its int8, int4, fp8 and windowed caches are "
                   "set beside these same formulas on the Compression lab page, run by run.")
        return
    rows = []
    for m in measured:
        calc = kv_bytes(spec, req.kv_format, m.tokens, req.sequences, False, None)
        rows.append({"cache kind": m.kind, "tokens held": m.tokens, "calculator (bytes)": calc,
                     "engine cache (bytes)": m.bytes_allocated, "equal": calc == m.bytes_allocated})
    st.markdown(f"**{md_plain(spec.name)}: the calculator next to kvviz's own caches** (bytes_allocated, "
                "built on the meta device)")
    st.dataframe(safe_frame(rows), hide_index=True, key="mem_live_cache")
