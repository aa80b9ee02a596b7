"""llama.cpp and SGLang startup logs, pasted: their KV lines read out and each set beside kvviz's sizing of
the same model (server_llamacpp, server_sglang). vLLM's lines are read by server_log.

llama.cpp prints one summary a cache (src/llama-kv-cache.cpp's constructor; an iSWA model prints two, after
"llama_kv_cache_iswa: creating non-SWA / SWA KV cache"): "llama_kv_cache: size = X MiB (N cells, L layers,
S/T seqs), K (type): X MiB, V (type): X MiB", S the sequences and T the streams ("llama_kv_cache_unified:" in
mid-2025 builds). Builds before the unified cache printed "KV self size = X MiB, K (type): X MiB, V (type): X
MiB" beside "n_ctx = N"; the ik_llama.cpp fork prints an MLA cache as "KV self size = X MiB, c^KV (type): X
MiB". The sizing is rebuilt from what the log states (cells x streams, the sequences, the types, n_ubatch)
and every cache compared at the log's own two decimals of MiB.

SGLang (python/sglang/srt/mem_cache/memory_pool.py; 0.5.23 names the dtype, :2088-2090, older versions did
not: both are read) prints "KV Cache is allocated. [dtype: D, ]#tokens: N,
K size: X GB, V size: Y GB" (MLA: "KV size: X GB"), GB meaning 2^30 bytes, and each TP rank "Load weight
begin. avail mem=X GB" and "Load weight end. ... avail mem=Y GB"; server_args gives mem_fraction_static and
tp_size; a multimodal model's "Reserving X GB of the KV budget" line (0.5.23) is taken off the budget.
#tokens is compared with the pool kvviz sizes from the smallest of each (profile_max_num_token
takes the minimum over the ranks) over every value the two-decimal figures can hide; the sizes are
compared exactly, from the logged #tokens.

Reading never raises on odd text: unknown lines are skipped; a log with no KV line is a CalcError with one
sentence.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kvviz.calculator.server_llamacpp import CACHE_TYPES, MIB, llamacpp_sizing
from kvviz.calculator.server_log import Row
from kvviz.calculator.server_sglang import SGLANG_DTYPE_BYTES, sglang_rest_logged, sglang_sizing
from kvviz.calculator.spec import CalcError, ModelSpec
from kvviz.units import GIB

_F = r"(\d{1,9}(?:\.\d{1,6})?)"
_LLAMA = re.compile(r"llama_kv_cache(?:_unified)?:\s+size\s*=\s*" + _F + r"\s*MiB\s*\(\s*(\d{1,9})\s+cells,\s*(\d{1,6})"
                    r"\s+layers,\s*(\d{1,4})/(\d{1,4})\s+seqs\),\s*K\s*\((\w{1,8})\):\s*" + _F
                    + r"\s*MiB,\s*V\s*\((\w{1,8})\):\s*" + _F + r"\s*MiB")
_LLAMA_OLD = re.compile(r"KV self size\s*=\s*" + _F + r"\s*MiB,\s*K\s*\((\w{1,8})\):\s*" + _F
                        + r"\s*MiB,\s*V\s*\((\w{1,8})\):\s*" + _F + r"\s*MiB")
_LLAMA_IK_MLA = re.compile(r"KV self size\s*=\s*" + _F + r"\s*MiB,\s*c\^KV\s*\((\w{1,8})\):\s*" + _F + r"\s*MiB")
_ISWA = re.compile(r"creating\s+(non-SWA|SWA)\s+KV cache")
_N_CTX = re.compile(r"\bn_ctx\s*=\s*(\d{1,9})\b")
_N_UBATCH = re.compile(r"\bn_ubatch\s*=\s*(\d{1,9})\b")
_FLASH = re.compile(r"\bflash_attn\s*=\s*(\w{1,9})")
_SGL_POOL = re.compile(r"KV Cache is allocated\.\s*(?:dtype:\s*torch\.(\w{1,24}),\s*)?#tokens:\s*(\d{1,12}),\s*"
                       r"(?:K size:\s*" + _F + r"\s*GB,\s*V size:\s*" + _F + r"\s*GB|KV size:\s*" + _F + r"\s*GB)")
_SGL_BEFORE = re.compile(r"Load weight begin\.\s*avail mem=" + _F + r"\s*GB")
_SGL_AFTER = re.compile(r"Load weight end\..{0,400}?avail mem=" + _F + r"\s*GB")
_SGL_MM = re.compile(r"Reserving\s+" + _F + r"\s*GB of the KV budget")  # kv_cache_configurator.py:214-218 (0.5.23)
_SGL_FRACTION = re.compile(r"mem_fraction_static=(\d(?:\.\d{1,20})?)")
_SGL_TP = re.compile(r"\btp_size=(\d{1,4})")
_SGL_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
               "uint8": "fp8"}


@dataclass(frozen=True)
class LlamaCppLine:
    """One cache summary of a llama.cpp log (cells, layers and streams are None in the pre-unified format)."""

    label: str  # "", "non-SWA" or "SWA"
    total_mib: float
    cells: int | None
    layers: int | None
    seqs: int | None
    streams: int | None
    type_k: str
    k_mib: float
    type_v: str
    v_mib: float


@dataclass(frozen=True)
class LlamaCppLog:
    lines: tuple[LlamaCppLine, ...]
    n_ctx: int | None
    n_ubatch: int | None
    flash_attn: bool | None


def parse_llamacpp_log(text: str) -> LlamaCppLog:
    """The KV summaries of a llama.cpp log, in order (the first of each cache when the log repeats them)."""
    lines: list[LlamaCppLine] = []
    label = ""
    for raw in text.splitlines():
        if m := _ISWA.search(raw):
            label = m.group(1)
        elif m := _LLAMA.search(raw):
            g = m.groups()
            lines.append(LlamaCppLine(label, float(g[0]), int(g[1]), int(g[2]), int(g[3]), int(g[4]), g[5],
                                      float(g[6]), g[7], float(g[8])))
        elif m := _LLAMA_OLD.search(raw):
            g = m.groups()
            lines.append(LlamaCppLine("", float(g[0]), None, None, None, None, g[1], float(g[2]), g[3], float(g[4])))
        elif m := _LLAMA_IK_MLA.search(raw):
            g = m.groups()
            lines.append(LlamaCppLine("", float(g[0]), None, None, None, None, g[1], float(g[2]), g[1], 0.0))
    seen, unique = set(), []
    for ln in lines:  # a log may print a context twice (a draft's, a rerun): keep each cache's first line
        if ln.label not in seen:
            seen.add(ln.label)
            unique.append(ln)
    ctx, ub, fa = _N_CTX.search(text), _N_UBATCH.search(text), _FLASH.search(text)
    flash = None if fa is None or fa.group(1) == "auto" else fa.group(1) in ("1", "enabled", "on", "true")
    return LlamaCppLog(tuple(unique), int(ctx.group(1)) if ctx else None, int(ub.group(1)) if ub else None, flash)


def _mib(b: int) -> str:
    return f"{b / MIB:.2f}"


def reconcile_llamacpp(spec: ModelSpec, log: LlamaCppLog, n_ctx: int | None = None) -> tuple[list[Row], list[str]]:
    """Each cache line of a llama.cpp log beside kvviz's (llamacpp_sizing) for the context, sequences, types and
    n_ubatch the log states; ``n_ctx`` for a pre-unified log that does not print it."""
    if not log.lines:
        raise CalcError(["no llama.cpp KV-cache line found: paste the lines with 'llama_kv_cache: size = ...' (or "
                         "'KV self size = ...' from older builds)"])
    first = log.lines[0]
    notes: list[str] = []
    types = [t for t in (first.type_k, first.type_v) if t not in CACHE_TYPES]
    if types:
        raise CalcError([f"the log's cache type {types[0]!r} is not one kvviz knows ({', '.join(CACHE_TYPES)})"])
    if first.cells is not None and first.streams is not None and first.seqs is not None:
        seqs, unified = first.seqs, first.streams == 1 and first.seqs > 1
        ctx = first.cells * first.streams
    else:
        seqs, unified = 1, False
        ctx = n_ctx or log.n_ctx
        if ctx is None:
            raise CalcError(["this llama.cpp log's KV line does not state its cells: give the context (-c, "
                             "--max-model-len) or paste the 'n_ctx = N' line"])
    ll = llamacpp_sizing(spec, ctx, seqs, first.type_k, first.type_v, unified=unified, n_ubatch=log.n_ubatch or 512,
                         flash_attn=True if log.flash_attn is None else log.flash_attn)
    if log.n_ubatch is None and any(c.label == "SWA" for c in ll.caches):
        notes.append("the log does not print n_ubatch: the sliding cache is sized with llama.cpp's default 512 (-ub)")
    rows = []
    for i, got in enumerate(log.lines):
        if i >= len(ll.caches):
            rows.append(Row(f"KV cache {got.label or i + 1}", f"{got.total_mib:.2f} MiB", "none", False,
                            "kvviz sizes fewer caches for this model (an indexer or recurrent cache it does not model)"))
            continue
        c = ll.caches[i]
        same_shape = got.cells in (None, c.cells) and got.layers in (None, c.layers)
        ok = same_shape and _mib(c.k_bytes) == f"{got.k_mib:.2f}" and _mib(c.v_bytes) == f"{got.v_mib:.2f}"
        shape = "" if got.cells is None else f" ({got.cells:,} cells, {got.layers} layers)"
        why = "llama.cpp's line, figure for figure (MiB to two decimals)" if ok else (
            "another cell count: -ub, --swa-full or the context differ" if got.cells not in (None, c.cells) else
            "another layer count: layers reusing another's cache, or another GGUF" if not same_shape else
            "other bytes a cell: the K/V row (KV heads x head_dim; MLA as K only) or the cache type")
        rows.append(Row(f"KV cache {c.label or 'size'}", f"{got.total_mib:.2f} MiB{shape}, K {got.k_mib:.2f}, "
                        f"V {got.v_mib:.2f}", f"{c.bytes / MIB:.2f} MiB ({c.cells:,} cells, {c.layers} layers), K "
                        f"{_mib(c.k_bytes)}, V {_mib(c.v_bytes)}", ok, why))
    return rows, notes + list(ll.notes)


@dataclass(frozen=True)
class SGLangLog:
    tokens: int | None
    k_gb: float | None
    v_gb: float | None
    kv_gb: float | None  # MLA: one latent buffer
    dtype: str | None  # kvviz's name of the pool's dtype, when the line carries it
    before_gb: float | None  # the smallest "Load weight begin" figure over the ranks
    after_gb: float | None  # the smallest "Load weight end" figure
    mem_fraction_static: float | None
    tp: int | None
    mm_reserve_gb: float = 0.0  # 0.5.23's "Reserving X GB of the KV budget for post-sizing multimodal ..."


def parse_sglang_log(text: str) -> SGLangLog:
    """The pool line (the target's: the first) and the memory figures of an SGLang log."""
    pool = _SGL_POOL.search(text)
    before = [float(x) for x in _SGL_BEFORE.findall(text)]
    after = [float(x) for x in _SGL_AFTER.findall(text)]
    frac, tp, mm = _SGL_FRACTION.search(text), _SGL_TP.search(text), _SGL_MM.search(text)
    g = pool.groups() if pool else (None,) * 5
    return SGLangLog(int(g[1]) if g[1] else None, float(g[2]) if g[2] else None, float(g[3]) if g[3] else None,
                     float(g[4]) if g[4] else None, _SGL_DTYPES.get(g[0] or ""), min(before, default=None),
                     min(after, default=None), float(frac.group(1)) if frac else None, int(tp.group(1)) if tp else None,
                     float(mm.group(1)) if mm else 0.0)


def reconcile_sglang(spec: ModelSpec, log: SGLangLog, tp: int | None = None,
                     kv_dtype: str | None = None) -> tuple[list[Row], list[str]]:
    """The logged #tokens beside the pool kvviz sizes from the log's memory figures, and the logged K/V sizes
    beside the pool of the logged #tokens (page size 1, SGLang's default)."""
    if log.tokens is None:
        raise CalcError(["no SGLang KV-cache line found: paste the 'KV Cache is allocated. #tokens: ...' line (with "
                         "the 'Load weight begin/end ... avail mem' lines to check the token count)"])
    tp = tp or log.tp or 1
    dtype = kv_dtype or log.dtype or "bf16"
    if dtype not in SGLANG_DTYPE_BYTES:
        raise CalcError([f"SGLang's KV cache is fp16, bf16, fp32 or fp8; {dtype} is not one of them"])
    notes = [] if log.dtype or kv_dtype else ["the pool line does not name its dtype (an SGLang older than 0.5.23's "
                                              "memory_pool.py:2088-2090 line): bf16 assumed; give --kv-cache-dtype "
                                              "otherwise"]
    exact = sglang_sizing(spec, 0 if log.tokens == 0 else log.tokens * _cell(spec, tp, dtype), tp, dtype)
    rows = []
    if log.before_gb is not None and log.after_gb is not None and log.mem_fraction_static is not None:
        f = log.mem_fraction_static
        # the multimodal reserve is logged to two decimals too (0.5.23: kv_cache_configurator.py:3034-3038)
        mm = (log.mm_reserve_gb + 0.005, log.mm_reserve_gb - 0.005) if log.mm_reserve_gb else (0.0, 0.0)
        lo = sglang_sizing(spec, sglang_rest_logged(log.before_gb + 0.005, log.after_gb - 0.005, f, mm[0])[0], tp, dtype)
        hi = sglang_sizing(spec, sglang_rest_logged(log.before_gb - 0.005, log.after_gb + 0.005, f, mm[1])[0], tp, dtype)
        ok = lo.tokens <= log.tokens <= hi.tokens
        rows.append(Row("#tokens", f"{log.tokens:,}", f"{lo.tokens:,}-{hi.tokens:,}", ok,
                        f"from avail mem {log.before_gb:.2f} GB before and {log.after_gb:.2f} GB after loading, "
                        f"mem_fraction_static {f:g}"
                        + (f", less the {log.mm_reserve_gb:.2f} GB multimodal reserve" if log.mm_reserve_gb else "")
                        + ", within their two-decimal rounding" if ok else
                        "outside the rounding of the avail mem figures: another SGLang's rule (a speculative draft's "
                        "layers in the cell, a Mamba pool) or a hybrid pool kvviz sizes otherwise"))
    else:
        notes.append("the log lacks the 'Load weight begin/end ... avail mem' lines or mem_fraction_static: only "
                     "the sizes are compared")
    if log.kv_gb is not None:
        got, pred = f"{log.kv_gb:.2f} GB", f"{exact.k_bytes / GIB:.2f} GB"
        rows.append(Row("KV size (MLA)", got, pred, got == pred,
                        "the latent buffer of #tokens + 1 slots" if got == pred else
                        "differs: kvviz's model is not MLA here, or another KV dtype"))
    elif log.k_gb is not None and log.v_gb is not None:
        got, pred = f"{log.k_gb:.2f} / {log.v_gb:.2f} GB", f"{exact.k_bytes / GIB:.2f} / {exact.v_bytes / GIB:.2f} GB"
        rows.append(Row("K size / V size", got, pred, got == pred,
                        "the K and V buffers of #tokens + 1 slots" if got == pred else
                        "differs: another KV dtype, TP or head count"))
    return rows, notes


def _cell(spec: ModelSpec, tp: int, dtype: str) -> int:
    """Bytes a token in SGLang's pool (sglang_sizing's cell): one pool of exactly ``tokens`` is tokens x cell."""
    return sglang_sizing(spec, 1 << 40, tp, dtype).cell_bytes
