"""The calculator's per-layer layouts read from config.json, worked by hand.

Every case uses a tiny shape (4 heads, 2 KV heads, head_dim 16, fp16), so one token in one KV
layer is 2 (K, V) x 2 heads x 16 x 2 B = 128 B and each total below is checked by hand.
"""
from __future__ import annotations

import json

import pytest

from kvviz.calculator import (
    FULL, ConfigError, Layer, MemoryRequest, StateShape, calculate, kv_bytes, load_presets, parse_config,
    parse_config_text,
)
from kvviz.calculator.spec import KVFormat

PRESETS = load_presets()
TINY = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}  # head_dim 16
PER = 128  # bytes per token per KV layer, fp16


def kv(cfg: dict, seq_len: int, **kw: object) -> int:
    return calculate(parse_config(cfg), MemoryRequest(seq_len=seq_len, **kw)).kv_bytes  # type: ignore[arg-type]


def groups(cfg: dict, seq_len: int, **kw: object) -> list[dict]:
    res = calculate(parse_config(cfg), MemoryRequest(seq_len=seq_len, **kw))  # type: ignore[arg-type]
    return [g.to_dict() for g in res.layers]


# ----------------------------------------------------------------------------- each layer kind by hand
def test_full_layers_hold_every_token() -> None:
    cfg = {"model_type": "llama", "num_hidden_layers": 2, **TINY}
    assert kv(cfg, 100) == 2 * 100 * PER == 25_600
    assert groups(cfg, 100) == [{"kind": "full", "span": None, "count": 2, "tokens_held": 100, "bytes": 25_600,
                                 "bytes_per_gpu": 25_600, "state_bytes": 0}]


def test_sliding_layers_hold_min_t_w() -> None:
    cfg = {"model_type": "mistral", "num_hidden_layers": 4, "sliding_window": 32, **TINY}
    assert kv(cfg, 100) == 4 * 32 * PER == 16_384  # every Mistral layer slides
    assert kv(cfg, 10) == 4 * 10 * PER == 5_120  # below the window: every token
    assert kv(cfg, 100, use_windows=False) == 4 * 100 * PER


def test_chunked_layers_hold_min_t_c_llama4_no_rope_layers() -> None:
    cfg = {"model_type": "llama4_text", "num_hidden_layers": 4, "head_dim": 16, "attention_chunk_size": 32,
           "no_rope_layers": [], **TINY}  # empty: Llama4TextConfig's default, every 4th layer NoPE (full)
    spec = parse_config(cfg)
    assert spec.layers == (Layer("chunked", 32),) * 3 + (FULL,)
    assert kv(cfg, 100) == (3 * 32 + 100) * PER == 25_088
    explicit = parse_config({**cfg, "no_rope_layers": [1, 0, 0, 1]})  # 1 = RoPE = chunked
    assert [x.kind for x in explicit.layers] == ["chunked", "full", "full", "chunked"]
    assert kv({**cfg, "no_rope_layers": [1, 0, 0, 1]}, 100) == (2 * 32 + 2 * 100) * PER


def test_linear_layers_hold_no_kv_and_a_fixed_state_qwen3_next() -> None:
    cfg = {"model_type": "qwen3_next", "num_hidden_layers": 4, "head_dim": 16, **TINY,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}  # full_attention_interval: default 4
    spec = parse_config(cfg)
    assert [x.kind for x in spec.layers] == ["linear", "linear", "linear", "full"]
    assert spec.state == StateShape("gated_deltanet", conv_channels=2 * 2 * 8 + 4 * 8, conv_width=3, heads=4,
                                    head_k=8, head_v=8, split=(("linear key heads", 2), ("linear value heads", 4)))
    res = calculate(spec, MemoryRequest(seq_len=100, batch=2, state_dtype="fp32"))
    assert res.kv_bytes == 2 * 1 * 100 * PER == 25_600  # one full layer, two sequences
    # per linear layer and sequence: conv 64 channels x 3 inputs + 4 heads x 8 x 8 = 448 values x 4 B
    assert res.state_bytes == 2 * 3 * (64 * 3 + 4 * 8 * 8) * 4 == 10_752
    assert res.kv_bytes_per_token == PER  # only the full layer grows
    linear = next(g for g in res.layers if g.kind == "linear")
    assert (linear.count, linear.tokens_held, linear.bytes, linear.state_bytes) == (3, 0, 0, 10_752)
    assert res.total_bytes is None and calculate(spec, MemoryRequest(seq_len=100, params=1000)).total_bytes == \
        100 * PER + 3 * 448 * 2 + 2000  # KV + state (auto: the fp16 weights' dtype) + weights
    assert "state total = 1,792 B x 3 linear layers x 2 sequences = 10,752 B" in "\n".join(res.formula)


def test_mamba1_layers_jamba_period_and_offset() -> None:
    cfg = {"model_type": "jamba", "num_hidden_layers": 8, **TINY, "mamba_d_state": 16, "mamba_d_conv": 4,
           "mamba_expand": 2}  # attn_layer_period 8, offset 4: the class defaults
    spec = parse_config(cfg)
    assert [x.kind for x in spec.layers] == ["linear"] * 4 + ["full"] + ["linear"] * 3
    res = calculate(spec, MemoryRequest(seq_len=50, state_dtype="bf16"))
    inner = 2 * 64
    assert res.kv_bytes == 50 * PER and res.state_bytes == 7 * (inner * 3 + inner * 16) * 2 == 34_048


def test_mamba2_layers_from_layer_types_and_their_tp_split() -> None:
    cfg = {"model_type": "granitemoehybrid", "num_hidden_layers": 2, **TINY, "layer_types": ["mamba", "attention"],
           "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_d_conv": 4,
           "mamba_expand": 1}
    spec = parse_config(cfg)
    # conv: (4 heads x 16 + 1 group x 2 x 8) channels x 3; recurrent: 4 heads x 16 x 8
    res = calculate(spec, MemoryRequest(seq_len=10, state_dtype="bf16"))
    assert res.state_bytes == ((64 + 16) * 3 + 4 * 16 * 8) * 2 == 1_504
    # tp 2: channels and heads halve; the single B/C group is replicated on both GPUs
    res2 = calculate(spec, MemoryRequest(seq_len=10, state_dtype="bf16", tp=2))
    assert res2.state_bytes_per_gpu == ((32 + 16) * 3 + 2 * 16 * 8) * 2 == 800
    assert res2.kv_bytes_per_gpu == 10 * PER // 2


def test_mla_layers_as_before() -> None:
    res = calculate(PRESETS["deepseek-v2"], MemoryRequest(seq_len=10))
    assert [g.kind for g in res.layers] == ["mla"] and res.layers[0].count == 60
    assert res.kv_bytes == 60 * 10 * 576 * 2


def test_paging_rounds_each_kind_up_to_blocks() -> None:
    cfg = {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 20, **TINY,
           "layer_types": ["sliding_attention", "full_attention"]}
    assert kv(cfg, 100, paged=True, block_size=16) == (32 + 112) * PER  # ceil(20/16) and ceil(100/16) blocks
    held = [g["tokens_held"] for g in groups(cfg, 100, paged=True, block_size=16)]
    assert held == [32, 112]


# ----------------------------------------------------------------------------- families' older fields
def test_gemma3_sliding_window_pattern() -> None:
    spec = PRESETS["gemma-3-1b"]
    glob = [i for i, x in enumerate(spec.layers) if x.kind == "full"]
    assert glob == [5, 11, 17, 23] and all(x == Layer("sliding", 512) for i, x in enumerate(spec.layers) if i not in glob)
    res = calculate(spec, MemoryRequest(seq_len=32_768, kv_dtype="bf16"))
    assert res.kv_bytes_per_token == 26 * 2 * 1 * 256 * 2 == 26_624
    assert res.kv_bytes == (22 * 512 + 4 * 32_768) * 1024 == 145_752_064
    # pattern 2 = Gemma 2's alternation, counted from the other end: layer i global iff (i + 1) % 2 == 0
    two = parse_config({"model_type": "gemma3_text", "num_hidden_layers": 4, "head_dim": 16, **TINY,
                        "sliding_window": 8, "sliding_window_pattern": 2})
    assert [x.kind for x in two.layers] == ["sliding", "full", "sliding", "full"]


def test_gpt_oss_layer_types_alternate() -> None:
    spec = PRESETS["gpt-oss-20b"]
    assert [x.kind for x in spec.layers[:4]] == ["sliding", "full", "sliding", "full"]
    assert spec.layers[0].span == 128
    res = calculate(spec, MemoryRequest(seq_len=131_072, kv_dtype="bf16"))
    assert res.kv_bytes == (12 * 128 + 12 * 131_072) * 2 * 8 * 64 * 2 == 3_224_371_200
    default = parse_config({"model_type": "gpt_oss", "num_hidden_layers": 2, "head_dim": 16, **TINY})
    assert default.layers == (Layer("sliding", 128), FULL)  # GptOssConfig: even layers slide, window 128


def test_qwen2_max_window_layers() -> None:
    base = {"model_type": "qwen2", "num_hidden_layers": 4, **TINY, "sliding_window": 8, "max_window_layers": 2}
    assert parse_config({**base, "use_sliding_window": True}).windows == (None, None, 8, 8)
    off = parse_config({**base, "use_sliding_window": False})
    assert off.layers == () and any("use_sliding_window is false" in n for n in off.notes)


def test_llama4_scout_preset() -> None:
    spec = PRESETS["llama-4-scout"]
    assert (spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim) == (48, 40, 8, 128)
    assert sum(x.kind == "chunked" for x in spec.layers) == 36 and spec.layers[3] == FULL
    t = 1 << 20
    res = calculate(spec, MemoryRequest(seq_len=t, kv_dtype="bf16"))
    assert res.kv_bytes == (36 * 8192 + 12 * t) * 2 * 8 * 128 * 2 == 52_747_567_104


def test_qwen3_next_preset() -> None:
    spec = PRESETS["qwen3-next-80b-a3b"]
    assert (spec.kv_layers, spec.linear_layers, spec.n_kv_heads, spec.head_dim) == (12, 36, 2, 256)
    res = calculate(spec, MemoryRequest(seq_len=1000, kv_dtype="bf16", weight_dtype="bf16"))
    assert res.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2 == 24_576
    assert res.state_bytes == 36 * (8192 * 3 + 32 * 128 * 128) * 2 == 36 * 1_097_728  # auto: bf16 weights


# ----------------------------------------------------------------------------- nested configs
def test_nested_text_config_is_read_never_the_top_level() -> None:
    cfg = {"model_type": "gemma3", "num_hidden_layers": 99, "hidden_size": 1, "sliding_window": 7,
           "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                           "num_hidden_layers": 34, "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model"}}
    spec = parse_config(cfg)
    assert (spec.n_layers, spec.hidden, spec.n_heads, spec.n_kv_heads, spec.head_dim) == (34, 2560, 8, 4, 256)
    assert spec.layers[0] == Layer("sliding", 1024) and spec.layers[5] == FULL
    assert any("num_attention_heads=8" in n for n in spec.notes)  # Gemma3TextConfig's defaults, named
    assert any("vision tower" in n for n in spec.notes)
    assert PRESETS["gemma-3-4b"].params == 3_880_263_168  # the language model only, worked from the layout


def test_nested_without_model_type_takes_the_wrappers_language_model() -> None:
    spec = parse_config({"model_type": "llama4", "text_config": {"num_hidden_layers": 4, "attention_chunk_size": 16}})
    assert spec.model_type == "llama4_text" and spec.n_heads == 40 and spec.layers[0] == Layer("chunked", 16)


# ----------------------------------------------------------------------------- layer_types wins
def test_layer_types_win_over_older_fields() -> None:
    base = {"model_type": "gemma3_text", "num_hidden_layers": 4, "head_dim": 16, **TINY, "sliding_window": 8,
            "sliding_window_pattern": 6}
    assert [x.kind for x in parse_config(base).layers] == ["sliding"] * 4
    typed = parse_config({**base, "layer_types": ["full_attention", "sliding_attention"] * 2})
    assert [x.kind for x in typed.layers] == ["full", "sliding", "full", "sliding"]
    assert any("wins over sliding_window_pattern" in n for n in typed.notes)
    qwen = parse_config({"model_type": "qwen2", "num_hidden_layers": 2, **TINY, "sliding_window": 8,
                         "use_sliding_window": False, "layer_types": ["sliding_attention", "full_attention"]})
    assert qwen.windows == (8, None)
    nope = parse_config({"model_type": "llama4_text", "num_hidden_layers": 2, "head_dim": 16, **TINY,
                         "attention_chunk_size": 8, "no_rope_layers": [1, 1],
                         "layer_types": ["full_attention", "chunked_attention"]})
    assert [x.kind for x in nope.layers] == ["full", "chunked"]
    interval = parse_config({"model_type": "qwen3_next", "num_hidden_layers": 2, "head_dim": 16, **TINY,
                             "full_attention_interval": 2, "layer_types": ["full_attention", "full_attention"]})
    assert interval.layers == () and interval.state is None


# ----------------------------------------------------------------------------- malformed and contradictory
@pytest.mark.parametrize("extra,message", [
    ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries but num_hidden_layers is 4"),
    ({"layer_types": ["full_attention", "hybrid", "full_attention", "x"]},
     "layer type kvviz does not know: 'hybrid' (layer 1), 'x' (layer 3)"),
    ({"layer_types": "sliding_attention"}, "layer_types must be a list of strings"),
    ({"layer_types": ["sliding_attention"] * 4}, "missing sliding_window"),
    ({"layer_types": ["chunked_attention"] * 4}, "missing attention_chunk_size"),
    ({"layer_types": ["linear_attention"] * 4}, "need Qwen3-Next's linear_* fields"),
    ({"layer_types": ["sliding_attention"] * 4, "sliding_window": -5}, "sliding_window must be positive"),
])
def test_bad_layouts_are_named(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"model_type": "mistral", "num_hidden_layers": 4, **TINY, **extra})
    assert message in str(e.value)


def test_bad_llama4_no_rope_layers() -> None:
    with pytest.raises(ConfigError, match="no_rope_layers must list 0 or 1 for each of the 4 layers"):
        parse_config({"model_type": "llama4_text", "num_hidden_layers": 4, "head_dim": 16, **TINY,
                      "no_rope_layers": [1, 2, 1, 0]})


def test_contradictions_reach_the_text_parser_as_one_message() -> None:
    text = json.dumps({"model_type": "mistral", "num_hidden_layers": 0, **TINY, "layer_types": ["x"]})
    with pytest.raises(ConfigError) as e:
        parse_config_text(text)
    assert "num_hidden_layers must be positive" in str(e.value)


def test_kv_bytes_sums_over_kinds() -> None:
    spec = parse_config({"model_type": "mistral", "num_hidden_layers": 3, **TINY, "sliding_window": 8,
                         "attention_chunk_size": 4,
                         "layer_types": ["sliding_attention", "chunked_attention", "full_attention"]})
    assert kv_bytes(spec, KVFormat("fp16"), 10) == (8 + 4 + 10) * PER
