"""Where each figure of a ModelSpec came from: the config.json field that was read, the config
class's default used for a field the file leaves out, or the rule that derived it.

A wrong config (a calculator that drifted from the files, LMCache #2248) or a base/Instruct mix-up
(Llama 4 Scout's 262,144 vs 10,485,760 positions) shows itself here: the figure names its field.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from kvviz.calculator.hf_fields import HEAD_KEYS, HIDDEN_KEYS, KV_KEYS, LAYER_KEYS, POS_KEYS
from kvviz.calculator.spec import ModelSpec


def _field(raw: Mapping[str, Any], keys: Sequence[str], filled: set[str], mtype: str) -> str | None:
    for k in keys:
        if raw.get(k) is not None:
            if k in filled:
                return f"{mtype} config class default {k}={raw[k]!r} (the file's text_config leaves it out)"
            return f"config.json {k} = {raw[k]!r}"
    return None


def provenance(raw: Mapping[str, Any], filled: set[str], spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    """(figure, where it came from) for the shape figures the calculator and the engines use."""
    m = spec.model_type
    out: list[tuple[str, str]] = []

    def put(name: str, where: str | None, fallback: str) -> None:
        out.append((name, where or fallback))

    put("n_layers", _field(raw, LAYER_KEYS, filled, m), "missing")
    put("n_heads", _field(raw, HEAD_KEYS, filled, m), "missing")
    put("hidden_size", _field(raw, HIDDEN_KEYS, filled, m), "missing")
    if spec.mla is not None:
        put("kv_lora_rank", _field(raw, ("kv_lora_rank",), filled, m), "missing")
        put("qk_rope_head_dim", _field(raw, ("qk_rope_head_dim",), filled, m), "missing")
        put("head_dim", None, "qk_nope_head_dim + qk_rope_head_dim (MLA: num_key_value_heads does not apply)")
    else:
        if m == "falcon":
            kv = "falcon: new_decoder_architecture / multi_query / num_kv_heads (see the notes)"
        else:
            kv = _field(raw, KV_KEYS, filled, m) or ("absent: every query head has its own K/V (MHA), the config "
                                                     "classes' default")
        put("n_kv_heads", kv, kv)
        put("head_dim", _field(raw, ("head_dim",), filled, m),
            f"hidden_size / num_attention_heads = {spec.hidden} / {spec.n_heads}")
    put("max_position_embeddings", _field(raw, POS_KEYS, filled, m),
        "FalconConfig's default 2048" if m == "falcon" and spec.max_positions == 2048 else "absent")
    spans = sorted({layer.span for layer in spec.layers if layer.caps and layer.span})
    if spans:
        key = "attention_chunk_size" if any(layer.kind == "chunked" for layer in spec.layers) else "sliding_window"
        put(key, _field(raw, (key,), filled, m), f"absent: the {m} config class's default ({spans[-1]:,})")
    kinds = next((n for n in spec.notes if "layer" in n and ("slide" in n or "layer_types" in n or "chunk" in n
                                                             or "linear" in n or "attention iff" in n)), None)
    put("layer kinds", kinds, "every layer full attention")
    put("params", None, spec.params_note or "unknown")
    return tuple(out)
