"""The KV memory calculator page: how much memory does model X need at context T and batch B,
on how many GPUs, and what does a token cost?

All arithmetic is in kvviz.calculator (pure Python) and every figure in kvviz.charts.calculator_charts; this
module turns widgets into a MemoryRequest and results into metrics and text, and
calculator_panels draws the charts, the cost and the gap panels. Settings live in the URL
(calculator_links). Every user or config value shown inside Markdown goes through ``md_plain``.
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd
import streamlit as st

from kvviz.calculator import (
    DTYPES, GB, GIB, MAX_BATCH, MAX_CONFIG_BYTES, MAX_SEQ_LEN, MAX_TP, SCALE_DTYPE_BYTES, STATE_DTYPES, CalcError,
    MAX_SINKS, ConfigError, MemoryRequest, MemoryResult, ModelSpec, builtin_specs, cache_window_problems, calculate, load_gpus,
    parse_config_text, with_builtins, with_cache_window,
)
from kvviz.ui.pages.calculator import calculator_servers as servers
from kvviz.ui.pages.calculator import calculator_panels as panels
from kvviz.engine.loading.loader import builtin_shapes
from kvviz.ui.pages.calculator.calculator_measured import SHAPES_SOURCE
from kvviz.ui.pages.calculator.calculator_links import (
    CUSTOM_GPU, DEFAULTS, GPU_OPTIONS, MAX_BEAMS, MAX_CUSTOM_GIB, MIN_CUSTOM_GIB, SOURCES, apply_gpu_kind, read_query_params, write_query_params,
)
from kvviz.ui.common.plain_text import md_plain
from kvviz.ui.common.frames import safe_frame
from kvviz.units import exact_ratio
from kvviz.ui.state import persist, session


# ----------------------------------------------------------------------------- formatting
def _pair(n: int) -> tuple[str, str]:
    """(binary, decimal) strings in a unit that suits the size, exact to the last digit shown
    (integer arithmetic: at 10^20 bytes a float's quotient is off by gigabytes)."""
    for bin_unit, dec_unit, b, d in (("GiB", "GB", GIB, GB), ("MiB", "MB", 2**20, 10**6), ("KiB", "KB", 1024, 1000)):
        if n >= b:
            return f"{exact_ratio(n, b)} {bin_unit}", f"{exact_ratio(n, d)} {dec_unit}"
    return f"{n:,} B", f"{n:,} B"


# ----------------------------------------------------------------------------- controls
def _model_controls(presets: dict[str, ModelSpec]) -> ModelSpec | ConfigError | None:
    """The chosen preset or the imported config; the config's problems; or None when nothing was given."""
    source = st.radio("Model", list(SOURCES), format_func=SOURCES.get,
                      index=persist.index_of("mem_source", list(SOURCES)), key="mem_source", persist_state="session",
                      horizontal=True)
    if source == "preset":
        key = st.selectbox("Preset", list(presets), format_func=lambda k: f"{presets[k].name}  ({k})",
                           index=persist.index_of("mem_preset", list(presets)), key="mem_preset",
                           persist_state="session")
        return presets[key]
    up = st.file_uploader("Upload a config.json", type=["json"], key="mem_config_file", max_upload_size=1,
                          help=f"At most {MAX_CONFIG_BYTES:,} bytes.")
    text = st.text_area("...or paste it", value=persist.now("mem_config_text"), key="mem_config_text",
                        persist_state="session", height=160,
                        max_chars=MAX_CONFIG_BYTES,
                        placeholder='{"model_type": "llama", "num_hidden_layers": 32, ...}')
    data: str | bytes = up.getvalue() if up is not None else text
    where = up.name if up is not None else "pasted config.json"
    if not (data.strip() if isinstance(data, str) else data):
        return None
    try:
        return parse_config_text(data, where[:80])
    except ConfigError as e:
        return e


def _settings_controls(has_state: bool) -> None:
    """Context, multipliers, formats, GPUs and cost; values are read back from st.session_state."""
    st.number_input("Context: prompt + output tokens", min_value=1, max_value=MAX_SEQ_LEN, step=1024,
                    value=persist.now("mem_seq_len", int), key="mem_seq_len", persist_state="session")
    st.number_input("Batch (concurrent requests)", min_value=1, max_value=MAX_BATCH, step=1,
                    value=persist.now("mem_batch", int), key="mem_batch", persist_state="session")
    st.slider("Parallel samples / beams", 1, MAX_BEAMS, value=persist.now("mem_beams", int), key="mem_beams",
              persist_state="session",
              help="Each beam or sample keeps its own cache (no prefix sharing is counted).")
    c1, c2 = st.columns(2)
    c1.selectbox("KV cache dtype", DTYPES, index=persist.index_of("mem_dtype", DTYPES), key="mem_dtype",
                 persist_state="session")
    c2.selectbox("Weight dtype", DTYPES, index=persist.index_of("mem_weight_dtype", DTYPES), key="mem_weight_dtype",
                 persist_state="session")
    quant = session.read("mem_dtype") in ("int8", "int4")
    with st.expander("int8 / int4 scales", expanded=quant):
        st.number_input("Group size", min_value=1, max_value=4096, step=32, value=persist.now("mem_group_size", int),
                        key="mem_group_size", persist_state="session",
                        disabled=not quant, help="Values sharing one scale.")
        st.selectbox("Scale dtype", tuple(SCALE_DTYPE_BYTES),
                     index=persist.index_of("mem_scale_dtype", tuple(SCALE_DTYPE_BYTES)), key="mem_scale_dtype",
                     persist_state="session",
                     disabled=not quant)
        st.checkbox("Zero point per group too", value=persist.now("mem_zero_point", bool), key="mem_zero_point",
                    persist_state="session",
                    disabled=not quant)
    st.checkbox("Apply sliding windows and chunks", value=persist.now("mem_windows", bool), key="mem_windows",
                persist_state="session",
                help="Off: every layer keeps every token, as a runtime without window support would.")
    windowed = bool(session.read("mem_cache_window"))
    with st.expander("Cache window (StreamingLLM)", expanded=windowed):
        st.checkbox("Keep only sinks + the last W positions", value=persist.now("mem_cache_window", bool),
                    key="mem_cache_window", persist_state="session",
                    help="A run-time cache window on every layer, as kvviz's own --window/--sinks caches "
                         "(the Compression lab): bytes stop growing at sinks + W positions.")
        c1, c2 = st.columns(2)
        c1.number_input("Window W", min_value=1, max_value=MAX_SEQ_LEN, step=256,
                        value=persist.now("mem_window", int), key="mem_window", persist_state="session",
                        disabled=not windowed)
        c2.number_input("Sinks S", min_value=0, max_value=MAX_SINKS, step=1, value=persist.now("mem_sinks", int),
                        key="mem_sinks", persist_state="session", disabled=not windowed,
                        help="The first positions, kept forever (StreamingLLM keeps 4).")
    st.selectbox("Linear-layer state dtype", STATE_DTYPES, index=persist.index_of("mem_state_dtype", STATE_DTYPES),
                 key="mem_state_dtype", persist_state="session", disabled=not has_state,
                 help="Linear-attention and Mamba layers keep a fixed state instead of K/V. auto = the weight "
                      "dtype when it is a float (vLLM's default); transformers keeps the recurrent part in fp32.")
    c1, c2 = st.columns(2)
    c1.checkbox("Paged", value=persist.now("mem_paged", bool), key="mem_paged", persist_state="session",
                help="vLLM-style: each layer's tokens rounded up to whole blocks.")
    c2.number_input("Block size (tokens)", min_value=1, max_value=4096, value=persist.now("mem_block_size", int),
                    key="mem_block_size", persist_state="session",
                    disabled=not session.read("mem_paged"))
    st.divider()
    gpus = load_gpus()
    st.selectbox("GPU", [*gpus, CUSTOM_GPU], index=persist.index_of("mem_gpu_kind", [*gpus, CUSTOM_GPU]),
                 key="mem_gpu_kind", persist_state="session", on_change=apply_gpu_kind,
                 format_func=lambda k: gpus[k].name if k in gpus else "custom",
                 help="Fills in memory, peak bandwidth (from the spec sheet) and an example price; edit any of them.")
    c1, c2 = st.columns(2)
    c1.selectbox("GPU memory", GPU_OPTIONS, index=persist.index_of("mem_gpu", GPU_OPTIONS), key="mem_gpu",
                 persist_state="session",
                 format_func=lambda g: "custom" if g == CUSTOM_GPU else f"{g} GiB",
                 help='Nominal sizes read as GiB: an "80 GB" A100 has 80 GiB (81,920 MiB).')
    c2.number_input("Custom (GiB)", min_value=0.5, max_value=100_000.0, step=1.0,
                    value=persist.now("mem_gpu_custom", float), key="mem_gpu_custom", persist_state="session",
                    disabled=session.read("mem_gpu") != CUSTOM_GPU)
    st.number_input("Tensor-parallel GPUs", min_value=1, max_value=MAX_TP, step=1, value=persist.now("mem_tp", int),
                    key="mem_tp", persist_state="session",
                    help="KV heads and weights split across the GPUs; heads are replicated when there are more GPUs "
                         "than KV heads. MLA's latent is never split.")
    st.slider("Reserve (% of the GPU)", 0, 50, value=persist.now("mem_reserve", int), key="mem_reserve",
              persist_state="session",
              help="Kept free for activations, the CUDA context and fragmentation (vLLM keeps 10% by default).")
    c1, c2 = st.columns(2)
    c1.number_input("Peak bandwidth (GB/s)", min_value=1.0, max_value=1e6, step=100.0,
                    value=persist.now("mem_bandwidth", float), key="mem_bandwidth", persist_state="session")
    c2.number_input("Price ($/GPU-hour)", min_value=0.0, max_value=1e6, step=0.1,
                    value=persist.now("mem_price", float), key="mem_price", persist_state="session",
                    help="An example on-demand price: use yours.")
    st.slider("Bandwidth efficiency", 0.05, 1.0, step=0.05, value=persist.now("mem_efficiency", float),
              key="mem_efficiency", persist_state="session",
              help="Achieved / peak bandwidth in decode (MBU). 0.7 is a good engine on a large model.")
    st.number_input("Parameter count (0 = from the config)", min_value=0, max_value=10**15, step=1,
                    value=persist.now("mem_params", int), key="mem_params", persist_state="session",
                    help="Needed when the architecture is not one kvviz can count; overrides the config's count.")


def _request() -> MemoryRequest:
    ss = session.mapping()
    gpu = float(ss["mem_gpu_custom"]) if ss["mem_gpu"] == CUSTOM_GPU else float(ss["mem_gpu"])
    return MemoryRequest(
        seq_len=int(ss["mem_seq_len"]), batch=int(ss["mem_batch"]), beams=int(ss["mem_beams"]),
        kv_dtype=ss["mem_dtype"], weight_dtype=ss["mem_weight_dtype"], group_size=int(ss["mem_group_size"]),
        scale_dtype=ss["mem_scale_dtype"], zero_point=bool(ss["mem_zero_point"]), paged=bool(ss["mem_paged"]),
        block_size=int(ss["mem_block_size"]), use_windows=bool(ss["mem_windows"]),
        params=int(ss["mem_params"]) or None, gpu_gib=gpu, reserve=ss["mem_reserve"] / 100,
        tp=int(ss["mem_tp"]), state_dtype=ss["mem_state_dtype"], bandwidth_gbs=float(ss["mem_bandwidth"]),
        efficiency=float(ss["mem_efficiency"]), price_per_gpu_hour=float(ss["mem_price"]),
    )


# ----------------------------------------------------------------------------- results
def _describe(spec: ModelSpec) -> None:
    shape = (f"MLA latent {spec.mla.kv_lora_rank} + {spec.mla.qk_rope_head_dim}" if spec.mla
             else f"{spec.n_kv_heads} KV heads, head_dim {spec.head_dim}")
    maxpos = f"{spec.max_positions:,}" if spec.max_positions else "unknown"
    st.markdown(f"**{md_plain(spec.name, 120)}**: {spec.attention}, {spec.n_layers} layers, {spec.n_heads} heads, "
                f"{shape}; layers: {md_plain(spec.window_summary())}; max positions {maxpos}")
    if spec.source.startswith("https://"):
        st.caption(f"Source: [{spec.source}]({spec.source})")  # our own presets file, never user text
    elif spec.source:
        st.caption(f"Source: {md_plain(spec.source)}")
    for note in spec.notes:
        st.caption(md_plain(note))


def _metrics(res: MemoryResult) -> None:
    cols = st.columns(5)
    items: list[tuple[str, int | None]] = [("KV per token", res.kv_bytes_per_token), ("KV cache total", res.kv_bytes),
                                           ("Weights", res.weights_bytes), ("Total", res.total_bytes)]
    for col, (label, n) in zip(cols, items):
        if n is None:
            col.metric(label, "unknown")
            col.caption("enter a parameter count")
            continue
        b, d = _pair(n)
        col.metric(f"{label} (binary)", b)
        col.caption(f"= {d} (decimal) = {n:,} bytes")
    fit, tp = res.fit, res.request.tp
    if fit is not None:
        where = "On this GPU" if tp == 1 else f"On each of {tp} GPUs"
        mt = "unbounded (every layer windowed)" if fit.max_seq_len is None else f"{fit.max_seq_len:,}"
        limits = f"max batch at this context: {fit.max_batch:,}; max context at this batch: {mt}"
        if res.weights_bytes is None:
            # Without the weights the fit counts the cache alone: never say the model fits.
            cols[4].metric(where, "KV alone fits" if fit.fits else "does not fit")
            cols[4].caption(f"weights unknown: enter a parameter count to know whether the model fits. "
                            f"usable {fit.usable_bytes / GIB:,.1f} GiB; for the cache alone, {limits}")
        else:
            cols[4].metric(where, "fits" if fit.fits else "does not fit")
            cols[4].caption(f"usable {fit.usable_bytes / GIB:,.1f} GiB = {fit.usable_bytes / GB:,.1f} GB; {limits}")
    if res.state_bytes or tp > 1:
        cols = st.columns(4)
        if res.state_bytes:
            cols[0].metric("Linear-layer state (binary)", _pair(res.state_bytes)[0])
            cols[0].caption(f"{res.state_bytes:,} bytes, {res.request.resolved_state_dtype}; fixed, not in the KV total")
        if tp > 1:
            cols[1].metric("KV per GPU (binary)", _pair(res.kv_bytes_per_gpu)[0])
            cols[1].caption(f"{res.kv_bytes_per_gpu:,} bytes")
            if res.weights_bytes_per_gpu is not None:
                cols[2].metric("Weights per GPU (binary)", _pair(res.weights_bytes_per_gpu)[0])
                cols[2].caption(f"{res.weights_bytes_per_gpu:,} bytes (split evenly)")
            heads = "whole latent" if res.kv_heads_per_gpu is None else f"{res.kv_heads_per_gpu} per GPU"
            cols[3].metric("KV heads", heads)
            cols[3].caption(f"replicated {res.kv_head_replication}x" if res.kv_head_replication > 1 else "no replication")


def _explain(spec: ModelSpec, res: MemoryResult) -> None:
    r = res.request
    if spec.key == "llama-3-8b" and not spec.has_windows and r.seq_len == 8192 and r.batch == 1 and r.beams == 1 and r.kv_dtype in ("bf16", "fp16"):
        st.info(f'The often-quoted "~4 GB for Llama 3 8B at seq=8192, batch=1, BF16" is the MHA figure '
                f"({res.kv_bytes_mha / GB:.2f} GB, as if all {spec.n_heads} heads kept their own K and V); "
                f"Llama 3 8B uses GQA with {spec.n_kv_heads} KV heads, so its cache is {res.kv_bytes / GIB:.2f} GiB "
                f"({res.kv_bytes / GB:.2f} GB).")
    if spec.attention != "MHA" and res.kv_bytes:
        what = "a naive per-head K/V cache" if spec.mla else "full multi-head attention"
        st.caption(f"With {what} the same cache would take {_pair(res.kv_bytes_mha)[0]} "
                   f"({res.kv_bytes_mha / res.kv_bytes:.1f}x).")
    if r.paged:
        waste = res.paging_waste_bytes
        share = waste / res.kv_bytes if res.kv_bytes else 0.0
        size = f"{waste:,} bytes" if waste < 1024 else f"{_pair(waste)[0]} = {waste:,} bytes"
        st.caption(f"Paging waste (partly filled last blocks of {r.block_size} tokens): {size}, "
                   f"{share:.2%} of the cache.")
    for w in res.warnings:
        st.warning(md_plain(page_words(w)))
    st.code("\n".join(res.formula), language=None, wrap_lines=True)
    with st.expander("What is counted, and what is not"):
        st.markdown("**Counted**\n" + "\n".join(f"- {c}" for c in res.counted))
        st.markdown("**Not counted**\n" + "\n".join(f"- {c}" for c in res.not_counted))


def page_words(warning: str) -> str:
    """A calculator warning as the page says it: the page has boxes, not command-line flags."""
    return warning.replace("(--params)", "(the “Parameter count” box)")


def cache_window() -> tuple[int, int] | None:
    """The sidebar's cache window as (W, S), or None when it is off."""
    ss = session.mapping()
    return (int(ss["mem_window"]), int(ss["mem_sinks"])) if ss["mem_cache_window"] else None


def windowed(spec: ModelSpec, window: tuple[int, int] | None) -> ModelSpec:
    """``spec`` under the cache window; unchanged when there is none or it does not apply (its problems are
    shown for the current model only)."""
    if window is None or cache_window_problems(spec, *window):
        return spec
    return with_cache_window(spec, *window)


def compared(spec: ModelSpec, req: MemoryRequest, presets: dict[str, ModelSpec],
             window: tuple[int, int] | None = None) -> list[tuple[ModelSpec, MemoryResult]]:
    """The current model (with the user's parameter count) and the compared presets (with their own),
    each under the same cache window. A compared preset that the request's TP cannot split is compared at tp 1."""
    out = [(spec, calculate(spec, req))]  # raises CalcError for the page to show
    for k in session.read("mem_compare"):
        m = presets[k]
        if m.key == spec.key and m.name == spec.name:
            continue
        m = windowed(m, window)
        try:
            out.append((m, calculate(m, replace(req, params=None))))
        except CalcError:
            out.append((m, calculate(m, replace(req, params=None, tp=1))))
    return out


def _table(rows_of: list[tuple[ModelSpec, MemoryResult]]) -> None:
    st.subheader("Side by side")
    rows = []
    for m, r in rows_of:
        rows.append({
            "model": m.name, "attention": m.attention, "layers": m.n_layers, "heads": m.n_heads,
            "kv_heads": None if m.mla else m.n_kv_heads, "head_dim": m.head_dim, "windows": m.window_summary(),
            "kv_bytes_per_token": r.kv_bytes_per_token, "kv_bytes": r.kv_bytes, "kv_GiB": r.kv_bytes / GIB,
            "state_bytes": r.state_bytes, "tp": r.request.tp, "kv_GiB_per_gpu": r.kv_bytes_per_gpu / GIB,
            "weights_GiB": None if r.weights_bytes is None else r.weights_bytes / GIB,
            "total_GiB": None if r.total_bytes is None else r.total_bytes / GIB,
            "fits": None if r.fit is None else r.fit.fits, "max_batch": None if r.fit is None else r.fit.max_batch,
            "usd_per_1M_tokens": None if r.cost is None else r.cost.usd_per_million_tokens,
            "source": m.source,
        })
    df = pd.DataFrame(rows)
    st.dataframe(safe_frame(rows), hide_index=True, key="mem_table")  # the CSV keeps the numbers as numbers
    st.download_button("Download CSV", df.to_csv(index=False).encode("utf-8"), file_name="kv_memory.csv",
                       mime="text/csv", key="mem_download_csv", on_click="ignore")


def _presets() -> dict[str, ModelSpec]:
    """Published presets, then kvviz's own models, whose shapes the engine hands in (kvviz.calculator may not import it)."""
    shapes, shipped = builtin_shapes()
    return with_builtins(builtin_specs(shapes, shipped, SHAPES_SOURCE))


def page() -> None:
    st.title("KV memory calculator")
    st.caption("Exact bytes for the KV cache and weights of real models: GQA, MQA, MLA, sliding, chunked and linear "
               "layers, tensor parallelism, and the cost per token on a GPU.")
    presets = _presets()
    # Each setting's widget keeps its value across pages (persist_state="session"), so a round trip
    # through the Generate page keeps the calculation, a pasted config.json too (an uploaded file is
    # the browser's to keep); these are the first visit's values.
    for key, value in DEFAULTS.items():
        session.setdefault(key, list(value) if isinstance(value, list) else value)
    session.setdefault("mem_config_text", "")
    for msg in read_query_params(list(presets)):
        st.warning(f"Link setting {md_plain(msg)}")  # the value is whatever the link says: never Markdown
    # A preset that disappeared (e.g. the shipped model is missing) falls back to the default one.
    if session.read("mem_preset") not in presets:
        session.put("mem_preset", DEFAULTS["mem_preset"])
    session.put("mem_compare", [k for k in session.read("mem_compare") if k in presets])

    with st.sidebar:
        spec = _model_controls(presets)
        _settings_controls(isinstance(spec, ModelSpec) and spec.state is not None)
    write_query_params()
    if spec is None:
        st.info("Upload or paste a Hugging Face config.json in the sidebar to size it.")
        return
    if isinstance(spec, ConfigError):
        items = "\n".join(f"- {md_plain(p)}" for p in spec.problems)
        st.error(f"**{md_plain(spec.where, 80)}** cannot be sized:\n\n{items}")
        return
    window = cache_window()
    try:
        req = _request()
        if window is not None:
            problems = cache_window_problems(spec, *window)
            if not req.use_windows:
                problems.append("the cache window is a window: turn “Apply sliding windows and chunks” on to use it")
            if problems:
                raise CalcError(problems)
            spec = with_cache_window(spec, *window)
        res = calculate(spec, req)
    except CalcError as e:
        st.error("Cannot compute:\n\n" + "\n".join(f"- {md_plain(p)}" for p in e.problems))
        return
    _describe(spec)
    _metrics(res)
    _explain(spec, res)
    panels.layer_strip(spec, res)
    side_by_side = compared(spec, req, presets, window)
    panels.memory_charts(spec, req, res, side_by_side, presets)
    panels.cost(spec, req, res)
    panels.gap(spec, req, res)
    servers.section(spec, req, res.params)
    _table(side_by_side)
    if session.read("mem_source") == "import":
        st.caption("The link in the address bar carries these settings, not the imported config.json.")
