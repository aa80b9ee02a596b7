"""The calculator page's settings in the URL: every widget key is a query parameter, so a link
reproduces a calculation. Values are read and validated once per session, then written back on
every run. A value that does not parse is ignored with a message (shown as plain text by the page).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import streamlit as st

from kvviz.calculator import (
    DEFAULT_BLOCK_SIZE, DEFAULT_EFFICIENCY, DEFAULT_GROUP_SIZE, DTYPES, GPU_PRESETS_GIB, MAX_BATCH, MAX_SEQ_LEN, MAX_SINKS,
    MAX_TP,
    SCALE_DTYPE_BYTES, STATE_DTYPES, load_gpus,
)
from kvviz.ui.state import session

SOURCES = {"preset": "Preset", "import": "Import config.json"}
GPU_OPTIONS = [str(g) for g in GPU_PRESETS_GIB] + ["custom"]
CUSTOM_GPU = "custom"
MIN_CUSTOM_GIB, MAX_CUSTOM_GIB = 0.5, 100_000.0  # the "Custom (GiB)" box's bounds: a link may not pass them
MAX_BEAMS = 16
_DEFAULT_GPU = load_gpus()["h100-sxm"]
DEFAULTS: dict[str, Any] = {
    "mem_source": "preset", "mem_preset": "llama-3-8b", "mem_seq_len": 8192, "mem_batch": 1, "mem_beams": 1,
    "mem_dtype": "bf16", "mem_weight_dtype": "bf16", "mem_group_size": DEFAULT_GROUP_SIZE, "mem_scale_dtype": "fp16",
    "mem_zero_point": False, "mem_paged": False, "mem_block_size": DEFAULT_BLOCK_SIZE, "mem_windows": True,
    "mem_gpu": "80", "mem_gpu_custom": 80.0, "mem_reserve": 10, "mem_params": 0,
    "mem_compare": ["llama-2-7b", "mistral-7b-v0.1", "deepseek-v2"], "mem_chart_dtypes": ["bf16", "fp8", "int4"],
    "mem_log": True, "mem_chart_weights": False,
    # round 2: tensor parallelism, linear-layer state, the GPU's bandwidth and price for the cost per token
    "mem_tp": 1, "mem_state_dtype": "auto", "mem_gpu_kind": _DEFAULT_GPU.key,
    "mem_bandwidth": _DEFAULT_GPU.bandwidth_gbs, "mem_price": _DEFAULT_GPU.price_per_hour,
    "mem_efficiency": DEFAULT_EFFICIENCY, "mem_cost_dtype": "fp8",
    # a run-time cache window (StreamingLLM): sinks + the last W positions on every layer
    "mem_cache_window": False, "mem_window": 4096, "mem_sinks": 4,
}
# Settings a link must carry to reproduce the calculation (chart-only settings travel too).
SHARED_KEYS = tuple(DEFAULTS)


def _int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(s: str) -> int:
        v = int(s.replace(",", "").replace("_", ""))  # 5,000 digits: ValueError, like any other bad number
        if not lo <= v <= hi:
            raise ValueError(f"must be from {lo:,} to {hi:,}")
        return v
    return parse


def _float_in(lo: float, hi: float) -> Callable[[str], float]:
    def parse(s: str) -> float:
        v = float(s)
        if not (math.isfinite(v) and lo <= v <= hi):
            raise ValueError(f"must be a number from {lo:g} to {hi:g}")
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
    """A preset size, "custom" (the size is then in mem_gpu_custom, as this page writes its links), or
    a size in GiB typed by hand (read as custom), within the custom box's own bounds."""
    if s in GPU_OPTIONS:
        return s
    return _gpu_custom(s)


def _gpu_custom(s: str) -> float:
    v = float(s)
    if not (math.isfinite(v) and MIN_CUSTOM_GIB <= v <= MAX_CUSTOM_GIB):
        raise ValueError(f"must be a GPU size from {MIN_CUSTOM_GIB:g} to {MAX_CUSTOM_GIB:,g} GiB")
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
        "mem_gpu": _gpu, "mem_gpu_custom": _gpu_custom, "mem_reserve": _int_in(0, 50),
        "mem_params": _int_in(0, 10**15), "mem_compare": _list_of(preset_keys), "mem_chart_dtypes": _list_of(DTYPES),
        "mem_log": _bool, "mem_chart_weights": _bool,
        "mem_tp": _int_in(1, MAX_TP), "mem_state_dtype": _choice(STATE_DTYPES),
        "mem_gpu_kind": _choice([*load_gpus(), CUSTOM_GPU]), "mem_bandwidth": _float_in(1.0, 1e6),
        "mem_price": _float_in(0.0, 1e6), "mem_efficiency": _float_in(0.05, 1.0), "mem_cost_dtype": _choice(DTYPES),
        "mem_cache_window": _bool, "mem_window": _int_in(1, MAX_SEQ_LEN), "mem_sinks": _int_in(0, MAX_SINKS),
    }


def read_query_params(preset_keys: list[str]) -> list[str]:
    """Seed the widgets from the URL once per session; return a message for each invalid value."""
    if session.get(session.CALC_LINK_READ):
        return []
    session.put(session.CALC_LINK_READ, True)
    bad: list[str] = []
    for key, parse in _parsers(preset_keys).items():
        if key not in st.query_params:
            continue
        raw = st.query_params[key]
        try:
            value = parse(raw)
        except ValueError as e:  # also int()/float() on 5,000 digits: Python refuses, with a ValueError
            bad.append(f"{key}={raw[:40]!r} ignored: {str(e)[:120]}")
            continue
        if key == "mem_gpu" and isinstance(value, float):
            session.update({"mem_gpu": CUSTOM_GPU, "mem_gpu_custom": value})
        else:
            session.put(key, value)
    if "mem_gpu_kind" in st.query_params:  # a hand-written link may name the GPU alone: fill in the rest
        given = {k: session.get(k) for k in ("mem_gpu", "mem_gpu_custom", "mem_bandwidth", "mem_price")
                 if k in st.query_params}
        apply_gpu_kind()
        session.update(given)
    return bad


def write_query_params() -> None:
    """The current settings back into the URL, so the address bar is always a shareable link: every
    setting travels (the custom GPU size too, while a preset size is chosen: the box still shows it),
    and each is written as its parser reads it, so the link reopens the same page."""
    out: dict[str, str] = {}
    for key in SHARED_KEYS:
        v = session.get(key, DEFAULTS[key])
        if key == "mem_preset" and session.get("mem_source") == "import":
            continue  # an imported config is too big for a link
        out[key] = ",".join(v) if isinstance(v, list) else str(v).lower() if isinstance(v, bool) else str(v)
    if dict(st.query_params) != out:
        st.query_params.from_dict(out)


def apply_gpu_kind() -> None:
    """on_change of the GPU model: its memory, bandwidth and example price fill the other controls."""
    kind = session.get("mem_gpu_kind")
    gpus = load_gpus()
    if kind not in gpus:
        return  # "custom": keep whatever the user typed
    g = gpus[kind]
    if str(g.memory_gib) in GPU_OPTIONS:
        session.put("mem_gpu", str(g.memory_gib))
    else:
        session.update({"mem_gpu": CUSTOM_GPU, "mem_gpu_custom": float(g.memory_gib)})
    session.put("mem_bandwidth", g.bandwidth_gbs)
    session.put("mem_price", g.price_per_hour)
