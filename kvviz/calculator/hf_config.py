"""config.json -> ModelSpec for the model families kvviz knows, following each family's
transformers implementation (and its config class's defaults for keys a file leaves out).

Every problem is collected and reported together, as sentences, in one ConfigError.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from kvviz.calculator.config_file import parse_json_text, read_config_bytes
from kvviz.calculator.hf_fields import (
    HEAD_KEYS, HIDDEN_KEYS, KV_KEYS, LAYER_KEYS, NESTED_DEFAULTS, NESTED_TYPES, POS_KEYS, SUPPORTED_MODEL_TYPES, Reader,
    Shape, short,
)
from kvviz.calculator.hf_params import count_params
from kvviz.calculator.hf_provenance import provenance
from kvviz.calculator.layouts import read_layout
from kvviz.calculator.spec import MAX_LAYERS, MAX_SEQ_LEN, MLA, ConfigError, ModelSpec

def parse_config(raw: Any, where: str = "config.json", name: str | None = None, source: str = "",
                 key: str = "") -> ModelSpec:
    """A ModelSpec from a Hugging Face (or kvviz) config.json object; ConfigError names every problem."""
    if not isinstance(raw, dict):
        raise ConfigError([f"must hold a JSON object, got {type(raw).__name__}"], where)
    notes: list[str] = []
    given = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    raw, mtype = _language_model(raw, notes)
    filled = {k for k in raw if k not in given}  # class defaults _language_model filled in
    rd = Reader(raw)
    if mtype == "falcon":
        shape, more = _falcon_shape(rd, notes)
    elif mtype in ("deepseek_v2", "deepseek_v3"):
        shape, more = _deepseek_shape(rd, notes)
    else:
        if mtype not in SUPPORTED_MODEL_TYPES:
            notes.append(f"model_type {mtype!r} is not one kvviz knows: read the generic keys "
                         f"({', '.join(SUPPORTED_MODEL_TYPES[:-1])} are recognised)")
        shape, more = _standard_shape(rd, mtype)
    max_pos = rd.int(POS_KEYS, required=False, maximum=MAX_SEQ_LEN)
    vocab = rd.int(("vocab_size", "padded_vocab_size"), required=False)
    if max_pos is None and mtype == "falcon":
        max_pos = 2048  # FalconConfig's default; falcon-7b's config.json leaves it out
    layers, state = read_layout(rd, mtype, shape.layers, shape.hidden, notes) if shape else ((), None)
    shared = rd.int("num_kv_shared_layers", required=False, minimum=0) or 0
    if shape and shared >= shape.layers:
        rd.problems.append(f"num_kv_shared_layers {shared} leaves none of the {shape.layers} layers a cache of its own")
    if shared:
        notes.append(f"num_kv_shared_layers {shared}: the last {shared} layers reuse earlier layers' K/V; the engine "
                     "sizings (vLLM, llama.cpp) leave them out, the totals here count every layer")
    if rd.problems or shape is None:
        raise ConfigError(rd.problems or ["could not read the attention shape"], where)
    spec = ModelSpec(
        name=name or str(raw.get("_name_or_path") or mtype), model_type=mtype, n_layers=shape.layers,
        n_heads=shape.heads, n_kv_heads=shape.kv, head_dim=shape.head_dim, hidden=shape.hidden,
        max_positions=max_pos, layers=layers, mla=more.get("mla"), state=state, vocab_size=vocab,
        source=source, key=key, kv_shared_layers=shared,
    )
    quant = raw.get("quantization_config")
    if isinstance(quant, dict) and isinstance(quant.get("quant_method"), str):
        notes.append(f"the checkpoint's weights are quantized ({quant['quant_method'][:40]}): choose the weight "
                     "dtype to match (int4 for 4-bit formats) rather than the fp16 default")
    params, active, pnote = count_params(raw, mtype, spec, notes)
    spec = replace(spec, params=params, active_params=active, params_note=pnote, notes=tuple(notes))
    return replace(spec, provenance=provenance(raw, filled, spec))


def _language_model(raw: dict[str, Any], notes: list[str]) -> tuple[dict[str, Any], str]:
    """The language model's own config and model_type. A multimodal checkpoint (Gemma 3, Llama 4,
    LLaVA, ...) keeps it in ``text_config``: it is read from there, never from the wrapper's top
    level, with the family's class defaults for the fields transformers leaves out of a nested config."""
    mtype = raw.get("model_type")
    if isinstance(raw.get("text_config"), dict):
        wrapper = mtype if isinstance(mtype, str) else "unknown"
        notes.append(f"read the language model from text_config (not the {short(wrapper)} wrapper's top level)")
        if isinstance(raw.get("vision_config"), dict):
            notes.append("the vision tower is not sized: its weights are not in the parameter count")
        text = raw["text_config"]
        mtype = text.get("model_type") or NESTED_TYPES.get(wrapper, wrapper)
        defaults = NESTED_DEFAULTS.get(mtype, {}) if isinstance(mtype, str) else {}
        filled = {k: v for k, v in defaults.items() if k not in text}
        if filled:
            notes.append(f"{mtype} defaults for the fields text_config leaves out: "
                         + ", ".join(f"{k}={v}" for k, v in filled.items()))
        raw = {**filled, **text}
    return raw, mtype if isinstance(mtype, str) else "unknown"


def _standard_shape(rd: Reader, mtype: str) -> tuple[Shape | None, dict[str, Any]]:
    layers = rd.int(LAYER_KEYS, maximum=MAX_LAYERS)
    heads = rd.int(HEAD_KEYS)
    hidden = rd.int(HIDDEN_KEYS)
    head_dim = rd.int("head_dim", required=False)
    kv = rd.int(KV_KEYS, required=False) if mtype != "gpt2" else None
    if kv is None:
        kv = heads  # absent (or null) means MHA in every transformers config class
    if heads and hidden and head_dim is None:
        if hidden % heads:
            rd.problems.append(f"{heads} attention heads do not divide hidden size {hidden} (and no head_dim is given)")
        head_dim = hidden // heads
    if heads and kv:
        if kv > heads:
            rd.problems.append(f"{kv} key/value heads is more than the {heads} attention heads")
        elif heads % kv:
            rd.problems.append(f"{kv} key/value heads do not divide the {heads} attention heads")
    if None in (layers, heads, hidden, head_dim, kv):
        return None, {}
    return Shape(layers, heads, kv, head_dim, hidden), {}  # type: ignore[arg-type]


def _falcon_shape(rd: Reader, notes: list[str]) -> tuple[Shape | None, dict[str, Any]]:
    layers = rd.int(LAYER_KEYS, maximum=MAX_LAYERS)
    heads = rd.int(HEAD_KEYS)
    hidden = rd.int(HIDDEN_KEYS)
    new_arch = rd.bool("new_decoder_architecture", False)
    multi_query = rd.bool("multi_query", True)  # FalconConfig's default is True
    kv_raw = rd.int(("num_kv_heads", "n_head_kv"), required=False)
    if new_arch:
        kv = kv_raw if kv_raw is not None else heads
        notes.append(f"falcon new_decoder_architecture: {kv} K/V groups from num_kv_heads")
    elif multi_query:
        kv = 1
        if kv_raw not in (None, 1):
            notes.append(f"falcon: num_kv_heads {kv_raw} ignored because multi_query is true (one K/V head)")
    else:
        kv = heads
    head_dim = rd.int("head_dim", required=False)
    if heads and hidden and head_dim is None:
        if hidden % heads:
            rd.problems.append(f"{heads} attention heads do not divide hidden size {hidden}")
        head_dim = hidden // heads
    if heads and kv and heads % kv:
        rd.problems.append(f"{kv} key/value heads do not divide the {heads} attention heads")
    if None in (layers, heads, hidden, head_dim, kv):
        return None, {}
    return Shape(layers, heads, kv, head_dim, hidden), {}  # type: ignore[arg-type]


def _deepseek_shape(rd: Reader, notes: list[str]) -> tuple[Shape | None, dict[str, Any]]:
    layers = rd.int(LAYER_KEYS, maximum=MAX_LAYERS)
    heads = rd.int(HEAD_KEYS)
    hidden = rd.int(HIDDEN_KEYS)
    kv_lora = rd.int("kv_lora_rank")
    rope = rd.int("qk_rope_head_dim")
    nope = rd.int("qk_nope_head_dim")
    v_dim = rd.int("v_head_dim")
    if None in (layers, heads, hidden, kv_lora, rope, nope, v_dim):
        return None, {}
    notes.append("MLA: the cache holds one (kv_lora_rank + qk_rope_head_dim) latent per layer per token; "
                 "num_key_value_heads does not apply")
    mla = MLA(kv_lora, rope, nope, v_dim)  # type: ignore[arg-type]
    return Shape(layers, heads, heads, nope + rope, hidden), {"mla": mla}  # type: ignore[arg-type]


def parse_config_text(text: str | bytes, where: str = "config.json", **kw: Any) -> ModelSpec:
    """Parse config.json text, bounded in size; every failure is a ConfigError, never a traceback."""
    return parse_config(parse_json_text(text, where), where, **kw)


def load_config_file(path: str | Path, **kw: Any) -> ModelSpec:
    """A ModelSpec from a config.json on disk: regular files only, read with a byte cap."""
    return parse_config_text(read_config_bytes(path), Path(path).name, **kw)
