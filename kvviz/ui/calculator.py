"""The KV memory calculator page: how much memory does model X need at context T and batch B?

All arithmetic is in kvviz.memory (pure Python) and every figure in kvviz.charts.memory; this
module only turns widgets into a MemoryRequest and results into metrics, charts and a table.
Settings live in the URL (``st.query_params``, named like the widget keys), so a link reproduces
a calculation: they are read and validated once per session, then written back on every run.
Every user or config value shown inside Markdown goes through ``md_plain`` (kvviz.ui.plain_text).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

import pandas as pd
import streamlit as st

from kvviz.charts import memory as charts
from kvviz.memory import (
    DEFAULT_BLOCK_SIZE, DEFAULT_GROUP_SIZE, DTYPES, GB, GIB, GPU_PRESETS_GIB, MAX_BATCH, MAX_CONFIG_BYTES,
    MAX_SEQ_LEN, SCALE_DTYPE_BYTES, CalcError, ConfigError, MemoryRequest, MemoryResult, ModelSpec,
    attention_variants, builtin_specs, calculate, context_curve, kv_bytes, parse_config_text, with_builtins,
)
from kvviz.ui.plain_text import md_plain

SOURCES = {"preset": "Preset", "import": "Import config.json"}
GPU_OPTIONS = [str(g) for g in GPU_PRESETS_GIB] + ["custom"]
MAX_BEAMS = 16
DEFAULTS: dict[str, Any] = {
    "mem_source": "preset", "mem_preset": "llama-3-8b", "mem_seq_len": 8192, "mem_batch": 1, "mem_beams": 1,
    "mem_dtype": "bf16", "mem_weight_dtype": "bf16", "mem_group_size": DEFAULT_GROUP_SIZE, "mem_scale_dtype": "fp16",
    "mem_zero_point": False, "mem_paged": False, "mem_block_size": DEFAULT_BLOCK_SIZE, "mem_windows": True,
    "mem_gpu": "80", "mem_gpu_custom": 80.0, "mem_reserve": 10, "mem_params": 0,
    "mem_compare": ["llama-2-7b", "mistral-7b-v0.1", "deepseek-v2"], "mem_chart_dtypes": ["bf16", "fp8", "int4"],
    "mem_log": True, "mem_chart_weights": False,
}
# Settings a link must carry to reproduce the calculation (chart-only settings travel too).
SHARED_KEYS = tuple(DEFAULTS)


# ----------------------------------------------------------------------------- query parameters
def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(s: str) -> int:
        v = int(s.replace(",", "").replace("_", ""))
        if not lo <= v <= hi:
            raise ValueError(f"must be from {lo:,} to {hi:,}")
        return v
    return parse


def _choice(options: list[str] | tuple[str, ...]) -> Callable[[str], str]:
    def parse(s: str) -> str:
        if s not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return s
    return parse


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be true or false")


def _gpu(s: str) -> str | float:
    if s in GPU_OPTIONS[:-1]:
        return s
    v = float(s)
    if not (math.isfinite(v) and 0 < v <= 100_000):
        raise ValueError("must be a GPU size in GiB")
    return v


def _list_of(options: list[str] | tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(s: str) -> list[str]:
        items = [x for x in s.split(",") if x]
        bad = [x for x in items if x not in options]
        if bad:
            raise ValueError(f"unknown {', '.join(bad[:3])}")
        return list(dict.fromkeys(items))
    return parse


def _parsers(preset_keys: list[str]) -> dict[str, Callable[[str], Any]]:
    return {
        "mem_source": _choice(list(SOURCES)), "mem_preset": _choice(preset_keys),
        "mem_seq_len": _int_in(1, MAX_SEQ_LEN), "mem_batch": _int_in(1, MAX_BATCH),
        "mem_beams": _int_in(1, MAX_BEAMS), "mem_dtype": _choice(DTYPES), "mem_weight_dtype": _choice(DTYPES),
        "mem_group_size": _int_in(1, 4096), "mem_scale_dtype": _choice(tuple(SCALE_DTYPE_BYTES)),
        "mem_zero_point": _bool, "mem_paged": _bool, "mem_block_size": _int_in(1, 4096), "mem_windows": _bool,
        "mem_gpu": _gpu, "mem_gpu_custom": lambda s: float(_gpu(s)), "mem_reserve": _int_in(0, 50),
        "mem_params": _int_in(0, 10**15), "mem_compare": _list_of(preset_keys), "mem_chart_dtypes": _list_of(DTYPES),
        "mem_log": _bool, "mem_chart_weights": _bool,
    }


def read_query_params(preset_keys: list[str]) -> list[str]:
    """Seed the widgets from the URL once per session; return a message for each invalid value."""
    if st.session_state.get("mem_qp_loaded"):
        return []
    st.session_state["mem_qp_loaded"] = True
    bad: list[str] = []
    parsers = _parsers(preset_keys)
    for key, parse in parsers.items():
        if key not in st.query_params:
            continue
        raw = st.query_params[key]
        try:
            value = parse(raw)
        except ValueError as e:  # also int()/float() on 5,000 digits: Python refuses, with a ValueError
            bad.append(f"{key}={raw[:40]!r} ignored: {str(e)[:120]}")
            continue
        if key == "mem_gpu" and isinstance(value, float):
            st.session_state["mem_gpu"], st.session_state["mem_gpu_custom"] = "custom", value
        else:
            st.session_state[key] = value
    return bad


def write_query_params() -> None:
    """The current settings back into the URL, so the address bar is always a shareable link."""
    out: dict[str, str] = {}
    for key in SHARED_KEYS:
        v = st.session_state.get(key, DEFAULTS[key])
        if key == "mem_preset" and st.session_state.get("mem_source") == "import":
            continue  # an imported config is too big for a link
        if key == "mem_gpu_custom" and st.session_state.get("mem_gpu") != "custom":
            continue
        out[key] = ",".join(v) if isinstance(v, list) else str(v).lower() if isinstance(v, bool) else str(v)
    if dict(st.query_params) != out:
        st.query_params.from_dict(out)


# ----------------------------------------------------------------------------- formatting
def _pair(n: int) -> tuple[str, str]:
    """(binary, decimal) strings in a unit that suits the size."""
    for bin_unit, dec_unit, b, d in (("GiB", "GB", GIB, GB), ("MiB", "MB", 2**20, 10**6), ("KiB", "KB", 1024, 1000)):
        if n >= b:
            return f"{n / b:,.2f} {bin_unit}", f"{n / d:,.2f} {dec_unit}"
    return f"{n:,} B", f"{n:,} B"


# ----------------------------------------------------------------------------- controls
def _model_controls(presets: dict[str, ModelSpec]) -> ModelSpec | ConfigError | None:
    """The chosen preset or the imported config; the config's problems; or None when nothing was given."""
    source = st.radio("Model", list(SOURCES), format_func=SOURCES.get, key="mem_source", horizontal=True)
    if source == "preset":
        key = st.selectbox("Preset", list(presets), format_func=lambda k: f"{presets[k].name}  ({k})",
                           key="mem_preset")
        return presets[key]
    up = st.file_uploader("Upload a config.json", type=["json"], key="mem_config_file", max_upload_size=1,
                          help=f"At most {MAX_CONFIG_BYTES:,} bytes.")
    text = st.text_area("...or paste it", key="mem_config_text", height=160,
                        placeholder='{"model_type": "llama", "num_hidden_layers": 32, ...}')
    data: str | bytes = up.getvalue() if up is not None else text
    where = up.name if up is not None else "pasted config.json"
    if not (data.strip() if isinstance(data, str) else data):
        return None
    try:
        return parse_config_text(data, where[:80])
    except ConfigError as e:
        return e


def _settings_controls() -> None:
    """Context, multipliers, formats and GPU; values are read back from st.session_state."""
    st.number_input("Context: prompt + output tokens", min_value=1, max_value=MAX_SEQ_LEN, step=1024,
                    key="mem_seq_len")
    st.number_input("Batch (concurrent requests)", min_value=1, max_value=MAX_BATCH, step=1, key="mem_batch")
    st.slider("Parallel samples / beams", 1, MAX_BEAMS, key="mem_beams",
              help="Each beam or sample keeps its own cache (no prefix sharing is counted).")
    c1, c2 = st.columns(2)
    c1.selectbox("KV cache dtype", DTYPES, key="mem_dtype")
    c2.selectbox("Weight dtype", DTYPES, key="mem_weight_dtype")
    quant = st.session_state["mem_dtype"] in ("int8", "int4")
    with st.expander("int8 / int4 scales", expanded=quant):
        st.number_input("Group size", min_value=1, max_value=4096, step=32, key="mem_group_size",
                        disabled=not quant, help="Values sharing one scale.")
        st.selectbox("Scale dtype", tuple(SCALE_DTYPE_BYTES), key="mem_scale_dtype", disabled=not quant)
        st.checkbox("Zero point per group too", key="mem_zero_point", disabled=not quant)
    st.checkbox("Apply sliding windows", key="mem_windows",
                help="Off: every layer keeps every token, as a runtime without window support would.")
    c1, c2 = st.columns(2)
    c1.checkbox("Paged", key="mem_paged", help="vLLM-style: each layer's tokens rounded up to whole blocks.")
    c2.number_input("Block size (tokens)", min_value=1, max_value=4096, key="mem_block_size",
                    disabled=not st.session_state["mem_paged"])
    c1, c2 = st.columns(2)
    c1.selectbox("GPU memory", GPU_OPTIONS, key="mem_gpu", format_func=lambda g: "custom" if g == "custom" else f"{g} GiB",
                 help='Nominal sizes read as GiB: an "80 GB" A100 has 80 GiB (81,920 MiB).')
    c2.number_input("Custom (GiB)", min_value=0.5, max_value=100_000.0, step=1.0, key="mem_gpu_custom",
                    disabled=st.session_state["mem_gpu"] != "custom")
    st.slider("Reserve (% of the GPU)", 0, 50, key="mem_reserve",
              help="Kept free for activations, the CUDA context and fragmentation (vLLM keeps 10% by default).")
    st.number_input("Parameter count (0 = from the config)", min_value=0, max_value=10**15, step=1, key="mem_params",
                    help="Needed when the architecture is not one kvviz can count; overrides the config's count.")


def _request() -> MemoryRequest:
    ss = st.session_state
    gpu = float(ss["mem_gpu_custom"]) if ss["mem_gpu"] == "custom" else float(ss["mem_gpu"])
    return MemoryRequest(
        seq_len=int(ss["mem_seq_len"]), batch=int(ss["mem_batch"]), beams=int(ss["mem_beams"]),
        kv_dtype=ss["mem_dtype"], weight_dtype=ss["mem_weight_dtype"], group_size=int(ss["mem_group_size"]),
        scale_dtype=ss["mem_scale_dtype"], zero_point=bool(ss["mem_zero_point"]), paged=bool(ss["mem_paged"]),
        block_size=int(ss["mem_block_size"]), use_windows=bool(ss["mem_windows"]),
        params=int(ss["mem_params"]) or None, gpu_gib=gpu, reserve=ss["mem_reserve"] / 100,
    )


# ----------------------------------------------------------------------------- results
def _describe(spec: ModelSpec) -> None:
    shape = (f"MLA latent {spec.mla.kv_lora_rank} + {spec.mla.qk_rope_head_dim}" if spec.mla
             else f"{spec.n_kv_heads} KV heads, head_dim {spec.head_dim}")
    maxpos = f"{spec.max_positions:,}" if spec.max_positions else "unknown"
    st.markdown(f"**{md_plain(spec.name, 120)}**: {spec.attention}, {spec.n_layers} layers, {spec.n_heads} heads, {shape}; "
                f"sliding windows: {spec.window_summary()}; max positions {maxpos}")
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
    fit = res.fit
    if fit is not None:
        cols[4].metric("On this GPU", "fits" if fit.fits else "does not fit")
        mt = "unbounded (every layer windowed)" if fit.max_seq_len is None else f"{fit.max_seq_len:,}"
        cols[4].caption(f"usable {fit.usable_bytes / GIB:,.1f} GiB = {fit.usable_bytes / GB:,.1f} GB; "
                        f"max batch at this context: {fit.max_batch:,}; max context at this batch: {mt}")


def _explain(spec: ModelSpec, res: MemoryResult) -> None:
    r = res.request
    if spec.key == "llama-3-8b" and r.seq_len == 8192 and r.batch == 1 and r.beams == 1 and r.kv_dtype in ("bf16", "fp16"):
        st.info(f'The often-quoted "~4 GB for Llama 3 8B at seq=8192, batch=1, BF16" is the MHA figure '
                f"({res.kv_bytes_mha / GB:.2f} GB, as if all {spec.n_heads} heads kept their own K and V); "
                f"Llama 3 8B uses GQA with {spec.n_kv_heads} KV heads, so its cache is {res.kv_bytes / GB:.2f} GB "
                f"({res.kv_bytes / GIB:.2f} GiB).")
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
        st.warning(md_plain(w))
    st.code("\n".join(res.formula), language=None)
    with st.expander("What is counted, and what is not"):
        st.markdown("**Counted**\n" + "\n".join(f"- {c}" for c in res.counted))
        st.markdown("**Not counted**\n" + "\n".join(f"- {c}" for c in res.not_counted))


def _contexts(seq_len: int) -> list[int]:
    hi = max(8192, 1 << math.ceil(math.log2(2 * seq_len)))
    return sorted({1 << k for k in range(7, int(math.log2(hi)) + 1)} | {seq_len})


def _compared(spec: ModelSpec, req: MemoryRequest, presets: dict[str, ModelSpec]) -> list[tuple[ModelSpec, MemoryResult]]:
    """The current model (with the user's parameter count) and the compared presets (with their own)."""
    others = [presets[k] for k in st.session_state["mem_compare"] if presets[k] is not spec]
    return [(spec, calculate(spec, req))] + [(m, calculate(m, replace(req, params=None))) for m in others]


def _charts(spec: ModelSpec, req: MemoryRequest, res: MemoryResult, presets: dict[str, ModelSpec]) -> None:
    st.subheader("Charts")
    c1, c2, c3, c4 = st.columns([3, 2, 1, 1])
    c1.multiselect("Compare with", list(presets), key="mem_compare", format_func=lambda k: presets[k].name)
    c2.multiselect("Dtypes to plot", DTYPES, key="mem_chart_dtypes")
    c3.checkbox("Log axes", key="mem_log")
    c4.checkbox("Add weights", key="mem_chart_weights")
    dtypes = st.session_state["mem_chart_dtypes"] or [req.kv_dtype]
    add_w = st.session_state["mem_chart_weights"]
    ctx = _contexts(req.seq_len)
    curves = []
    for m, r in _compared(spec, req, presets):
        base = (r.weights_bytes or 0) if add_w else 0
        for dt in dtypes:
            ys = context_curve(m, r.request, ctx, dtype=dt)
            curves.append(charts.Curve(f"{m.name} · {dt}", tuple(ctx), tuple(base + y for y in ys)))
    caps = []
    if res.fit is not None:
        caps = [(f"GPU {res.fit.gpu_bytes / GIB:g} GiB", res.fit.gpu_bytes),
                (f"usable after {req.reserve:.0%} reserve", res.fit.usable_bytes)]
    what = "Weights + KV cache" if add_w else "KV cache"
    st.plotly_chart(charts.memory_vs_context(curves, caps, st.session_state["mem_log"],
                                             f"{what} vs context (batch {req.batch}, beams {req.beams})"),
                    key="mem_chart_context")
    top = max(64, 1 << math.ceil(math.log2(2 * req.batch)))
    batches = [1 << k for k in range(int(math.log2(min(top, 1 << 20))) + 1)]
    kvs = [kv_bytes(spec, req.kv_format, req.seq_len, b * req.beams, req.use_windows,
                    req.block_size if req.paged else None) for b in batches]
    cap = (f"usable {res.fit.usable_bytes / GIB:,.1f} GiB", res.fit.usable_bytes) if res.fit else None
    st.plotly_chart(charts.weights_and_kv_by_batch(batches, res.weights_bytes or 0, kvs, cap,
                                                   f"{spec.name}: weights + KV vs batch at {req.seq_len:,} tokens"
                                                   + ("" if res.weights_bytes is not None else " (weights unknown)")),
                    key="mem_chart_batch")
    st.plotly_chart(charts.attention_variants(attention_variants(spec, req),
                                              f"{spec.name} shape: MHA vs GQA vs MQA vs MLA at {req.seq_len:,} tokens"),
                    key="mem_chart_attention")


def _table(spec: ModelSpec, req: MemoryRequest, presets: dict[str, ModelSpec]) -> None:
    st.subheader("Side by side")
    rows = []
    for m, r in _compared(spec, req, presets):
        rows.append({
            "model": m.name, "attention": m.attention, "layers": m.n_layers, "heads": m.n_heads,
            "kv_heads": None if m.mla else m.n_kv_heads, "head_dim": m.head_dim, "windows": m.window_summary(),
            "kv_bytes_per_token": r.kv_bytes_per_token, "kv_bytes": r.kv_bytes, "kv_GiB": r.kv_bytes / GIB,
            "weights_GiB": None if r.weights_bytes is None else r.weights_bytes / GIB,
            "total_GiB": None if r.total_bytes is None else r.total_bytes / GIB,
            "fits": None if r.fit is None else r.fit.fits, "max_batch": None if r.fit is None else r.fit.max_batch,
            "source": m.source,
        })
    df = pd.DataFrame(rows)
    st.dataframe(df, hide_index=True, key="mem_table")
    st.download_button("Download CSV", df.to_csv(index=False).encode("utf-8"), file_name="kv_memory.csv",
                       mime="text/csv", key="mem_download_csv", on_click="ignore")


def _presets() -> dict[str, ModelSpec]:
    """Published presets, then kvviz's own models: the shapes come from the engine (this layer may
    import it; kvviz.memory may not)."""
    from kvviz.engine.load import DEFAULT_MODEL_DIR, RANDOM_SHAPES

    shapes = {name: cfg.to_dict() for name, cfg in RANDOM_SHAPES.items()}
    return with_builtins(builtin_specs(shapes, DEFAULT_MODEL_DIR / "config.json", "kvviz/engine/load.py RANDOM_SHAPES"))


def page() -> None:
    st.title("KV memory calculator")
    st.caption("Exact bytes for the KV cache and weights of real models: GQA, MQA, MLA and sliding windows included.")
    presets = _presets()
    for key, value in DEFAULTS.items():
        st.session_state.setdefault(key, list(value) if isinstance(value, list) else value)
    for msg in read_query_params(list(presets)):
        st.warning(f"Link setting {md_plain(msg)}")  # the value is whatever the link says: never Markdown
    # A preset that disappeared (e.g. the shipped model is missing) falls back to the default one.
    if st.session_state["mem_preset"] not in presets:
        st.session_state["mem_preset"] = DEFAULTS["mem_preset"]
    st.session_state["mem_compare"] = [k for k in st.session_state["mem_compare"] if k in presets]

    with st.sidebar:
        spec = _model_controls(presets)
        _settings_controls()
    write_query_params()
    if spec is None:
        st.info("Upload or paste a Hugging Face config.json in the sidebar to size it.")
        return
    if isinstance(spec, ConfigError):
        items = "\n".join(f"- {md_plain(p)}" for p in spec.problems)
        st.error(f"**{md_plain(spec.where, 80)}** cannot be sized:\n\n{items}")
        return
    try:
        req = _request()
        res = calculate(spec, req)
    except CalcError as e:
        st.error("Cannot compute:\n\n" + "\n".join(f"- {md_plain(p)}" for p in e.problems))
        return
    _describe(spec)
    _metrics(res)
    _explain(spec, res)
    _charts(spec, req, res, presets)
    _table(spec, req, presets)
    if st.session_state["mem_source"] == "import":
        st.caption("The link in the address bar carries these settings, not the imported config.json.")
