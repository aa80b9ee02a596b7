"""Read a Gemma 3 GGUF file (llama.cpp's ``gemma3`` architecture) into kvviz's Gemma3 names.

The same steps as engine/loading/gguf_llama.py for Llama (header walk, metadata, every tensor's type and shape
checked before anything is dequantized), through the same reader (``gguf_lite``) and dequantizer,
with Gemma's differences:
- no Q/K row permutation: llama.cpp's Gemma converter leaves attn_q/attn_k in transformers' order;
- every norm weight is stored as ``1 + w`` (the converter adds the 1); we subtract it, as
  transformers' GGUF loader does, so the model's ``(1 + w)`` rounds exactly as transformers';
- the layer kinds are not in the file: llama.cpp and transformers both take Gemma 3's fixed
  pattern (every 6th layer global) and its sliding layers' RoPE base 10,000; so do we.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvviz.engine.loading.gguf_codes import block_codes
from kvviz.engine.loading.gguf_lite import LiteGGUF, LiteTensor, read_gguf
from kvviz.engine.loading.weight_checks import check_finite
from kvviz.engine.loading.gguf_llama import (SUPPORTED_TYPES, dequantize_tensor, map_name, match_tensors, meta_float,
                                             meta_int, type_counts)
from kvviz.engine.models.gemma3 import Gemma3Config, param_shapes
from kvviz.errors import KVVizError
from kvviz.engine.loading.gguf_codes import BlockCodes

# kvviz's context for Gemma 3: a static cache preallocates every position of every layer, and the
# model's own 32k would be 1.2 GiB at fp32 for a 270M model; 8k is 302 MiB (SmolLM2's is 8k too).
MAX_CONTEXT = 8192

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


@dataclass
class Gemma3GGUF:
    """What a Gemma 3 GGUF file holds, in kvviz's terms."""

    config: Gemma3Config
    state_dict: dict[str, torch.Tensor]  # transformers' names, norms as w (not 1 + w); no lm_head (tied)
    metadata: dict[str, Any]  # every metadata key (tokenizer.ggml.* builds the tokenizer)
    info: dict[str, Any] = field(default_factory=dict)  # timings, type counts, file size
    # the quantized matrices as the file keeps them (int8 codes, a scale per block), by the same
    # names: kvviz.fast multiplies by these; only for an fp32 load (they rebuild fp32 values exactly)
    codes: dict[str, BlockCodes] = field(default_factory=dict)


def config_from_metadata(meta: dict[str, Any]) -> Gemma3Config:
    """A Gemma3Config from ``gemma3.*`` metadata; refuses any other architecture."""
    arch = meta.get("general.architecture")
    if arch != "gemma3":
        raise KVVizError(f"GGUF architecture {arch!r} is not Gemma 3")
    p = "gemma3."
    head_dim = meta_int(meta, p + "attention.key_length", 256)
    if meta_int(meta, p + "attention.value_length", head_dim) != head_dim:
        raise KVVizError(f"{p}attention.value_length differs from key_length ({head_dim}); not supported")
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        raise KVVizError(f"RoPE scaling {scaling!r} ({p}rope.scaling.type) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(p + "vocab_size")
    if vocab is None and isinstance(tokens, list):
        vocab = len(tokens)
    if vocab is None:
        raise KVVizError(f"GGUF metadata has neither {p}vocab_size nor tokenizer.ggml.tokens")
    context = meta_int(meta, p + "context_length")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    softcap = meta.get(p + "final_logit_softcapping")
    fields = dict(
        vocab_size=vocab, block_size=min(context, MAX_CONTEXT), context_length=context,
        n_layer=meta_int(meta, p + "block_count"), n_head=meta_int(meta, p + "attention.head_count"),
        n_kv_head=meta_int(meta, p + "attention.head_count_kv"), n_embd=meta_int(meta, p + "embedding_length"),
        head_dim=head_dim, intermediate_size=meta_int(meta, p + "feed_forward_length"),
        rope_theta=meta_float(meta, p + "rope.freq_base", 1_000_000.0),
        rms_norm_eps=meta_float(meta, p + "attention.layer_norm_rms_epsilon"),
        sliding_window=meta_int(meta, p + "attention.sliding_window"),
        # transformers' Gemma3TextConfig: query_pre_attn_scalar defaults to 256 (= head_dim here).
        final_logit_softcapping=float(softcap) if isinstance(softcap, (int, float)) else None,
        eos_token_id=eos if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < vocab else None,
    )
    try:
        return Gemma3Config(**fields)
    except (TypeError, ValueError) as e:
        raise KVVizError(f"GGUF metadata describes an invalid Gemma 3 model: {e}") from None


def hf_name(gguf_name: str, n_layer: int) -> str | None:
    """transformers' name for a llama.cpp Gemma 3 tensor, or None if the model has no such weight."""
    return map_name(gguf_name, n_layer, _GLOBAL_NAMES, _LAYER_NAMES)


def check_tensors(tensors: tuple[LiteTensor, ...], config: Gemma3Config, where: str) -> dict[str, LiteTensor]:
    """{transformers name: tensor} of a Gemma 3 file, every name, type and shape checked (nothing is copied)."""
    return match_tensors(tensors, param_shapes(config), lambda n: hf_name(n, config.n_layer), SUPPORTED_TYPES,
                         "Gemma 3", where)


def load_gemma3_gguf(source: str | Path | LiteGGUF, dtype: torch.dtype = torch.float32,
                     keep_codes: bool = True) -> Gemma3GGUF:
    """Config, dequantized state dict and metadata of a Gemma 3 GGUF file (a path, or the file
    ``read_gguf`` already opened); with ``keep_codes`` and fp32, the quantized matrices' codes too."""
    t0 = time.perf_counter()
    g = source if isinstance(source, LiteGGUF) else read_gguf(source)
    path = g.path
    config = config_from_metadata(g.metadata)
    tensors = check_tensors(g.tensors, config, path.name)
    t1 = time.perf_counter()
    sd: dict[str, torch.Tensor] = {}
    codes: dict[str, BlockCodes] = {}
    keep = keep_codes and dtype == torch.float32
    for name, t in tensors.items():
        c = block_codes(t)  # unpacked once: the fp32 weight is rebuilt from it, and kept for kvviz.fast
        w = dequantize_tensor(t, c)
        if name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stored 1 + w
        sd[name] = w if dtype == torch.float32 else w.to(dtype)
        if keep and c is not None:
            codes[name] = c
    check_finite(sd, path.name)
    info = {"file_bytes": path.stat().st_size, "tensor_types": type_counts(tensors.values()), "read_seconds": t1 - t0,
            "dequantize_seconds": time.perf_counter() - t1, "codes_bytes": sum(c.nbytes for c in codes.values()),
            "general.name": g.metadata.get("general.name")}
    return Gemma3GGUF(config, sd, g.metadata, info, codes)
