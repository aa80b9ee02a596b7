"""Read a GGUF file (llama.cpp's format) of the Llama family into kvviz's Llama parameter names:
architectures ``llama`` (Mistral is ``llama`` with ``llama.attention.sliding_window``), ``qwen2``
(q/k/v biases) and ``qwen3`` (per-head q/k RMSNorm). ``gemma3`` has its own model; anything else
is refused in one line that names this list.

Steps, each failing with a KVVizError that names the problem:
1. ``gguf_checks.scan_header`` checks the file's structure and sizes (truncation, lying counts);
2. ``gguf_lite.read_gguf`` decodes the metadata once and memory-maps the tensors: nothing is copied yet;
3. the metadata gives a ``LlamaConfig`` (architecture must be llama, qwen2 or qwen3);
4. every tensor's type and shape is checked against the config, still without copying;
5. each tensor is dequantized in numpy (``gguf.quants.dequantize``: F32, F16, BF16, Q4_0, Q4_1,
   Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, the types of a Q4_K_M file) and cast to the chosen dtype.

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` so that each head's rotary
pairs sit next to each other (dimensions 2i, 2i+1: GPT-J's interleaved RoPE). transformers'
Llama rotates the two halves of a head instead (dimension i with i + head_dim/2). We undo the
permutation on load, as transformers' GGUF integration does; without it the model writes garbage.
Only ``llama`` files are permuted: llama.cpp runs Qwen2 and Qwen3 with NeoX-style RoPE (the halves
of a head, like transformers), so their converter writes q and k unchanged.

Where transformers' GGUF loader reads the header differently, kvviz follows the header, as
llama.cpp does (tests/engine/test_gguf_families.py holds both to transformers):
- ``llama.attention.sliding_window`` is dropped by transformers: a llama file loads as its Llama
  (no window), or as its Mistral when general.name is "mistral", whose class default window of
  4,096 then applies whatever the header says. kvviz applies the header's window, and none when
  there is none (Mistral v0.2 and later have none);
- ``qwen3.attention.key_length`` (head_dim) is not mapped by transformers, which takes Qwen3's
  class default of 128 (every released Qwen3 has 128).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvviz.engine.loading.gguf_checks import check_architecture, family_of
from kvviz.engine.loading.gguf_codes import block_codes
from kvviz.engine.loading.gguf_lite import LiteGGUF, LiteTensor, read_gguf
from kvviz.engine.loading.weight_checks import check_finite
from kvviz.engine.models.llama import LlamaConfig, param_shapes
from kvviz.errors import KVVizError
from kvviz.engine.loading.gguf_codes import BlockCodes

# What ``dequantize_tensor`` reads, every family (the Gemma 3 reader takes this tuple too): the
# float types and the block types of llama.cpp's common files (Q4_K_M mixes Q4_K, Q5_0/Q5_1, Q6_K).
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")  # the ones this Llama reader builds

# llama.cpp tensor name -> transformers LlamaForCausalLM name ({i} = layer).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # Qwen2
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass
class GGUFModel:
    """What a GGUF file holds, in kvviz's terms."""

    config: LlamaConfig
    state_dict: dict[str, torch.Tensor]  # transformers' names; no lm_head.weight when tied
    tokenizer_metadata: dict[str, Any]  # tokenizer.ggml.* and tokenizer.chat_template, as read once
    info: dict[str, Any] = field(default_factory=dict)  # timings, type counts, file size
    # the quantized matrices as the file keeps them (int8 codes, a scale per block), by the same
    # names as state_dict, q/k rows in transformers' order: what kvviz.fast multiplies by (fp32 only)
    codes: dict[str, BlockCodes] = field(default_factory=dict)


def meta_int(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    """An integer metadata value (default when absent); KVVizError for a missing or mistyped one."""
    v = meta.get(key)
    if v is None:
        if default is None:
            raise KVVizError(f"GGUF metadata has no {key}")
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise KVVizError(f"GGUF metadata {key} must be an integer (got {v!r:.60})")
    return v


def meta_float(meta: dict[str, Any], key: str, default: float | None = None) -> float:
    """A number metadata value (default when absent); KVVizError for a missing or mistyped one."""
    v = meta.get(key)
    if v is None:
        if default is None:
            raise KVVizError(f"GGUF metadata has no {key}")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise KVVizError(f"GGUF metadata {key} must be a number (got {v!r:.60})")
    return float(v)


def architecture(g: LiteGGUF) -> str:
    arch = g.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise KVVizError("GGUF metadata has no general.architecture string")
    return arch


def config_from_metadata(g: LiteGGUF) -> LlamaConfig:
    """A LlamaConfig from ``<arch>.*`` metadata; refuses other architectures and Llama variants
    kvviz does not implement (rope scaling, partial rotary, mixture of experts)."""
    arch = architecture(g)
    meta = g.metadata
    check_architecture(arch)
    if arch not in SUPPORTED_ARCHS:  # gemma3: its own model, not this reader
        raise KVVizError("a gemma3 GGUF loads through kvviz's Gemma 3 model, not the Llama family's reader")
    p = arch + "."
    if meta_int(meta, p + "expert_count", 0) > 0:
        raise KVVizError(f"mixture-of-experts files ({p}expert_count = "
                         f"{meta_int(meta, p + 'expert_count')}) are not supported")
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        raise KVVizError(f"RoPE scaling {scaling!r} ({p}rope.scaling.type) is not supported")
    n_embd = meta_int(meta, p + "embedding_length")
    n_head = meta_int(meta, p + "attention.head_count")
    head_dim = meta_int(meta, p + "attention.key_length", n_embd // n_head if n_head > 0 else 0)
    if meta_int(meta, p + "attention.value_length", head_dim) != head_dim:
        raise KVVizError(f"{p}attention.value_length differs from key_length ({head_dim}); not supported")
    if meta_int(meta, p + "rope.dimension_count", head_dim) != head_dim:
        raise KVVizError(f"partial RoPE ({p}rope.dimension_count = {meta_int(meta, p + 'rope.dimension_count')} "
                         f"of head_dim {head_dim}) is not supported")
    vocab = meta.get(p + "vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else None
    if vocab is None:
        raise KVVizError(f"GGUF metadata has neither {p}vocab_size nor tokenizer.ggml.tokens")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    names = {t.name for t in g.tensors}
    # llama.cpp reads a window only for llama files; Qwen2/3 GGUFs run every layer full there too.
    window = meta_int(meta, p + "attention.sliding_window", 0) if arch == "llama" else 0
    fields = dict(
        vocab_size=vocab, block_size=meta_int(meta, p + "context_length"), n_layer=meta_int(meta, p + "block_count"),
        n_head=n_head, n_kv_head=meta_int(meta, p + "attention.head_count_kv", n_head), n_embd=n_embd,
        head_dim=head_dim, intermediate_size=meta_int(meta, p + "feed_forward_length"),
        rope_theta=meta_float(meta, p + "rope.freq_base", 10000.0),  # llama.cpp's default when absent
        rms_norm_eps=meta_float(meta, p + "attention.layer_norm_rms_epsilon"),
        tie_word_embeddings="output.weight" not in names,  # llama.cpp drops a tied output matrix
        eos_token_id=eos if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < vocab else None,
        family=family_of(arch, window or None, meta.get("general.name")), qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3", sliding_window=window or None,
    )
    try:
        return LlamaConfig(**fields)
    except ValueError as e:
        raise KVVizError(f"GGUF metadata describes an invalid model: {e}") from None


def map_name(gguf_name: str, n_layer: int, global_names: dict[str, str], layer_names: dict[str, str]) -> str | None:
    """transformers' name for a llama.cpp tensor (``blk.N.<part>`` or a global one) through a
    family's two tables, or None if the family has no such weight (or N is past its layers)."""
    if gguf_name in global_names:
        return global_names[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and int(m.group(1)) < n_layer and m.group(2) in layer_names:
        return f"model.layers.{int(m.group(1))}.{layer_names[m.group(2)]}"
    return None


def hf_name(gguf_name: str, n_layer: int) -> str | None:
    """transformers' name for a llama.cpp tensor name, or None if kvviz's Llama has no such weight."""
    return map_name(gguf_name, n_layer, _GLOBAL_NAMES, _LAYER_NAMES)


def match_tensors(tensors: tuple[LiteTensor, ...], expected: dict[str, tuple[int, ...]],
                  to_hf: Callable[[str], str | None], supported: tuple[Q, ...], model: str,
                  where: str) -> dict[str, LiteTensor]:
    """{transformers name: tensor}, after checking every name, type and shape against a family's
    ``expected`` shapes (nothing is copied): what both families' loaders check, in their words."""
    out: dict[str, LiteTensor] = {}
    for t in tensors:
        name = to_hf(t.name)
        if name is None or name not in expected:
            raise KVVizError(f"{where} has tensor {t.name}, which kvviz's {model} has no place for")
        if t.tensor_type not in supported:
            raise KVVizError(f"{where}: tensor {t.name} is {t.tensor_type.name}; kvviz dequantizes "
                             f"{', '.join(q.name for q in supported)}")
        if t.shape != expected[name]:  # torch order (gguf_lite reversed ggml's innermost-first dims)
            raise KVVizError(f"{where}: tensor {t.name} has shape {t.shape}, but the metadata implies "
                             f"{expected[name]}")
        out[name] = t
    missing = [k for k in expected if k not in out]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise KVVizError(f"{where} is missing tensors: {', '.join(missing[:3])}{more}")
    return out


def type_counts(tensors: Iterable[LiteTensor]) -> dict[str, int]:
    """{GGML type name: how many tensors} (the info a load reports)."""
    types: dict[str, int] = {}
    for t in tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return types


def check_tensors(tensors: tuple[LiteTensor, ...], config: LlamaConfig, where: str) -> dict[str, LiteTensor]:
    """{transformers name: tensor} of a Llama-family file, every name, type and shape checked."""
    if any(t.name == "rope_freqs.weight" for t in tensors):
        raise KVVizError(f"{where} carries rope_freqs (Llama 3.1-style RoPE scaling), which kvviz does not implement")
    return match_tensors(tensors, param_shapes(config), lambda n: hf_name(n, config.n_layer), SUPPORTED_TYPES,
                         config.family, where)


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's row order for attn_q (n_head = query heads) or attn_k (K/V heads).

    The converter reshapes each head's rows as (2, hs/2) and swaps the axes to (hs/2, 2), so the
    rows of rotary pair i (i and i + hs/2 in transformers' layout) become rows 2i and 2i+1.
    Swapping back restores the half-split layout that ``rotate_half`` expects.
    """
    out_rows, n_in = w.shape
    hs = out_rows // n_head
    w = w.view(n_head, hs // 2, 2, n_in)  # llama.cpp's (head, pair, member, in)
    return w.transpose(1, 2).reshape(out_rows, n_in)  # (head, member, pair, in) -> (out, in)


def dequantize_tensor(t: LiteTensor, codes: BlockCodes | None = None) -> torch.Tensor:
    """One tensor dequantized to fp32, in torch's shape (every family's loader uses it). A matrix of a
    type the block codes cover is rebuilt from them (``codes`` when the caller unpacked them already):
    value for value what gguf's dequantizer gives (tests/engine/test_gguf_codes.py), in a quarter
    of its time (Gemma 3 270M: 1.0 s instead of 4.0-4.4 s). Any other tensor goes through gguf."""
    c = codes if codes is not None else block_codes(t)
    if c is not None:
        return c.weight()
    arr = dequantize(t.data, t.tensor_type).reshape(t.shape)  # (rows, row bytes) -> values
    if not arr.flags.writeable:  # F32 comes back as a view of the read-only file mapping
        arr = np.array(arr)
    return torch.from_numpy(arr)


def unpermute_codes(c: BlockCodes, n_head: int) -> BlockCodes:
    """``unpermute_rope_rows`` on codes: a block (or K super-block) never spans rows, so the codes,
    scales and offsets move with their rows and still rebuild the unpermuted weight value for value."""
    return replace(c, codes=unpermute_rope_rows(c.codes, n_head),
                   scale=None if c.scale is None else unpermute_rope_rows(c.scale, n_head),
                   minv=None if c.minv is None else unpermute_rope_rows(c.minv, n_head))


def load_gguf(source: str | Path | LiteGGUF, dtype: torch.dtype = torch.float32,
              keep_codes: bool = False) -> GGUFModel:
    """Config, dequantized state dict and tokenizer metadata of a Llama-family GGUF file (a path,
    or the file ``read_gguf`` already opened: the loader reads the header once to pick a family);
    with ``keep_codes`` and fp32, the quantized matrices' codes too."""
    t0 = time.perf_counter()
    g = source if isinstance(source, LiteGGUF) else read_gguf(source)
    path = g.path
    config = config_from_metadata(g)
    tensors = check_tensors(g.tensors, config, path.name)
    t1 = time.perf_counter()
    sd: dict[str, torch.Tensor] = {}
    codes: dict[str, BlockCodes] = {}
    keep = keep_codes and dtype == torch.float32
    permuted = architecture(g) == "llama"  # Qwen2/3 files keep transformers' row order
    for name, t in tensors.items():
        c = block_codes(t)  # unpacked once: the fp32 weight is rebuilt from it, and kept for kvviz.fast
        w = dequantize_tensor(t, c)
        heads = config.n_head if name.endswith("q_proj.weight") else (
            config.kv_heads if name.endswith("k_proj.weight") else 0)
        if permuted and heads:
            w = unpermute_rope_rows(w, heads)
            c = None if c is None or not keep else unpermute_codes(c, heads)
        sd[name] = w if dtype == torch.float32 else w.to(dtype)
        if keep and c is not None:
            codes[name] = c
    check_finite(sd, path.name)
    info = {"file_bytes": path.stat().st_size, "tensor_types": type_counts(tensors.values()), "read_seconds": t1 - t0,
            "dequantize_seconds": time.perf_counter() - t1, "general.name": g.metadata.get("general.name"),
            "family": config.family, "codes_bytes": sum(c.nbytes for c in codes.values())}
    return GGUFModel(config, sd, g.tokenizer_metadata(), info, codes)


def tokenizer_metadata(source: str | Path | LiteGGUF) -> dict[str, Any]:
    """Every ``tokenizer.*`` field (``tokenizer.ggml.tokens``, ``.merges``, ``.token_type``,
    ``.bos/eos_token_id``, ``.pre``, ``tokenizer.chat_template``, ...) as plain Python values."""
    return (source if isinstance(source, LiteGGUF) else read_gguf(source)).tokenizer_metadata()
