"""The KV cache llama.cpp allocates up front for ``-c N -np S``, in its own log line.

Followed from llama.cpp (src/llama-context.cpp, src/llama-model.cpp create_memory,
src/llama-kv-cache.cpp, src/llama-kv-cache-iswa.cpp, ggml's type sizes):

- the context is padded: n_ctx = pad(N, 256); without a unified cache (``--kv-unified`` off) each
  of the S sequences gets its own stream of n_ctx_seq = pad(n_ctx / S, 256) cells, with one it is
  one stream of n_ctx cells shared by all;
- every layer stores, for each cell, a K row of (KV heads x head_dim) values and a V row alike,
  each in its cache type: f16/bf16 2 bytes a value, f32 4, q8_0 34 bytes per 32 values (32 int8 +
  an fp16 scale), q4_0 18 bytes per 32 (16 bytes of nibbles + an fp16 scale), q4_1 20, q5_0 22,
  q5_1 24, iq4_nl 18; a quantized row must be a multiple of 32 values;
- sliding-window (and chunked) layers get their own cache of
  pad(min(n_ctx_seq, window x (S when unified, else 1) + n_ubatch), 256) cells, or the full size with
  ``--swa-full``.
llama.cpp has no tensor parallelism for the cache: a layer's cache lives on the device of the layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvviz.memory.spec import CalcError, ModelSpec

MIB = 1024**2
LLAMA_MAX_SEQ = 256  # src/llama-cparams.h
# ggml type -> (values per block, bytes per block)
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20),
    "q5_0": (32, 22), "q5_1": (32, 24), "iq4_nl": (32, 18),
}
SOURCES = ("src/llama-context.cpp", "src/llama-kv-cache.cpp", "src/llama-kv-cache-iswa.cpp", "ggml/src/ggml.c")


def pad(n: int, to: int) -> int:
    return -(-n // to) * to


def row_bytes(cache_type: str, values: int) -> int:
    """ggml_row_size: bytes of one row of ``values`` values of this type."""
    per, size = CACHE_TYPES[cache_type]
    return values // per * size


@dataclass(frozen=True)
class LlamaCppCache:
    """One llama_kv_cache: the full-attention one or the sliding-window one."""

    label: str  # "non-SWA" / "SWA" / "" (a model without windows)
    cells: int  # per stream
    layers: int
    streams: int
    k_bytes: int
    v_bytes: int

    @property
    def bytes(self) -> int:
        return self.k_bytes + self.v_bytes

    def log_line(self, seqs: int, type_k: str, type_v: str) -> str:
        """llama.cpp's own line, format for format."""
        return (f"llama_kv_cache: size = {self.bytes / MIB:7.2f} MiB ({self.cells:6d} cells, {self.layers:3d} layers, "
                f"{seqs:2d}/{self.streams} seqs), K ({type_k}): {self.k_bytes / MIB:7.2f} MiB, "
                f"V ({type_v}): {self.v_bytes / MIB:7.2f} MiB")

    def to_dict(self) -> dict[str, Any]:
        return {"cache": self.label or "kv", "cells": self.cells, "layers": self.layers, "streams": self.streams,
                "k_bytes": self.k_bytes, "v_bytes": self.v_bytes, "bytes": self.bytes}


@dataclass(frozen=True)
class LlamaCppSizing:
    n_ctx: int  # as asked
    n_ctx_padded: int
    n_seq: int
    unified: bool
    type_k: str
    type_v: str
    caches: tuple[LlamaCppCache, ...]
    lines: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.caches)

    def to_dict(self) -> dict[str, Any]:
        return {"name": "llama.cpp", "n_ctx": self.n_ctx, "n_ctx_padded": self.n_ctx_padded, "n_seq": self.n_seq,
                "kv_unified": self.unified, "type_k": self.type_k, "type_v": self.type_v,
                "caches": [c.to_dict() for c in self.caches], "kv_bytes": self.total_bytes,
                "log_lines": list(self.lines), "notes": list(self.notes), "sources": list(SOURCES)}


def llamacpp_sizing(spec: ModelSpec, n_ctx: int, n_seq: int = 1, type_k: str = "f16", type_v: str = "f16",
                    swa_full: bool = False, unified: bool = False, n_ubatch: int = 512) -> LlamaCppSizing:
    problems = []
    for name, t in (("-ctk", type_k), ("-ctv", type_v)):
        if t not in CACHE_TYPES:
            problems.append(f"{name} {t!r} is not a llama.cpp cache type kvviz knows ({', '.join(CACHE_TYPES)})")
    if spec.mla is not None:
        problems.append("llama.cpp stores DeepSeek's MLA cache in its own layout, which kvviz does not model yet")
    if spec.linear_layers:
        problems.append("llama.cpp keeps linear / Mamba layers in a separate recurrent memory, not modelled here")
    for name, v in (("-c", n_ctx), ("-np", n_seq), ("-ub", n_ubatch)):
        if v < 1:
            problems.append(f"{name} must be positive (got {v})")
    if n_seq > LLAMA_MAX_SEQ:  # llama-context.cpp: "n_seq_max must be <= LLAMA_MAX_SEQ"
        problems.append(f"n_seq_max must be <= {LLAMA_MAX_SEQ} (llama.cpp refuses -np {n_seq})")
    row = spec.n_kv_heads * spec.head_dim
    for t in {type_k, type_v} & set(CACHE_TYPES):
        per = CACHE_TYPES[t][0]
        if row % per:
            problems.append(f"a {t} row holds blocks of {per} values; this model's K/V row of {row} values is not a "
                            "multiple (llama.cpp refuses the type)")
    if problems:
        raise CalcError(problems)
    ctx = pad(n_ctx, 256)
    if unified:
        cells, streams = ctx, 1
    else:
        cells, streams = pad(ctx // n_seq, 256), n_seq
        ctx = cells * n_seq
    kb, vb = row_bytes(type_k, row), row_bytes(type_v, row)
    capped = [(layer, n) for layer, n in spec.layer_counts() if layer.caps]
    full = sum(n for layer, n in spec.layer_counts() if layer.has_kv and not layer.caps)
    caches = []
    notes = []
    if ctx != n_ctx:
        notes.append(f"-c {n_ctx:,} becomes {ctx:,}: llama.cpp pads the context to a multiple of 256"
                     + ("" if unified else f" per sequence ({n_seq} streams of {cells:,} cells)"))
    if not capped:
        caches.append(LlamaCppCache("", cells, full, streams, full * kb * cells * streams, full * vb * cells * streams))
    else:
        caches.append(LlamaCppCache("non-SWA", cells, full, streams, full * kb * cells * streams,
                                    full * vb * cells * streams))
        window = max(layer.span or 0 for layer, _ in capped)
        # llama-kv-cache-iswa.cpp: GGML_PAD(min(size_base, n_swa x seqs + n_ubatch), 256) (padded "for performance")
        swa_cells = cells if swa_full else pad(min(cells, window * (n_seq if unified else 1) + n_ubatch), 256)
        n_swa = sum(n for _, n in capped)
        caches.append(LlamaCppCache("SWA", swa_cells, n_swa, streams, n_swa * kb * swa_cells * streams,
                                    n_swa * vb * swa_cells * streams))
        if len({layer.span for layer, _ in capped}) > 1:
            notes.append("several window sizes: llama.cpp keeps one n_swa; the largest is used")
        if not swa_full:
            notes.append(f"sliding layers keep window {window:,} + n_ubatch {n_ubatch} cells, padded to 256; "
                         f"--swa-full keeps all {cells:,} (needed to reuse a cached prompt)")
    if type_v not in ("f16", "bf16", "f32"):
        notes.append("a quantized V cache needs flash attention (-fa on)")
    lines = tuple(c.log_line(n_seq, type_k, type_v) for c in caches)
    return LlamaCppSizing(n_ctx, ctx, n_seq, unified, type_k, type_v, tuple(caches), lines, tuple(notes))
