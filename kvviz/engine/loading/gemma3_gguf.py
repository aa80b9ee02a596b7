"""Read a Gemma 3 GGUF file (llama.cpp's ``gemma3`` architecture) into kvviz's Gemma3 names.

The same steps as engine/gguf.py for Llama (header walk, llama.cpp's reader, metadata, every
tensor's type and shape checked before anything is dequantized), with Gemma's differences:
- no Q/K row permutation: llama.cpp's Gemma converter leaves attn_q/attn_k in transformers' order;
- every norm weight is stored as ``1 + w`` (the converter adds the 1); we subtract it, as
  transformers' GGUF loader does, so the model's ``(1 + w)`` rounds exactly as transformers';
- the layer kinds are not in the file: llama.cpp and transformers both take Gemma 3's fixed
  pattern (every 6th layer global) and its sliding layers' RoPE base 10,000; so do we.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import torch
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as Q
from gguf.gguf_reader import ReaderTensor

from kvviz.engine.gguf import GGUFModel, _float, _int, _value, architecture, dequantize_tensor, open_gguf, \
    tokenizer_metadata
from kvviz.engine.models.gemma3 import Gemma3Config, param_shapes
from kvviz.errors import KVVizError

SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
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
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def config_from_metadata(reader: GGUFReader) -> Gemma3Config:
    """A Gemma3Config from ``gemma3.*`` metadata; refuses any other architecture."""
    arch = architecture(reader)
    if arch != "gemma3":
        raise KVVizError(f"GGUF architecture {arch!r} is not Gemma 3")
    p = "gemma3."
    head_dim = _int(reader, p + "attention.key_length", 256)
    if _int(reader, p + "attention.value_length", head_dim) != head_dim:
        raise KVVizError(f"{p}attention.value_length differs from key_length ({head_dim}); not supported")
    scaling = _value(reader, p + "rope.scaling.type")
    if scaling not in (None, "none"):
        raise KVVizError(f"RoPE scaling {scaling!r} ({p}rope.scaling.type) is not supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _value(reader, p + "vocab_size")
    if vocab is None and tokens is not None:
        vocab = len(tokens.data)
    if vocab is None:
        raise KVVizError(f"GGUF metadata has neither {p}vocab_size nor tokenizer.ggml.tokens")
    context = _int(reader, p + "context_length")
    eos = _value(reader, "tokenizer.ggml.eos_token_id")
    softcap = _value(reader, p + "final_logit_softcapping")
    fields = dict(
        vocab_size=vocab, block_size=min(context, MAX_CONTEXT), context_length=context,
        n_layer=_int(reader, p + "block_count"), n_head=_int(reader, p + "attention.head_count"),
        n_kv_head=_int(reader, p + "attention.head_count_kv"), n_embd=_int(reader, p + "embedding_length"),
        head_dim=head_dim, intermediate_size=_int(reader, p + "feed_forward_length"),
        rope_theta=_float(reader, p + "rope.freq_base", 1_000_000.0),
        rms_norm_eps=_float(reader, p + "attention.layer_norm_rms_epsilon"),
        sliding_window=_int(reader, p + "attention.sliding_window"),
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
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and int(m.group(1)) < n_layer and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
    return None


def check_tensors(reader: GGUFReader, config: Gemma3Config, where: str) -> dict[str, ReaderTensor]:
    """{transformers name: tensor}, after checking every name, type and shape (nothing is copied)."""
    expected = param_shapes(config)
    out: dict[str, ReaderTensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name, config.n_layer)
        if name is None:
            raise KVVizError(f"{where} has tensor {t.name}, which kvviz's Gemma 3 has no place for")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise KVVizError(f"{where}: tensor {t.name} is {t.tensor_type.name}; kvviz dequantizes "
                             f"{', '.join(q.name for q in SUPPORTED_TYPES)}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the innermost dim first
        if shape != expected[name]:
            raise KVVizError(f"{where}: tensor {t.name} has shape {shape}, but the metadata implies {expected[name]}")
        out[name] = t
    missing = [k for k in expected if k not in out]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise KVVizError(f"{where} is missing tensors: {', '.join(missing[:3])}{more}")
    return out


def load_gemma3_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> GGUFModel:
    """Config (a Gemma3Config), dequantized state dict and tokenizer metadata of a Gemma 3 GGUF."""
    path = Path(path)
    t0 = time.perf_counter()
    reader = open_gguf(path)
    config = config_from_metadata(reader)
    tensors = check_tensors(reader, config, path.name)
    t1 = time.perf_counter()
    sd: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        w = dequantize_tensor(t, torch.float32)
        if name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stored 1 + w
        sd[name] = w if dtype == torch.float32 else w.to(dtype)
    types: dict[str, int] = {}
    for t in tensors.values():
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    info = {"file_bytes": path.stat().st_size, "tensor_types": types, "read_seconds": t1 - t0,
            "dequantize_seconds": time.perf_counter() - t1, "general.name": _value(reader, "general.name")}
    return GGUFModel(config, sd, tokenizer_metadata(reader), reader, info)  # type: ignore[arg-type]
