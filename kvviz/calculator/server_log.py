"""vLLM startup logs, pasted: the KV lines read out, kvviz's prediction put beside each, and
every difference explained (the rounding of the printed GiB, another block size or KV dtype,
another vLLM version's formula, the smallest GPU of a TP/PP group).

Three generations of the lines are read: vLLM 0.33's one line "GPU KV cache size: N tokens, Maximum
concurrency for L tokens per request: Cx" (N = int(C x L), kv_cache_utils.py:1120-1153; "CPU" on
the CPU backend), the two lines of earlier V1 (N = blocks // groups x block size) and V0's blocks.
The too-long error's wording tells the versions apart too: "model's" (0.33, checked against the
available memory less the null block, kv_cache_planning.py:66-86, 1528-1537) or "models's" (earlier).

Reading never raises on strange text: lines it does not know are skipped, numbers it cannot
read are skipped, and text with no KV line at all is a CalcError with one clear sentence.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from kvviz.calculator.server_log_explain import explain_needed, explain_tokens, line_tokens, sizes
from kvviz.calculator.server_vllm import VLLMSettings, VLLMSizing, format_gib, vllm_sizing
from kvviz.calculator.server_vllm_kv import KV_DTYPES
from kvviz.calculator.spec import CalcError, ModelSpec
from kvviz.units import GIB

MAX_LOG_CHARS = 2_000_000  # a startup log is a few hundred KB at most
_NUM = r"(\d[\d,]{0,20})"
_FLOAT = r"(\d{1,9}(?:\.\d{1,6})?)"
_PATTERNS: dict[str, re.Pattern[str]] = {
    "available_gib": re.compile(r"Available KV cache memory:\s*" + _FLOAT + r"\s*GiB"),
    "kv_cache_size_gib": re.compile(r"kv_cache_size=" + _FLOAT + r"\s*GiB"),  # V0's "Memory profiling results"
    "rest_gib": re.compile(r"the rest of the memory reserved for KV Cache is\s*" + _FLOAT + r"\s*GiB"),  # later V0
    "tokens": re.compile(r"\b([A-Z]{2,5})(?: \+ host)? KV cache size:\s*" + _NUM + r"\s*tokens"),
    "concurrency": re.compile(r"Maximum concurrency for\s*" + _NUM + r"\s*tokens per request:\s*" + _FLOAT + "x"),
    "gpu_blocks": re.compile(r"#?\s*GPU blocks:\s*" + _NUM),
    "too_long": re.compile(r"(models?'s) max seq len \(" + _NUM + r"\),\s*\(" + _FLOAT
                           + r" GiB KV cache is needed, which is larger "
                           r"than the available KV cache memory \(" + _FLOAT + r" GiB\)\.(?:\s*Based on the available "
                           r"memory, the estimated maximum model length is " + _NUM + r")?"),
    # V0 printed "Loading model weights took X GB" with X in GiB (it divided by 2^30); V1 "Model loading took X GiB"
    "weights_gib": re.compile(r"(?:model weights take|[Mm]odel weights took|Model loading took)\s*" + _FLOAT
                              + r"\s*Gi?B"),
    "non_torch_gib": re.compile(r"non_torch_memory(?:=| takes\s*)" + _FLOAT + r"\s*GiB"),
    "activation_gib": re.compile(r"activation peak memory takes\s*" + _FLOAT + r"\s*GiB"),
    "too_long_v0": re.compile(r"max seq len \(" + _NUM + r"\) is larger than the maximum number of tokens that can be "
                              r"stored in KV cache \(" + _NUM + r"\)"),
}
# A setting's value as the log writes it, sign and all: "-5" or "0" is read so that it can be named
# as ignored (a silent skip left the user believing kvviz had used it).
_SIGNED = r"(-?\d[\d,]{0,20})"
_SETTINGS: dict[str, re.Pattern[str]] = {
    "max_model_len": re.compile(r"(?:'max_model_len':\s*|max_seq_len=|--max-model-len[ =])" + _SIGNED),
    "tp": re.compile(r"(?:tensor_parallel_size[=:]\s*|'tensor_parallel_size':\s*|--tensor-parallel-size[ =])"
                     + _SIGNED),
    "pp": re.compile(r"(?:pipeline_parallel_size[=:]\s*|'pipeline_parallel_size':\s*)" + _SIGNED),
    "block_size": re.compile(r"(?:'block_size':\s*|block_size=|--block-size[ =])" + _SIGNED),
    "kv_dtype": re.compile(r"(?:kv_cache_dtype=|'kv_cache_dtype':\s*'|--kv-cache-dtype[ =])([a-z0-9_]{2,24})"),
    "max_num_batched_tokens": re.compile(r"max_num_batched_tokens[=:]\s*" + _SIGNED),
}
# The most a setting can plausibly be: past it the value is named as ignored, not used.
_SETTING_MAX = {"max_model_len": 1 << 40, "tp": 1024, "pp": 1024, "block_size": 4096,
                "max_num_batched_tokens": 1 << 40}
_LOG_NAMES = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size"}  # as the log writes them
# vLLM's --kv-cache-dtype choices; "auto" and "bfloat16" keep the model's dtype (kvviz's KV dtype setting).
VLLM_KV_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")


@dataclass(frozen=True)
class ParsedLog:
    """The KV figures a log states (None: not in the log) and the flags it shows."""

    available_gib: float | None = None
    tokens: int | None = None
    concurrency_len: int | None = None
    concurrency: float | None = None
    gpu_blocks: int | None = None
    too_long: tuple[int, float, float, int | None] | None = None  # (max_model_len, needed GiB, available GiB, estimate)
    device: str | None = None  # "GPU" / "CPU": the token line's first word
    one_line: bool = False  # vLLM 0.33's single line: tokens = int(concurrency x max_model_len)
    model_s: bool = False  # the too-long error says "model's" (0.33: the null block is held back)
    too_long_v0: tuple[int, int] | None = None  # (max_model_len, tokens that fit)
    weights_gib: float | None = None  # the memory-profiling line's parts (V0 and early V1)
    non_torch_gib: float | None = None
    activation_gib: float | None = None
    settings: tuple[tuple[str, Any], ...] = ()
    lines_read: int = 0
    ignored: tuple[str, ...] = ()  # a sentence for each setting the log states but kvviz cannot use

    @property
    def found(self) -> bool:
        return any(v is not None for v in (self.available_gib, self.tokens, self.concurrency, self.gpu_blocks,
                                           self.too_long, self.too_long_v0))

    def setting(self, name: str) -> Any:
        return dict(self.settings).get(name)


def _int(s: str | None) -> int | None:
    if s is None:
        return None
    try:
        return int(s.replace(",", ""))
    except ValueError:
        return None


def _float(s: str | None) -> float | None:
    try:
        v = float(s) if s is not None else None
    except ValueError:
        return None
    return v if v is not None and math.isfinite(v) else None


def parse_vllm_log(text: str) -> ParsedLog:
    """The last value of each KV line in ``text`` (a restarted server logs them again)."""
    if not isinstance(text, str):
        raise CalcError(["the log must be text"])
    if len(text) > MAX_LOG_CHARS:
        raise CalcError([f"the log is {len(text):,} characters; paste at most {MAX_LOG_CHARS:,} (the KV lines are "
                         "near the end of the startup)"])
    got: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    lines = text.splitlines()
    for line in lines:
        line = line[:20_000]  # a pathological line cannot make a regex crawl
        for key, pat in _PATTERNS.items():
            m = pat.search(line)
            if not m:
                continue
            if key in ("available_gib", "kv_cache_size_gib", "rest_gib"):
                got["available_gib"] = _float(m.group(1))
            elif key in ("weights_gib", "non_torch_gib", "activation_gib"):
                got[key] = _float(m.group(1))
            elif key == "tokens":
                got["device"], got["tokens"] = m.group(1), _int(m.group(2))
                got["one_line"] = bool(_PATTERNS["concurrency"].search(line))
            elif key == "gpu_blocks":
                got["gpu_blocks"] = _int(m.group(1))
            elif key == "concurrency":
                got["concurrency_len"], got["concurrency"] = _int(m.group(1)), _float(m.group(2))
            elif key == "too_long":
                L, need, avail = _int(m.group(2)), _float(m.group(3)), _float(m.group(4))
                if None not in (L, need, avail):
                    got["too_long"] = (L, need, avail, _int(m.group(5)))
                    got["model_s"] = m.group(1) == "model's"
            elif key == "too_long_v0":
                L, fit = _int(m.group(1)), _int(m.group(2))
                if None not in (L, fit):
                    got["too_long_v0"] = (L, fit)
        for key, pat in _SETTINGS.items():
            m = pat.search(line)
            if m:
                settings[key] = m.group(1) if key == "kv_dtype" else _int(m.group(1))
    ignored = [_ignored(k, v) for k, v in settings.items() if k != "kv_dtype" and _ignored(k, v)]
    settings = {k: v for k, v in settings.items() if k == "kv_dtype" or not _ignored(k, v)}
    return ParsedLog(settings=tuple(sorted(settings.items())), lines_read=len(lines), ignored=tuple(ignored), **got)


def _ignored(key: str, v: int | None) -> str:
    """'' for a usable value of a numeric setting, else why it is ignored."""
    if v is not None and 1 <= v <= _SETTING_MAX[key]:
        return ""
    shown = "unreadable" if v is None else f"{v:,}"
    name = _LOG_NAMES.get(key, key)
    return (f"the log's {name} {shown} ignored: it must be an integer from 1 to {_SETTING_MAX[key]:,}, "
            "so kvviz uses the value set here (or vLLM's default) instead")


def settings_from_log(log: ParsedLog, given: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The flags to predict with: what the user gave, else what the log shows, else vLLM's defaults;
    with a sentence for each one read from the log."""
    out, said = dict(given), list(log.ignored)
    for key in ("max_model_len", "tp", "pp", "block_size", "max_num_batched_tokens"):
        if out.get(key) is None and log.setting(key) is not None:
            out[key] = log.setting(key)
            said.append(f"{key} {log.setting(key):,} read from the log")
    if out.get("max_model_len") is None:
        for L in (log.concurrency_len, log.too_long[0] if log.too_long else None,
                  log.too_long_v0[0] if log.too_long_v0 else None):
            if L:
                out["max_model_len"] = L
                said.append(f"max_model_len {L:,} read from the log's KV lines")
                break
    if out.get("kv_dtype") is None and log.setting("kv_dtype"):
        raw = str(log.setting("kv_dtype"))
        if raw in KV_DTYPES and raw not in ("fp8", "fp8_e4m3", "fp8_e5m2"):  # the plain fp8s: 1 byte, read as fp8
            out["kv_dtype"] = raw
            said.append(f"KV dtype {raw} (the log's kv_cache_dtype)")
        elif raw not in VLLM_KV_DTYPES:
            said.append(f"the log's kv_cache_dtype {raw!r} ignored: vLLM's choices are {', '.join(VLLM_KV_DTYPES)}; "
                        "kvviz keeps the KV dtype set here")
        elif raw.startswith("fp8"):
            out["kv_dtype"] = "fp8"
            said.append(f"KV dtype fp8 (the log's kv_cache_dtype {raw})")
    return out, said


@dataclass(frozen=True)
class Row:
    """One logged line beside kvviz's figure."""

    what: str
    logged: str
    predicted: str
    agrees: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.what, "logged": self.logged, "predicted": self.predicted, "agrees": self.agrees,
                "why": self.why}


def gib_range(gib: float) -> tuple[int, int]:
    """The bytes a value printed as ``gib`` with two decimals can have been."""
    return max(0, math.ceil((gib - 0.005) * GIB)), math.floor((gib + 0.005) * GIB)


def profile_rows(log: ParsedLog, weights_per_gpu: int | None, estimate: dict[str, tuple[int, int]]) -> list[Row]:
    """The profiling line's measured parts beside kvviz's: the weights (params x dtype, split over the GPUs)
    and the estimate's activation and non-torch parts, each with its stated spread."""
    rows = []
    if log.weights_gib is not None and weights_per_gpu is not None:
        ratio = log.weights_gib * GIB / weights_per_gpu if weights_per_gpu else 0.0
        ok = abs(ratio - 1) <= 0.02
        rows.append(Row("model weights (profiling)", f"{log.weights_gib:.2f} GiB", f"{weights_per_gpu / GIB:.2f} GiB",
                        ok, "params x weight dtype per GPU, within 2% (vLLM also counts buffers)" if ok else
                        f"{ratio:.2f}x kvviz's: a quantized checkpoint (set --weight-dtype / --params) or a "
                        "different TP/PP split"))
    for label, got, key in (("activation peak (profiling)", log.activation_gib, "activation"),
                            ("non-torch memory (profiling)", log.non_torch_gib, "non_torch")):
        if got is not None and key in estimate:
            mid, spread = estimate[key]
            ok = abs(got * GIB - mid) <= spread
            rows.append(Row(label, f"{got:.2f} GiB", f"{mid / GIB:.2f} +- {spread / GIB:.2f} GiB (estimate)", ok,
                            "within the estimate's stated spread" if ok else
                            "outside the estimate's spread: the estimate is a rule of thumb, the log is measured"))
    return rows


def older_log(log: ParsedLog) -> bool:
    """Lines of a vLLM before 0.33: the token line on its own, V0's blocks, or the error's "models's"."""
    return ((log.tokens is not None and not log.one_line) or log.gpu_blocks is not None
            or log.too_long_v0 is not None or (log.too_long is not None and not log.model_s))


def reconcile(spec: ModelSpec, log: ParsedLog, settings: VLLMSettings) -> tuple[list[Row], list[str]]:
    """Each KV line of the log beside kvviz's prediction for the same model and flags, with why
    they differ. ``settings.kv_memory_bytes`` is ignored: the log's Available line sets it."""
    if not log.found:
        raise CalcError(["no vLLM KV-cache line found: paste the startup lines with 'Available KV cache memory', "
                         "'GPU KV cache size', 'Maximum concurrency', '# GPU blocks' or the max seq len error"])
    rows: list[Row] = []
    notes: list[str] = []
    if older_log(log) and not settings.older:
        settings = replace(settings, older=True)
        notes.append("the log's lines are an earlier vLLM's (two lines, '# GPU blocks' or 'models's'): sized with "
                     "its rules: max_num_batched_tokens in flight (not 0.33's two batches under async scheduling), "
                     "no null block held back from the too-long check")
    if log.device == "CPU" and settings.device != "cpu":
        settings = replace(settings, device="cpu")  # no async scheduling on the CPU backend (cpu.py:347-348)
        notes.append("the log is the CPU backend's ('CPU KV cache size'): sized as --device cpu")
    gib = log.available_gib
    if gib is None and log.too_long is not None:
        gib = log.too_long[2]
    if gib is None:
        notes.append("the log has no 'Available KV cache memory' line: kvviz cannot place the blocks; only the "
                     "lines that do not depend on it are compared")
    L = settings.max_model_len
    if gib is not None:
        lo, hi = gib_range(gib)
        a, b = sizes(spec, settings, lo, hi)
        rows.append(Row("Available KV cache memory", f"{gib:.2f} GiB", f"{lo:,}-{hi:,} B", True,
                        f"the input: printed with two decimals, so any of {hi - lo + 1:,} byte counts"))
        if log.tokens is not None:
            t_a, t_b = line_tokens(a, log.one_line), line_tokens(b, log.one_line)
            ok = t_a <= log.tokens <= t_b
            rows.append(Row(f"{log.device or 'GPU'} KV cache size", f"{log.tokens:,} tokens", _span(t_a, t_b, " tokens"),
                            ok, ("agrees within the rounding of the printed GiB" + (
                                " (0.33's one line: int(concurrency x max_model_len))" if log.one_line else ""))
                            if ok else explain_tokens(spec, settings, lo, hi, log.tokens)))
        if log.gpu_blocks is not None:
            ok = a.num_blocks <= log.gpu_blocks <= b.num_blocks
            rows.append(Row("# GPU blocks", f"{log.gpu_blocks:,}", _span(a.num_blocks, b.num_blocks), ok,
                            "agrees within the rounding of the printed GiB" if ok
                            else explain_tokens(spec, settings, lo, hi, log.gpu_blocks * settings.block_size)))
        if log.concurrency is not None:
            rows.append(_concurrency_row(spec, settings, log, a, b))
        if log.too_long is not None:
            rows += _too_long_rows(spec, settings, log.too_long, log.model_s)
    if log.too_long_v0 is not None and gib is not None:
        L0, fit = log.too_long_v0
        lo, hi = gib_range(gib)
        a, b = sizes(spec, replace(settings, max_model_len=L0), lo, hi)
        ok = a.tokens_legacy <= fit <= b.tokens_legacy
        rows.append(Row("max seq len error (V0)", f"{fit:,} tokens fit", _span(a.tokens_legacy, b.tokens_legacy), ok,
                        "V0 compared max_model_len with blocks x block size: agrees" if ok
                        else explain_tokens(spec, settings, lo, hi, fit)))
    if L is not None and log.concurrency_len is not None and log.concurrency_len != L:
        notes.append(f"the log's concurrency line is for {log.concurrency_len:,} tokens, the prediction for {L:,}")
    return rows, notes


def _span(a: int, b: int, unit: str = "") -> str:
    return f"{a:,}{unit}" if a == b else f"{a:,}-{b:,}{unit}"


def _concurrency_row(spec: ModelSpec, s: VLLMSettings, log: ParsedLog, a: VLLMSizing, b: VLLMSizing) -> Row:
    assert log.concurrency is not None
    L = log.concurrency_len or s.max_model_len
    if L != s.max_model_len:
        a, b = sizes(spec, replace(s, max_model_len=L), a.settings.kv_memory_bytes, b.settings.kv_memory_bytes)
    per_request = sum(g.blocks_per_request for g in a.groups)
    blocks, source = None, ""  # the exact block count, when the log gives it
    if log.tokens is not None and line_tokens(a, log.one_line) <= log.tokens <= line_tokens(b, log.one_line):
        blocks = [n for n in range(a.num_blocks, b.num_blocks + 1)
                  if (int(n / per_request * L) if log.one_line else n // len(a.groups) * s.block_size) == log.tokens]
        source = "the blocks the log's token line gives"
    elif log.gpu_blocks is not None:
        blocks, source = [log.gpu_blocks], "the log's # GPU blocks"
    if blocks:
        printed = sorted({f"{n / per_request:.2f}" for n in blocks})
        pred = " or ".join(f"{p}x" for p in printed)
        ok = f"{log.concurrency:.2f}" in printed
        why = (f"blocks / {per_request:,} blocks per request, with {source}" if ok else
               "differs with the log's own block count: another max_num_batched_tokens for the sliding groups?"
               if len(a.groups) > 1 else "differs with the log's own block count")
        return Row(f"Maximum concurrency for {L:,} tokens", f"{log.concurrency:.2f}x", pred, ok, why)
    lo_c, hi_c = a.max_concurrency, b.max_concurrency
    ok = round(lo_c, 2) - 0.005 <= log.concurrency <= round(hi_c, 2) + 0.005
    return Row(f"Maximum concurrency for {L:,} tokens", f"{log.concurrency:.2f}x", f"{lo_c:.2f}-{hi_c:.2f}x", ok,
               "agrees within the rounding of the printed GiB" if ok
               else "differs: the block count differs (see the token line) or the request's blocks do "
                    "(max_model_len, max_num_batched_tokens for sliding groups)")


def _too_long_rows(spec: ModelSpec, s: VLLMSettings, err: tuple[int, float, float, int | None],
                   model_s: bool = False) -> list[Row]:
    """The error's figures. 0.33's error ("model's") prints the memory less the null block it checks
    against (kv_cache_planning.py:1528-1537): the available memory is that plus one block."""
    L, need_gib, avail_gib, est = err
    s = replace(s, max_model_len=L, older=not model_s)
    lo, hi = gib_range(avail_gib)
    if model_s:
        block = vllm_sizing(spec, replace(s, kv_memory_bytes=0)).bytes_per_block
        lo, hi = lo + block, hi + block
    a, b = sizes(spec, s, lo, hi)
    ok = round(need_gib, 2) == round(a.needed_bytes / GIB, 2)  # either format: "62.00" (older) or "2.0"
    rows = [Row(f"KV needed for one {L:,}-token request", f"{need_gib:.2f} GiB", f"{format_gib(a.needed_bytes)} GiB "
                f"({a.needed_bytes:,} B)", ok, "exact: it does not depend on the available memory" if ok
                else explain_needed(spec, s, need_gib))]
    if a.fits:
        rows.append(Row("fits?", "does not fit", "fits", False, "kvviz's request fits in this memory: the needed "
                        "bytes differ (see above)"))
    elif est is not None:
        # the top of the printed range may just fit: then the longest that fits there is L itself
        top = L if b.fits else (b.estimated_max_model_len or 0)
        e_lo, e_hi = sorted((a.estimated_max_model_len or 0, top))
        ok = e_lo <= est <= e_hi
        rows.append(Row("estimated maximum model length", f"{est:,}", _span(e_lo, e_hi), ok,
                        "agrees within the rounding of the printed GiB" if ok else
                        "differs: the needed bytes per token differ (see above)"))
    return rows


def reconcile_text(rows: list[Row], notes: list[str]) -> str:
    out = ["line | logged | kvviz | agrees | why"]
    out += [f"{r.what} | {r.logged} | {r.predicted} | {'yes' if r.agrees else 'NO'} | {r.why}" for r in rows]
    return "\n".join(out + [f"note: {n}" for n in notes])
