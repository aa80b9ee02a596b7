"""Which kind each layer is (full, sliding, chunked, linear) and the linear layers' state shape,
read from config.json the way each family's transformers code reads it.

``layer_types``, when present, decides: it is what transformers' newer config classes write and
what their attention code follows. Without it each family has an older rule:
- Gemma 2: even layers slide; Gemma 3: ``sliding_window_pattern`` N, layer i global iff (i + 1) % N == 0;
- gpt-oss: even layers slide; Mistral, Phi-3 and unknown types with a ``sliding_window``: every layer;
- Qwen2/Qwen3: ``use_sliding_window``, the layers from ``max_window_layers`` on slide;
- Llama 4: ``no_rope_layers`` entry 1 (or every layer but each 4th) is chunked by ``attention_chunk_size``;
- Qwen3-Next: ``full_attention_interval`` N, layer i full iff (i + 1) % N == 0, the rest linear;
- Jamba: layer i is attention iff i % ``attn_layer_period`` == ``attn_layer_offset``, the rest Mamba.
"""
from __future__ import annotations

from typing import Any

from kvviz.calculator.hf_fields import KVVIZ_MODEL_TYPE, Reader, short
from kvviz.calculator.spec import FULL, MAX_LAYERS, MAX_SEQ_LEN, Layer, StateShape

# layer_types entry -> kind. "attention" is what hybrid Mamba configs (GraniteMoeHybrid) call a full layer.
LAYER_TYPES = {"full_attention": "full", "attention": "full", "sliding_attention": "sliding",
               "chunked_attention": "chunked", "linear_attention": "linear", "mamba": "linear"}
# Older fields that layer_types overrides, when both are present.
_OLDER_FIELDS = ("sliding_window_pattern", "_sliding_window_pattern", "no_rope_layers", "full_attention_interval",
                 "use_sliding_window", "max_window_layers", "attn_layer_period", "attn_layer_offset")
_NO_WINDOW_TYPES = frozenset({"llama", "gemma", "gpt2", "opt", "falcon", "deepseek_v2", "deepseek_v3",
                              KVVIZ_MODEL_TYPE})
_ALTERNATING = {"gemma2": 4096, "gpt_oss": 128}  # even layers slide; the config class's default window


def read_layout(rd: Reader, mtype: str, n_layers: int, hidden: int,
                notes: list[str]) -> tuple[tuple[Layer, ...], StateShape | None]:
    """(one Layer per layer, or () when every layer is full; the state shape of the linear layers)."""
    raw = rd.raw
    if raw.get("layer_types") is not None:
        types = _layer_types(rd, raw["layer_types"], n_layers)
        if types is None:
            return (), None
        older = [k for k in _OLDER_FIELDS if raw.get(k) is not None]
        notes.append("layer kinds from layer_types" + (f" (it wins over {', '.join(older)})" if older else ""))
        kinds = [LAYER_TYPES[t] for t in types]
    else:
        kinds = _family_kinds(rd, mtype, n_layers, notes)
    if kinds is None or set(kinds) == {"full"}:
        return (), None
    layers = _spans(rd, mtype, kinds, raw.get("layer_types") is not None, notes)
    state = None
    if "linear" in kinds:
        mamba = raw.get("layer_types") is not None and "mamba" in raw["layer_types"] or mtype == "jamba"
        state = _mamba_state(rd, hidden) if mamba else _deltanet_state(rd, mtype)
    return layers, state


def _layer_types(rd: Reader, value: Any, n_layers: int) -> list[str] | None:
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        rd.problems.append(f"layer_types must be a list of strings (got {short(value)})")
        return None
    if len(value) != n_layers:
        rd.problems.append(f"layer_types has {len(value):,} entries but num_hidden_layers is {n_layers:,}")
        return None
    unknown = sorted({t for t in value if t not in LAYER_TYPES})
    if unknown:
        where = ", ".join(f"{short(t)} (layer {value.index(t)})" for t in unknown[:3])
        rd.problems.append(f"layer_types holds a layer type kvviz does not know: {where}; "
                           f"known: {', '.join(LAYER_TYPES)}")
        return None
    return value


def _family_kinds(rd: Reader, mtype: str, n: int, notes: list[str]) -> list[str] | None:
    """Per-layer kinds from each family's older fields (None: every layer full)."""
    raw = rd.raw
    if mtype in ("gemma3_text", "gemma3"):
        every = rd.int(("sliding_window_pattern", "_sliding_window_pattern"), required=False, default=6)
        if every is None or raw.get("sliding_window", 0) is None:
            return None
        notes.append(f"Gemma 3: every {every}th layer is global, the others slide (sliding_window_pattern {every})")
        return ["full" if (i + 1) % every == 0 else "sliding" for i in range(n)]
    if mtype in _ALTERNATING:
        notes.append("even-indexed layers slide, odd ones are global")
        return ["sliding" if i % 2 == 0 else "full" for i in range(n)]
    if mtype in ("llama4_text", "llama4"):
        return _llama4_kinds(rd, n, notes)
    if mtype == "qwen3_next":
        every = rd.int("full_attention_interval", required=False, default=4)
        if every is None:
            return None
        notes.append(f"Qwen3-Next: every {every}th layer is full attention, the others linear (Gated DeltaNet)")
        return ["full" if (i + 1) % every == 0 else "linear" for i in range(n)]
    if mtype == "jamba":
        period = rd.int("attn_layer_period", required=False, default=8)
        offset = rd.int("attn_layer_offset", required=False, default=4, minimum=0)
        if period is None or offset is None:
            return None
        notes.append(f"Jamba: layer i is attention iff i % {period} == {offset}, the others Mamba")
        return ["full" if i % period == offset else "linear" for i in range(n)]
    win = raw.get("sliding_window")
    if win is None or mtype in _NO_WINDOW_TYPES:
        return None  # these implementations never use a window
    if mtype in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not rd.bool("use_sliding_window", False):
            notes.append(f"use_sliding_window is false: sliding_window {short(win)} does not apply")
            return None
        first = rd.int("max_window_layers", required=False, minimum=0, maximum=MAX_LAYERS)
        first = n if first is None else first
        return ["sliding" if i >= first else "full" for i in range(n)]  # as in Qwen2Config.layer_types
    if mtype == "phi3":
        notes.append(f"Phi-3 declares sliding_window {short(win)} on every layer; transformers' cache honours it, "
                     "some servers keep every token (turn windows off to see that)")
    return ["sliding"] * n


def _llama4_kinds(rd: Reader, n: int, notes: list[str]) -> list[str] | None:
    raw = rd.raw
    if "attention_chunk_size" in raw and raw["attention_chunk_size"] is None:
        notes.append("attention_chunk_size is null: every layer attends to the whole context")
        return None
    no_rope = raw.get("no_rope_layers")
    if no_rope:  # an empty list means the default, as in Llama4TextConfig
        if not isinstance(no_rope, list) or len(no_rope) != n or any(x not in (0, 1) for x in no_rope):
            rd.problems.append(f"no_rope_layers must list 0 or 1 for each of the {n:,} layers (got {short(no_rope)})")
            return None
        rope = [x == 1 for x in no_rope]
    else:
        every = rd.int("no_rope_layer_interval", required=False, default=4)
        if every is None:
            return None
        rope = [(i + 1) % every != 0 for i in range(n)]
    notes.append("Llama 4: the RoPE layers (no_rope_layers = 1) attend within chunks, the NoPE layers to everything")
    return ["chunked" if r else "full" for r in rope]


def _spans(rd: Reader, mtype: str, kinds: list[str], typed: bool, notes: list[str]) -> tuple[Layer, ...]:
    """The window of the sliding layers and the chunk of the chunked ones, from the config."""
    raw = rd.raw
    window = chunk = None
    if "sliding" in kinds:
        default = _ALTERNATING.get(mtype, 4096 if mtype in ("gemma3_text", "gemma3") else None)
        window = rd.int("sliding_window", required=default is None, default=default, maximum=MAX_SEQ_LEN)
        if default is not None and raw.get("sliding_window") is None:
            notes.append(f"sliding_window absent: {default:,}, the config class's default")
        if window is None and typed and not any("sliding_window" in p for p in rd.problems):
            rd.problems.append("layer_types has sliding_attention layers but sliding_window is missing")
    if "chunked" in kinds:
        default = 8192 if mtype in ("llama4_text", "llama4") else None
        chunk = rd.int("attention_chunk_size", required=default is None, default=default, maximum=MAX_SEQ_LEN)
    out = []
    for k in kinds:
        if k == "sliding":
            out.append(Layer("sliding", window) if window else FULL)
        elif k == "chunked":
            out.append(Layer("chunked", chunk) if chunk else FULL)
        else:
            out.append(Layer(k))
    return tuple(out)


def _ints(*values: int | None) -> tuple[int, ...] | None:
    """All the values when every one was read; None when any is missing (the reader has said why)."""
    return None if any(v is None for v in values) else tuple(v for v in values if v is not None)


def _deltanet_state(rd: Reader, mtype: str) -> StateShape | None:
    """Gated DeltaNet (Qwen3-Next): conv over q, k, v channels; a dk x dv state per value head."""
    d = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
         "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4} if mtype == "qwen3_next" else {}
    got = _ints(*(rd.int(k, default=d.get(k)) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                                         "linear_key_head_dim", "linear_value_head_dim",
                                                         "linear_conv_kernel_dim")))
    if got is None:
        rd.problems.append("linear_attention layers need Qwen3-Next's linear_* fields to size their state")
        return None
    nk, nv, dk, dv, kernel = got
    return StateShape("gated_deltanet", conv_channels=2 * nk * dk + nv * dv, conv_width=kernel - 1, heads=nv,
                      head_k=dk, head_v=dv, split=(("linear key heads", nk), ("linear value heads", nv)))


def _mamba_state(rd: Reader, hidden: int) -> StateShape | None:
    """Mamba2 (heads x head_dim x d_state, plus B/C groups in the conv) when the config names Mamba
    heads; Mamba1 (Jamba: channels x d_state) otherwise."""
    raw = rd.raw
    common = _ints(rd.int(("mamba_d_state", "ssm_state_size", "state_size"), default=16),
                   rd.int(("mamba_d_conv", "conv_kernel"), default=4), rd.int(("mamba_expand", "expand"), default=2))
    if common is None:
        return None
    d_state, kernel, expand = common
    if raw.get("mamba_n_heads") is None and raw.get("mamba_num_heads") is None:
        inner = expand * hidden
        return StateShape("mamba", conv_channels=inner, conv_width=kernel - 1, heads=inner, head_k=d_state, head_v=1,
                          split=(("Mamba channels (mamba_expand x hidden_size)", inner),))
    two = _ints(rd.int(("mamba_n_heads", "mamba_num_heads")), rd.int(("mamba_n_groups", "n_groups"), default=1))
    if two is None:
        return None
    heads, groups = two
    if raw.get("mamba_d_head", raw.get("mamba_head_dim")) in (None, "auto"):
        head_dim: int | None = expand * hidden // heads  # GraniteMoeHybridConfig's "auto"
    else:
        head_dim = rd.int(("mamba_d_head", "mamba_head_dim"))
    if head_dim is None:
        return None
    return StateShape("mamba2", conv_channels=heads * head_dim, conv_width=kernel - 1, heads=heads, head_k=head_dim,
                      head_v=d_state, n_groups=groups, group_channels=2 * d_state, split=(("Mamba heads", heads),))
