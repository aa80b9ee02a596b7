"""The compression lab: what a quantized or windowed KV cache costs, measured on the model itself.

Tab 1 runs the sidebar's prompt greedily with full-precision, int8, int4 and fp8 KV caches side by
side and measures the error as the cache is really read. Tabs 2 and 3 (ui/pages/compress/compress_window.py):
a sliding window with StreamingLLM's sinks, and perplexity by position.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import streamlit as st
import torch

from kvviz import LoadedModel
from kvviz.charts import compress_charts as cc
from kvviz.engine.api import iter_generate
from kvviz.engine.generation.valid_request import CacheSpec
from kvviz.engine.generation.request import kv_spec
from kvviz.errors import KVVizError
from kvviz.measure.kvcompare import compare
from kvviz.engine.kvcache.dense import layer_windows
from kvviz.calculator.compressed import CacheShape, Compression, cache_bytes
from kvviz.ui.pages.compress import compress_window
from kvviz.ui.common.figs import show
from kvviz.ui.common.busy_notes import acquire_or_warn
from kvviz.ui.common.measuring_page import page_model, results_key, where
from kvviz.ui.common.plain_text import md_plain
from kvviz.ui.settings import Settings
from kvviz.units import fmt_bytes
from kvviz.ui.state import session

INTRO = (
    "The KV cache often outgrows the model's weights at long context, so real servers shrink it: **quantized** "
    "K/V (int8, int4, fp8: fewer bytes per value) or a **window** that keeps only recent positions. A calculator "
    "just multiplies by a smaller number. Here the model runs through the smaller cache and the cost is "
    "measured: how soon the text changes, how far attention and the next-token distribution move."
)
DTYPES = (None, "int8", "int4", "fp8")


@dataclass
class QuantResult:
    """One dtype's run: its text and tokens, bytes, and what was measured."""

    name: str
    ids: list[int]
    labels: list[str]
    text: str
    bytes: int
    calc_bytes: int  # the calculator's figure for the same settings and positions (calculator/compressed.py)
    errors: dict[str, float] = field(default_factory=dict)
    k_err: list[list[float]] = field(default_factory=list)  # (n_layer, nkv) max |K error|
    # ("k"|"v", "max"|"mean") -> (n_layer, nkv): each write's max or mean |error|, the worst write
    err_grids: dict[tuple[str, str], list[list[float]]] = field(default_factory=dict)
    per_step: list[tuple[int, float, float, float, float]] = field(default_factory=list)
    k_absmax: dict[int, list[list[float]]] = field(default_factory=dict)  # layer -> (nkv, hs)
    summary: dict[str, Any] = field(default_factory=dict)  # teacher-forced vs full precision
    attn_kl: list[list[float]] | None = None


def page() -> None:
    got = page_model("Compression lab", INTRO)
    if got is None:
        return
    s, model = got
    q, w, c = st.tabs(["Quantized KV: fp32 vs int8 vs int4 vs fp8", "Sliding window and sinks",
                       "Perplexity by position"])
    with q:
        _quant(s, model)
    with w:
        compress_window.window_tab(s, model)
    with c:
        compress_window.curves_tab(model)


def _quant(s: Settings, model: LoadedModel) -> None:
    hs = model.config.head_dim
    st.caption("Each dtype stores K and V quantized and dequantizes them on every read: int8/int4 with an fp16 "
               "scale per token, head and group of channels (int4 packed two per byte), fp8 e4m3 with one scale "
               "per layer (or head) set from the prefill. Greedy decoding, so any "
               f"difference in text is the cache's doing. {where(model)}")
    groups = [g for g in (hs, 64, 32, 16, 8) if g <= hs and hs % g == 0 and g % 2 == 0]
    with st.container(horizontal=True, vertical_alignment="bottom"):
        n = int(st.number_input("New tokens", 4, 128, 32, key="kvq_new", width=120))
        group = st.selectbox("Group size", sorted(set(groups), reverse=True), key="kvq_group", width=170,
                             format_func=lambda g: f"{g} (head vector)" if g == hs else str(g),
                             help="Values along head_dim that share one fp16 scale")
        zp = st.checkbox("Zero points (asymmetric)", key="kvq_zp")
        fp8 = st.selectbox("fp8 scale", ["tensor", "head"], key="kvq_fp8", width=120)
        which = compress_window.prompt_choice("kvq_prompt")
        run_it = st.button("Compare the four caches", key="kvq_run", type="primary")
    key = results_key("kvq_result", model)
    if run_it:
        _run_quant(s, model, n, None if group == hs else int(group), zp, fp8, key, which)
    got = session.get(key)
    if got is None:
        st.info("Press **Compare the four caches**: the same prompt through full-precision, int8, int4 and fp8 "
                "KV caches, then the measured errors.")
        return
    _quant_results(got, model)


def _run_quant(s: Settings, model: LoadedModel, n: int, group: int | None, zp: bool, fp8: str, key: str,
               which: str) -> None:
    lock = acquire_or_warn()
    if lock is None:
        return
    out: list[QuantResult] = []
    try:
        with st.spinner("Generating through four caches, then teacher-forcing the full-precision text "
                        "through each…"):
            for dt in DTYPES:
                cache = CacheSpec(kv_dtype=dt, group_size=group, zero_point=zp, fp8_scale=fp8,
                                  track_errors=dt is not None)
                stream = iter_generate(model, max_new_tokens=n, backend=s.engine, cache=cache,
                                       **compress_window.prompt_kwargs(s, which))
                for _ in stream:
                    pass
                run, cache = stream.run, stream.cache
                assert cache is not None
                r = QuantResult(run.cache_kind if dt else f"{model.dtype_name} (full)", run.generated_ids,
                                [e.token_text for e in run.events], run.text, run.events[-1].cache_bytes_used,
                                _calculator_bytes(model, dt, group, zp, fp8,
                                                  len(stream.prompt_rows[0]) + run.events[-1].step))
                log = getattr(cache, "errors", None)
                if log is not None:
                    r.errors, r.k_err = log.summary(), log.per_layer_head("k", "max")
                    r.err_grids = {(w, m): log.per_layer_head(w, m) for w in ("k", "v") for m in ("max", "mean")}
                    r.per_step = log.per_step()
                    r.k_absmax = {i: t.tolist() for i, t in log.k_absmax.items()}
                out.append(r)
            ref_ids = list(stream.prompt_rows[0]) + out[0].ids
            for r, dt in zip(out[1:], DTYPES[1:]):
                spec = kv_spec(model, dt, group_size=group, zero_point=zp, fp8_scale=fp8)
                cmp = compare(model, ref_ids, spec, chunk=1, attention=True, first=len(stream.prompt_rows[0]),
                              fast=s.engine == "fast")
                r.summary, r.attn_kl = cmp.summary(), cmp.attn_kl
    except KVVizError as e:
        st.error(md_plain(e))
        return
    finally:
        lock.release()
    session.put(key, out)


def _calculator_bytes(model: LoadedModel, dt: str | None, group: int | None, zp: bool, fp8: str,
                      positions: int) -> int:
    """What the calculator says a cache of these settings holds after ``positions`` tokens, layer by
    layer: a sliding layer (Gemma 3) holds at most its own window."""
    c = model.config
    one = CacheShape(1, c.kv_heads, c.head_dim, torch.empty((), dtype=model.dtype).element_size())
    comp = Compression(dt, group, zp, fp8)
    return sum(cache_bytes(one, comp, positions if w is None else min(positions, w)) for w in layer_windows(c))


def _quant_results(res: list[QuantResult], model: LoadedModel) -> None:
    ref = res[0]
    cols = st.columns(len(res))
    for col, r in zip(cols, res):
        d = cc.first_divergence(ref.ids, r.ids)
        same = (f"same {len(r.ids)} tokens" if d is None else f"same for {d} tokens") if r is not ref else "reference"
        col.metric(r.name, fmt_bytes(r.bytes), help="what the cache holds at the end: payload plus scales")
        calc = "equals the calculator" if r.calc_bytes == r.bytes else f"calculator says {r.calc_bytes:,} B"
        col.caption(f"{same} · {r.bytes:,} B, {calc}")
    show(st, cc.token_comparison([(r.name, r.ids, r.labels) for r in res]), key="kvq_tokens")
    cols = st.columns(len(res))
    for col, r in zip(cols, res):
        col.code(r.text, language=None, wrap_lines=True)
    st.subheader("Measured on the full-precision text, teacher-forced through each cache")
    st.caption("Each cache reads the same tokens (the full-precision run's), one decode step at a time after the "
               "prompt: the KL between the next-token distributions, whether the top token agrees, and the KL "
               "between each layer's and head's attention rows.")
    rows = []
    for r in res[1:]:
        sm, e = r.summary, r.errors
        rows.append({"KV": r.name, "logit KL (mean)": f"{sm['mean_logit_kl']:.2e}",
                     "logit KL (max)": f"{sm['max_logit_kl']:.2e}", "top-1 agreement": f"{sm['top1_agreement']:.1%}",
                     "attention KL (mean)": f"{sm['attention_kl_mean']:.2e}" if sm.get("attention_kl_mean") else "n/a",
                     "K max |error|": f"{e.get('k_max_abs_error', 0):.3g}",
                     "V max |error|": f"{e.get('v_max_abs_error', 0):.3g}",
                     "bytes": fmt_bytes(r.bytes), "vs full": f"{r.bytes / ref.bytes:.1%}"})
    st.dataframe(pd.DataFrame(rows), hide_index=True, key="kvq_table")
    names = [r.name for r in res[1:]]
    pick = st.radio("Heatmaps for", names, horizontal=True, key="kvq_pick")
    r = res[1 + names.index(pick)]
    c1, c2, _ = st.columns([1, 1, 3])
    which = c1.radio("Error of", ("K", "V"), horizontal=True, key="kvq_err_kv")
    stat = c2.radio("Per write", ("max", "mean"), horizontal=True, key="kvq_err_stat",
                    help="each write's largest |error| over its positions and channels, or its mean; the cell "
                         "shows the worst write")
    grid = r.err_grids.get((str(which).lower(), str(stat)), r.k_err)
    left, right = st.columns(2)
    show(left, cc.layer_head_heatmap(grid, f"{which} error per layer and KV head ({r.name})",
                                     f"{stat} |dequantized - exact| of a write, the worst write", f"{stat} |err|",
                                     "KV head"), key=f"kvq_err_{pick}_{which}_{stat}")
    show(right, cc.layer_head_heatmap(r.attn_kl or [], f"Attention-row KL ({r.name})",
                                      "KL(full || quantized) of the newest query's row, mean over steps",
                                      "KL"), key=f"kvq_attn_{pick}")
    show(st, cc.error_by_step(r.per_step, r.name), key=f"kvq_steps_{pick}")
    if r.k_absmax:
        layer = st.slider("Layer", 0, len(r.k_absmax) - 1, 0, key="kvq_layer")
        show(st, cc.channel_heatmap(r.k_absmax[layer], layer), key=f"kvq_chan_{pick}_{layer}")
