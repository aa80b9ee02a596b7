"""The calculator page's Engine section: vLLM, llama.cpp and SGLang side by side for the model and
GPU in the sidebar, each in its own log's words, and the startup-log reconciler (any of the three).

All arithmetic is kvviz.calculator's (servers.py, server_*.py); this module reads widgets and writes
text. Pasted log text is shown only as table cells and code blocks, never as Markdown.
"""
from __future__ import annotations

import pandas as pd
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from kvviz.calculator import DEFAULT_BLOCK_SIZE, GIB, CalcError, MemoryRequest, ModelSpec, load_gpus, parse_config_text
from kvviz.calculator.hf_config import MAX_CONFIG_BYTES
from kvviz.calculator.server_llamacpp import CACHE_TYPES
from kvviz.calculator.server_mix import lengths_from_percentiles, parse_percentiles
from kvviz.calculator.server_sglang import MM_TRANSPORTS
from kvviz.calculator.server_log import MAX_LOG_CHARS, Row, parse_vllm_log, profile_rows, reconcile, settings_from_log
from kvviz.calculator.server_log_engines import (
    parse_llamacpp_log, parse_sglang_log, reconcile_llamacpp, reconcile_sglang,
)
from kvviz.calculator.server_vllm import VLLMSettings
from kvviz.calculator.server_vllm_defaults import DEVICES, default_batched_tokens, default_block_size
from kvviz.calculator.servers import EngineRequest, engine_report, estimate_parts
from kvviz.calculator.formulas import weight_bytes
from kvviz.ui.common.frames import safe_frame
from kvviz.ui.common.plain_text import md_plain
from kvviz.ui.state import persist, session
from kvviz.units import exact_ratio

DEFAULTS = {"mem_eng_kv_gib": 0.0, "mem_eng_batched": 0, "mem_eng_pp": 1, "mem_eng_util": 0.9,
            "mem_eng_np": 1, "mem_eng_ctk": "f16", "mem_eng_ctv": "f16", "mem_eng_swa_full": False,
            "mem_eng_frac": 0.9, "mem_eng_log": "", "mem_eng_pcts": "", "mem_eng_device": "cuda",
            "mem_eng_async": True, "mem_eng_ub": 512, "mem_eng_fa": "auto", "mem_eng_sgl_mm": False,
            "mem_eng_sgl_transport": "cpu", "mem_eng_log_engine": "vLLM"}
# The reconciler's engines, and what each one's cache lines look like (the text box's placeholder): Llama 3
# 8B's, as kvviz predicts them (30 GiB for vLLM, -c 8192, 10 GiB for SGLang).
LOG_EXAMPLES = {
    "vLLM": "Available KV cache memory: 30.00 GiB\nGPU KV cache size: 245,760 tokens, Maximum concurrency for 8,192 "
            "tokens per request: 30.00x",
    "llama.cpp": "llama_kv_cache: size = 1024.00 MiB (  8192 cells,  32 layers,  1/1 seqs), K (f16):  512.00 MiB, "
                 "V (f16):  512.00 MiB",
    "SGLang": "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 81920, K size: 5.00 GB, V size: 5.00 GB",
}


def _controls() -> None:
    c = st.columns(4)
    c[0].number_input("Available KV memory (GiB, 0 = estimate)", min_value=0.0, max_value=100_000.0, step=1.0,
                      value=persist.now("mem_eng_kv_gib", float), key="mem_eng_kv_gib", persist_state="session",
                      help="vLLM's 'Available KV cache memory' line: with it the blocks are exact. 0 estimates it "
                           "from the GPU, the weights and typical overheads (each part shown, with its spread).")
    c[1].number_input("max_num_batched_tokens (0 = default)", min_value=0, max_value=1 << 22, step=1024,
                      value=persist.now("mem_eng_batched", int), key="mem_eng_batched", persist_state="session",
                      help="vLLM --max-num-batched-tokens: a sliding-window group holds its window plus the tokens "
                           "in flight (2 batches under async scheduling) per request. 0: `vllm serve`'s default for "
                           "the device (16,384 on >= 160 GiB GPUs, 8,192 on >= 70 GiB ones but the A100 and GB10, "
                           "else 2,048; the CPU backend 2,048 a worker).")
    c[2].number_input("Pipeline stages (vLLM)", min_value=1, max_value=1024, step=1,
                      value=persist.now("mem_eng_pp", int), key="mem_eng_pp", persist_state="session")
    c[3].slider("gpu_memory_utilization", 0.05, 1.0, step=0.01, value=persist.now("mem_eng_util", float),
                key="mem_eng_util", persist_state="session")
    c = st.columns(4)
    c[0].number_input("llama.cpp -np", min_value=1, max_value=1024, step=1, value=persist.now("mem_eng_np", int),
                      key="mem_eng_np", persist_state="session")
    c[1].selectbox("llama.cpp -ctk", tuple(CACHE_TYPES), index=persist.index_of("mem_eng_ctk", tuple(CACHE_TYPES)),
                   key="mem_eng_ctk", persist_state="session")
    c[2].selectbox("llama.cpp -ctv", tuple(CACHE_TYPES), index=persist.index_of("mem_eng_ctv", tuple(CACHE_TYPES)),
                   key="mem_eng_ctv", persist_state="session")
    c[3].slider("SGLang mem_fraction_static", 0.05, 0.99, step=0.01, value=persist.now("mem_eng_frac", float),
                key="mem_eng_frac", persist_state="session")
    c = st.columns(4)
    c[0].selectbox("vLLM --device", DEVICES, index=persist.index_of("mem_eng_device", DEVICES), key="mem_eng_device",
                   persist_state="session",
                   help="cpu: vLLM's CPU backend: block size 128 (unless the sidebar's block size is changed), the "
                        "available KV memory is VLLM_CPU_KVCACHE_SPACE (whole GiB), no async scheduling.")
    c[1].checkbox("vLLM async scheduling", value=persist.now("mem_eng_async", bool), key="mem_eng_async",
                  persist_state="session",
                  help="On by default on GPUs (two batches in flight); off is --no-async-scheduling.")
    c[2].number_input("llama.cpp -ub (--ubatch-size)", min_value=1, max_value=1 << 20, step=256,
                      value=persist.now("mem_eng_ub", int), key="mem_eng_ub", persist_state="session",
                      help="n_ubatch: the sliding-window cache keeps window + n_ubatch cells (default 512).")
    c[3].selectbox("llama.cpp -fa (--flash-attn)", ("auto", "on", "off"),
                   index=persist.index_of("mem_eng_fa", ("auto", "on", "off")), key="mem_eng_fa",
                   persist_state="session",
                   help="Off stores V transposed, padded to the widest layer, and refuses a quantized V cache.")
    st.file_uploader("vLLM/SGLang --draft-config: a speculative draft's config.json (EAGLE or a draft model)", type=["json"],
                     key="mem_eng_draft", max_upload_size=1,
                     help="Its layers hold KV beside the target's in vLLM's blocks; SGLang gives the draft a pool "
                          "of its own with the target's #tokens.")
    c = st.columns(4)
    c[0].checkbox("SGLang: multimodal model", value=persist.now("mem_eng_sgl_mm", bool), key="mem_eng_sgl_mm",
                  persist_state="session",
                  help="SGLang 0.5.23 takes a multimodal model's reserve out of the pool's budget: "
                       "SGLANG_VLM_CACHE_SIZE_MB (100 MiB), plus SGLANG_MM_FEATURE_CACHE_MB (1,024 MiB) when the "
                       "features travel by cuda_ipc or cuda_vmm.")
    c[1].selectbox("SGLang --mm-feature-transport", MM_TRANSPORTS,
                   index=persist.index_of("mem_eng_sgl_transport", MM_TRANSPORTS), key="mem_eng_sgl_transport",
                   persist_state="session",
                   help="cpu is the default on one node; cuda_ipc and cuda_vmm keep a GPU pool for the features.")
    c = st.columns([1, 3])
    c[0].checkbox("llama.cpp --swa-full", value=persist.now("mem_eng_swa_full", bool), key="mem_eng_swa_full",
                  persist_state="session")
    c[1].text_input("Request lengths as percentiles (vLLM), e.g. 50:2000,90:8000,99:16000",
                    value=persist.now("mem_eng_pcts"), key="mem_eng_pcts", persist_state="session",
                    max_chars=400, help="Prompt + output tokens of real requests: how many of them vLLM's blocks "
                                        "hold at once, against everyone at max_model_len.")


def usable_gpu(req: MemoryRequest) -> tuple[float | None, str]:
    """The GPU memory an engine sizes against: nvidia-smi's total for a preset GPU left at its nominal size
    (with the words to say so), else the sidebar's figure."""
    g = load_gpus().get(session.get("mem_gpu_kind", ""))
    if g is not None and g.usable_mib and req.gpu_gib == float(g.memory_gib):
        return g.usable_gib, (f"{g.name}: {g.usable_mib:,} MiB usable (what nvidia-smi reports), "
                              f"{g.memory_gib} GiB nominal")
    if g is not None and req.gpu_gib == float(g.memory_gib):  # the menu's GiB, the same unit as every figure
        return req.gpu_gib, f"{g.name}: {g.memory_gib} GiB nominal (no nvidia-smi total on file)"
    return req.gpu_gib, "" if req.gpu_gib is None else f"GPU {req.gpu_gib:g} GiB (as entered)"


def draft_spec() -> ModelSpec | None:
    """The uploaded draft config.json, parsed like any config (a ConfigError names its problems)."""
    up = session.get("mem_eng_draft")
    if up is None:
        return None
    data = up.getvalue()
    if len(data) > MAX_CONFIG_BYTES:
        raise CalcError([f"the draft config.json is {len(data):,} bytes; at most {MAX_CONFIG_BYTES:,}"])
    return parse_config_text(data, "the draft's " + str(up.name)[:80])


def _block_size(req: MemoryRequest, device: str) -> int:
    """The sidebar's block size, or the CPU backend's 128 when the sidebar is left at vLLM's GPU default."""
    return default_block_size(device) if req.block_size == DEFAULT_BLOCK_SIZE else req.block_size


def _request(engine: str, req: MemoryRequest, params: int | None) -> EngineRequest:
    ss = session.mapping()
    gib = float(ss["mem_eng_kv_gib"]) or None
    device = str(ss["mem_eng_device"])
    return EngineRequest(
        engine=engine, max_model_len=req.seq_len, kv_dtype=req.kv_dtype, kv_memory_gib=gib, gpu_gib=usable_gpu(req)[0],
        weight_dtype=req.weight_dtype, params=params, tp=req.tp, pp=int(ss["mem_eng_pp"]),
        block_size=_block_size(req, device) if engine == "vllm" else req.block_size,
        max_num_batched_tokens=int(ss["mem_eng_batched"]) or None, gpu_name=_gpu_name(),
        gpu_memory_utilization=float(ss["mem_eng_util"]),
        hybrid=req.use_windows, n_seq=int(ss["mem_eng_np"]), type_k=ss["mem_eng_ctk"], type_v=ss["mem_eng_ctv"],
        swa_full=bool(ss["mem_eng_swa_full"]), mem_fraction_static=float(ss["mem_eng_frac"]),
        lengths=_lengths() if engine == "vllm" else (), device=device, async_scheduling=bool(ss["mem_eng_async"]),
        draft=draft_spec() if engine in ("vllm", "sglang") else None, n_ubatch=int(ss["mem_eng_ub"]),
        flash_attn=ss["mem_eng_fa"] != "off", multimodal=bool(ss["mem_eng_sgl_mm"]),
        mm_feature_transport=str(ss["mem_eng_sgl_transport"]))


def _gpu_name() -> str:
    g = load_gpus().get(session.get("mem_gpu_kind", ""))
    return g.name if g is not None else ""


def _lengths() -> tuple[int, ...]:
    text = str(session.get("mem_eng_pcts", "")).strip()
    return tuple(lengths_from_percentiles(parse_percentiles(text))) if text else ()


def _column(col: DeltaGenerator, title: str, spec: ModelSpec, er: EngineRequest) -> None:
    col.markdown(f"**{title}**")
    try:
        d, text = engine_report(spec, er)
    except CalcError as e:
        col.warning("\n".join(f"- {md_plain(p)}" for p in e.problems))
        return
    if er.engine == "vllm":
        dev = "CPU" if er.device == "cpu" else "GPU"
        col.metric(f"vLLM: {dev} KV cache size", f"{d['kv_cache_tokens']:,} tokens" if d["fits"] else "does not fit")
        if d.get("length_mix"):
            mix = d["length_mix"]
            col.metric("vLLM: requests of this length mix at once", f"{mix['concurrent_requests']:,.1f}")
        col.caption(f"{d['num_blocks']:,} blocks of {d['block_size']}; "
                    f"max concurrency at {er.max_model_len:,} tokens {d['max_concurrency']:.2f}x; "
                    f"available {d['available_kv_bytes'] / GIB:,.2f} GiB ({d['available_kv_source']})")
    elif er.engine == "llama.cpp":
        col.metric("llama.cpp: KV allocated", f"{exact_ratio(int(d['kv_bytes']), GIB)} GiB")  # exact at any size
        col.caption(f"-c {er.max_model_len:,} padded to {d['n_ctx_padded']:,}, -np {er.n_seq}, -ub {er.n_ubatch}")
    else:
        col.metric("SGLang: #tokens", f"{d['max_total_num_tokens']:,}")
        col.caption(("rest memory given (exact)" if d["exact"] else "rest memory estimated from the GPU and weights")
                    + (f"; multimodal reserve {d['mm_reserve_bytes'] / GIB:,.4f} GiB taken off"
                       if d["mm_reserve_bytes"] else ""))
    col.code(text, language=None, wrap_lines=True)  # a third of the page: long lines wrap, never scroll away


def section(spec: ModelSpec, req: MemoryRequest, params: int | None) -> None:
    """The three engines for the sidebar's model, context (as max_model_len), TP, KV dtype and GPU."""
    for k, v in DEFAULTS.items():
        session.setdefault(k, v)
    st.subheader("Engine: what vLLM, llama.cpp and SGLang allocate")
    st.caption("The context is the engines' max_model_len / -c; TP, the KV dtype, the block size and the GPU come "
               "from the sidebar. Only vLLM's tokens from a logged available memory are exact; an estimate says so.")
    _controls()
    words = usable_gpu(req)[1]
    if words:
        st.caption(md_plain(words))
    cols = st.columns(3)
    for col, (engine, title) in zip(cols, (("vllm", "vLLM V1"), ("llama.cpp", "llama.cpp"), ("sglang", "SGLang"))):
        try:
            er = _request(engine, req, params)
        except CalcError as e:  # the percentiles box
            col.markdown(f"**{title}**")
            col.warning("\n".join(f"- {md_plain(p)}" for p in e.problems))
            continue
        _column(col, title, spec, er)
    if spec.provenance:
        with st.expander("Where each figure comes from (provenance)"):
            st.dataframe(pd.DataFrame(list(spec.provenance), columns=["figure", "from"]), hide_index=True,
                         key="mem_eng_provenance")
    _reconciler(spec, req)


def _reconciler(spec: ModelSpec, req: MemoryRequest) -> None:
    """A pasted startup log's cache lines beside kvviz's figures for the sidebar's model: vLLM's, llama.cpp's
    or SGLang's (the CLI's ``memory [--engine E] --reconcile LOG``)."""
    st.markdown("**Reconcile an engine's startup log**")
    engine = st.radio("The log is from", tuple(LOG_EXAMPLES),
                      index=persist.index_of("mem_eng_log_engine", tuple(LOG_EXAMPLES)), key="mem_eng_log_engine",
                      persist_state="session",
                      horizontal=True,
                      help="Each engine's log says its KV cache in its own lines; kvviz reads them and sets its "
                           "own figure for the sidebar's model beside each.")
    text = st.text_area(f"Paste {engine}'s startup lines", value=persist.now("mem_eng_log"), key="mem_eng_log",
                        persist_state="session",
                        height=140, max_chars=MAX_LOG_CHARS,
                        placeholder=LOG_EXAMPLES[engine])
    if not text.strip():
        return
    said: list[str] = []
    try:
        if engine == "llama.cpp":
            rows, notes = _llamacpp_rows(spec, req, text)
        elif engine == "SGLang":  # the log's TP and dtype unless the sidebar's differ from the defaults
            rows, notes = reconcile_sglang(spec, parse_sglang_log(text), req.tp if req.tp > 1 else None,
                                           "fp8" if req.kv_dtype == "fp8" else None)
        else:
            rows, said, notes = _vllm_rows(spec, req, text)
    except CalcError as e:
        st.error("Cannot reconcile:\n\n" + "\n".join(f"- {md_plain(p)}" for p in e.problems))
        return
    table = safe_frame([{"line": r.what, "logged": r.logged, "kvviz": r.predicted, "agrees": r.agrees, "why": r.why}
                        for r in rows])
    # A table, not a dataframe: its "why" sentences wrap in their column instead of being cut at
    # the grid's column width (a 1366 px screen showed a third of each). Cells are text, never Markdown.
    with st.container(key="mem_eng_rows"):
        st.table(table, hide_index=True)
    for n in said + notes:
        st.caption(md_plain(n))


def _llamacpp_rows(spec: ModelSpec, req: MemoryRequest, text: str) -> tuple[list[Row], list[str]]:
    """llama.cpp's log: its rows and notes (raises CalcError). An older build's line states no cells:
    the log's own n_ctx line sizes it, else the sidebar's context, which a note then names."""
    log = parse_llamacpp_log(text)
    rows, notes = reconcile_llamacpp(spec, log, None if log.n_ctx else req.seq_len)
    if log.lines[0].cells is None and log.n_ctx is None:
        notes = [f"the log states neither its cells nor n_ctx: sized at the sidebar's context, {req.seq_len:,} "
                 "tokens"] + notes
    return rows, notes


def _vllm_rows(spec: ModelSpec, req: MemoryRequest, text: str) -> tuple[list[Row], list[str], list[str]]:
    """vLLM's log: its rows, what the log said of its flags, and the notes (raises CalcError)."""
    log = parse_vllm_log(text)
    given = {"max_model_len": None, "tp": req.tp if req.tp > 1 else None, "block_size": None,
             "kv_dtype": req.kv_dtype if req.kv_dtype == "fp8" else None}
    flags, said = settings_from_log(log, given)
    if not log.found:
        reconcile(spec, log, VLLMSettings(0, 1))  # the sentence for a log without KV lines
    device = "cpu" if log.device == "CPU" else str(session.read("mem_eng_device"))
    s = VLLMSettings(0, flags.get("max_model_len") or req.seq_len, flags.get("block_size")
                     or _block_size(req, device), flags.get("tp") or req.tp,
                     flags.get("pp") or int(session.read("mem_eng_pp")), flags.get("kv_dtype") or req.kv_dtype,
                     flags.get("max_num_batched_tokens") or int(session.read("mem_eng_batched"))
                     or default_batched_tokens(usable_gpu(req)[0], _gpu_name(), device, req.tp),
                     req.use_windows, device, bool(session.read("mem_eng_async")), draft_spec())
    rows, notes = reconcile(spec, log, s)
    params = req.params if req.params is not None else spec.params
    weights = None if params is None else -(-weight_bytes(params, req.weight_dtype) // (s.tp * s.pp))
    rows += profile_rows(log, weights, estimate_parts(spec, EngineRequest(
        "vllm", s.max_model_len, tp=s.tp, max_num_batched_tokens=s.max_num_batched_tokens)))
    return rows, said, notes
