"""The KV cache llama.cpp allocates up front for ``-c N -np S``, in its own log line.

Followed from llama.cpp as bundled in llama-cpp-python 0.3.36 (vendor/llama.cpp; line numbers of
that version): src/llama-context.cpp, src/llama-model.cpp create_memory, src/llama-kv-cache.cpp,
src/llama-kv-cache-iswa.cpp, src/llama-hparams.cpp, ggml's type sizes:

- the context is padded (llama-context.cpp:290-296): n_ctx = pad(N, 256); without a unified cache
  (``--kv-unified`` off) each of the S sequences gets its own stream of n_ctx_seq = pad(n_ctx / S,
  256) cells, with one it is one stream of n_ctx cells shared by all;
- per layer (llama-kv-cache.cpp:157-161, 209-234): a K row of n_embd_k_gqa(il) = KV heads x head_dim
  values and a V row of n_embd_v_gqa(il), each in its cache type: f16/bf16 2 bytes a value, f32 4,
  q8_0 34 bytes per 32 values, q4_0 18, q4_1 20, q5_0 22, q5_1 24, iq4_nl 18 (a quantized row must be
  a multiple of 32 values). Without flash attention (-fa off) V is stored transposed and every
  layer's V row is padded to the widest one (n_embd_v_gqa_max, [TAG_V_CACHE_VARIABLE]); a quantized
  V needs flash attention (llama-context.cpp:467). MLA (DeepSeek) is converted to one KV head of
  kv_lora_rank + qk_rope_head_dim values and stored as K only (has_v = !is_mla, :226-227);
- layers that reuse another layer's cache (Gemma 3n / Gemma 4's num_kv_shared_layers; has_kv,
  llama-hparams.cpp:321-331, and the share callback, llama-kv-cache.cpp:176-190) allocate nothing;
- sliding-window (and chunked) layers get their own cache of pad(min(n_ctx_seq, window x (S when
  unified, else 1) + n_ubatch), 256) cells, or the full size with ``--swa-full``
  (llama-kv-cache-iswa.cpp:69-81); n_ubatch = min(-b, -ub) with -b capped at N (llama-context.cpp:246-248),
  defaults 2,048 and 512.
llama.cpp has no tensor parallelism for the cache: a layer's cache lives on the device of the layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvviz.calculator.spec import CalcError, ModelSpec

MIB = 1024**2
LLAMA_MAX_SEQ = 256  # src/llama-cparams.h
# ggml type -> (values per block, bytes per block)
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20),
    "q5_0": (32, 22), "q5_1": (32, 24), "iq4_nl": (32, 18),
}
SOURCES = ("src/llama-context.cpp", "src/llama-kv-cache.cpp", "src/llama-kv-cache-iswa.cpp", "src/llama-hparams.cpp",
           "ggml/src/ggml.c")


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


def _rows(spec: ModelSpec, flash_attn: bool) -> list[tuple[int, int, int]]:
    """(layer, K row values, V row values) of every layer that allocates K/V (llama-kv-cache.cpp:157-234)."""
    if spec.mla is not None:  # one "KV head" of kv_lora_rank + rope values, K only
        return [(i, spec.mla.latent_dim, 0) for i in range(spec.n_layers) if spec.own_kv(i)]
    row = spec.n_kv_heads * spec.head_dim
    rows = [(i, row, row) for i in range(spec.n_layers) if spec.own_kv(i)]
    if not flash_attn and rows:  # V transposed: padded to n_embd_v_gqa_max over all layers
        v_max = max(v for _, _, v in rows)
        rows = [(i, k, v_max) for i, k, _ in rows]
    return rows


def llamacpp_sizing(spec: ModelSpec, n_ctx: int, n_seq: int = 1, type_k: str = "f16", type_v: str = "f16",
                    swa_full: bool = False, unified: bool = False, n_ubatch: int = 512, flash_attn: bool = True,
                    n_batch: int = 2048) -> LlamaCppSizing:
    problems = []
    for name, t in (("-ctk", type_k), ("-ctv", type_v)):
        if t not in CACHE_TYPES:
            problems.append(f"{name} {t!r} is not a llama.cpp cache type kvviz knows ({', '.join(CACHE_TYPES)})")
    if spec.linear_layers:
        problems.append("llama.cpp keeps linear / Mamba layers in a separate recurrent memory, not modelled here")
    for name, v in (("-c", n_ctx), ("-np", n_seq), ("-ub", n_ubatch), ("-b", n_batch)):
        if v < 1:
            problems.append(f"{name} must be positive (got {v})")
    if n_seq > LLAMA_MAX_SEQ:  # llama-context.cpp: "n_seq_max must be <= LLAMA_MAX_SEQ"
        problems.append(f"n_seq_max must be <= {LLAMA_MAX_SEQ} (llama.cpp refuses -np {n_seq})")
    if not flash_attn and type_v in CACHE_TYPES and CACHE_TYPES[type_v][0] > 1 and spec.mla is None:
        problems.append("quantized V cache was requested, but this requires Flash Attention (llama.cpp refuses "
                        f"-ctv {type_v} with -fa off)")
    rows = _rows(spec, flash_attn) if not problems else []
    for t, which in ((type_k, 1), (type_v, 2)):
        if t not in CACHE_TYPES:
            continue
        per = CACHE_TYPES[t][0]
        bad = sorted({r[which] for r in rows if r[which] % per})
        if bad:
            problems.append(f"a {t} row holds blocks of {per} values; this model's {'KV'[which - 1]} row of {bad[0]} "
                            "values is not a multiple (llama.cpp refuses the type)")
    if problems:
        raise CalcError(problems)
    ctx = pad(n_ctx, 256)
    if unified:
        cells, streams = ctx, 1
    else:
        cells, streams = pad(ctx // n_seq, 256), n_seq
        ctx = cells * n_seq
    ubatch = min(min(n_ctx, n_batch), n_ubatch)  # llama-context.cpp:246-248
    notes = []
    if ctx != n_ctx:
        notes.append(f"-c {n_ctx:,} becomes {ctx:,}: llama.cpp pads the context to a multiple of 256"
                     + ("" if unified else f" per sequence ({n_seq} streams of {cells:,} cells)"))
    if ubatch != n_ubatch:
        notes.append(f"-ub {n_ubatch:,} becomes {ubatch:,}: n_ubatch is at most n_batch (-b {n_batch:,}, itself at "
                     "most -c)")
    swa_rows = [r for r in rows if spec.layer(r[0]).caps]
    full_rows = [r for r in rows if not spec.layer(r[0]).caps]

    def cache(label: str, rs: list[tuple[int, int, int]], n_cells: int) -> LlamaCppCache:
        k = sum(row_bytes(type_k, kr) for _, kr, _ in rs) * n_cells * streams
        v = sum(row_bytes(type_v, vr) for _, _, vr in rs if vr) * n_cells * streams
        return LlamaCppCache(label, n_cells, len(rs), streams, k, v)

    if not swa_rows:
        caches = [cache("", full_rows, cells)]
    else:
        window = max(spec.layer(i).span or 0 for i, _, _ in swa_rows)
        # llama-kv-cache-iswa.cpp:73: GGML_PAD(min(size_base, n_swa x seqs + n_ubatch), 256) (padded "for performance")
        swa_cells = cells if swa_full else pad(min(cells, window * (n_seq if unified else 1) + ubatch), 256)
        caches = [cache("non-SWA", full_rows, cells), cache("SWA", swa_rows, swa_cells)]
        if len({spec.layer(i).span for i, _, _ in swa_rows}) > 1:
            notes.append("several window sizes: llama.cpp keeps one n_swa; the largest is used")
        if not swa_full:
            notes.append(f"sliding layers keep window {window:,} + n_ubatch {ubatch:,} cells, padded to 256; "
                         f"--swa-full keeps all {cells:,} (needed to reuse a cached prompt)")
    if spec.mla is not None:
        notes.append("MLA: one K row of kv_lora_rank + qk_rope_head_dim values a layer, no V (llama.cpp stores the "
                     "latent as K only)")
    if spec.kv_shared_layers:
        notes.append(f"the last {spec.kv_shared_layers} layers reuse earlier layers' cache: not counted")
    if type_v not in ("f16", "bf16", "f32") and spec.mla is None:
        notes.append("a quantized V cache needs flash attention (-fa on; auto turns it on)")
    lines = tuple(c.log_line(n_seq, type_k, type_v) for c in caches)
    return LlamaCppSizing(n_ctx, ctx, n_seq, unified, type_k, type_v, tuple(caches), lines, tuple(notes))
