"""The KV memory calculator: published figures, config parsing, properties and kvviz's own caches."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvviz.calculator import (
    FULL, GB, GIB, MAX_CONFIG_BYTES, CalcError, ConfigError, KVFormat, Layer, MemoryRequest, ModelSpec, attention_variants,
    calculate, find_preset, formula_lines, kv_bytes, layer_token_bytes, load_config_file, load_presets,
    max_seq_len_for, parse_config, parse_config_text, weight_bytes,
)

ROOT = Path(__file__).resolve().parents[2]
PRESETS = load_presets()


def kv(key: str, seq_len: int, dtype: str = "fp16", **kw: object) -> int:
    return calculate(PRESETS[key], MemoryRequest(seq_len=seq_len, kv_dtype=dtype, **kw)).kv_bytes  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- layering
MEMORY_DIR = ROOT / "kvviz" / "calculator"
MEMORY_FILES = sorted(p.name for p in MEMORY_DIR.glob("*.py"))
# kvviz.limits is the bounds every entry point shares: standard library only, like the other two.
# kvviz.paths (floor 0, standard library only) finds the shipped presets in a checkout or a wheel.
ALLOWED_KVVIZ = {"kvviz.errors", "kvviz.units", "kvviz.limits", "kvviz.paths"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    return names


@pytest.mark.parametrize("module", MEMORY_FILES)
def test_memory_package_imports_only_stdlib_errors_and_units(module: str) -> None:
    for name in _imports(MEMORY_DIR / module):
        top = name.split(".")[0]
        if top == "kvviz":
            assert name in ALLOWED_KVVIZ or name.startswith("kvviz.calculator."), (module, name)
        else:
            assert top in sys.stdlib_module_names or top == "__future__", (module, name)


def test_memory_package_files_stay_small() -> None:
    for name in MEMORY_FILES:
        assert len((MEMORY_DIR / name).read_text(encoding="utf-8").splitlines()) <= 420, name


def test_memory_charts_import_no_framework() -> None:
    names = {n.split(".")[0] for n in _imports(ROOT / "kvviz" / "charts" / "calculator_charts.py")}
    assert not names & {"torch", "streamlit"}


def test_import_kvviz_memory_loads_no_framework() -> None:
    # `import kvviz.calculator` runs kvviz/__init__.py first. While that file imports the engine
    # eagerly (issue 12 makes it lazy), torch arrives through it, not through calculator/: then the
    # package is imported without running kvviz/__init__.py, to check calculator/ alone.
    code = (
        "import json, sys, types\n"
        "eager = False\n"
        "try:\n"
        "    import kvviz\n"
        "    eager = 'torch' in sys.modules\n"
        "except ImportError:\n"
        "    pass\n"
        "if eager:\n"
        "    for k in [k for k in sys.modules if k.split('.')[0] in ('kvviz', 'torch', 'numpy', 'streamlit', 'plotly')]:\n"
        "        del sys.modules[k]\n"
        f"    pkg = types.ModuleType('kvviz'); pkg.__path__ = [{str(ROOT / 'kvviz')!r}]; sys.modules['kvviz'] = pkg\n"
        "import kvviz.calculator as m\n"
        "assert len(m.load_presets()) >= 22\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'streamlit', 'numpy', 'plotly'))\n"
        "print(json.dumps({'eager': eager, 'bad': bad}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         cwd=ROOT)
    assert json.loads(out.stdout)["bad"] == []


# ----------------------------------------------------------------------------- published figures
def test_vllm_paper_opt13b_800kb_per_token() -> None:
    res = calculate(PRESETS["opt-13b"], MemoryRequest(seq_len=1, kv_dtype="fp16"))
    assert res.kv_bytes_per_token == 2 * 40 * 5120 * 2 == 819_200 == 800 * 1024


def test_nvidia_blog_llama2_7b_4096_tokens_is_2gb() -> None:
    assert kv("llama-2-7b", 4096) == 2 * 32 * 4096 * 2 * 4096 == 2 * GIB  # "~2 GB"


def test_hf_kv_quant_blog_llama2_7b_10k_tokens_is_5gb() -> None:
    b = kv("llama-2-7b", 10_000)
    assert b == 524_288 * 10_000 == 5_242_880_000
    assert round(b / GB) == 5


def test_deepseek_v2_paper_34_6k_elements_per_token() -> None:
    res = calculate(PRESETS["deepseek-v2"], MemoryRequest(seq_len=1, kv_dtype="fp16"))
    assert res.kv_bytes_per_token // 2 == 60 * (512 + 64) == 34_560
    # Naive per-head cache: K of 128 + 64 and V of 128 for each of 128 heads, per layer.
    assert res.kv_bytes_mha // 2 == 60 * 128 * (192 + 128)
    assert PRESETS["deepseek-v2"].attention == "MLA"


def test_mistral_window_saves_8x_at_32k() -> None:
    full = kv("mistral-7b-v0.1", 32_768, use_windows=False)
    windowed = kv("mistral-7b-v0.1", 32_768)
    assert full == 8 * windowed
    assert windowed == 2 * 32 * 8 * 128 * 2 * 4096


def test_lmcache_bf16_per_1000_tokens_in_gib() -> None:
    assert kv("llama-3.1-70b", 1000, "bf16") == 327_680_000
    assert round(kv("llama-3.1-70b", 1000, "bf16") / GIB, 4) == 0.3052
    qwen3 = PRESETS["qwen3-8b"]
    assert (qwen3.n_layers, qwen3.n_kv_heads, qwen3.head_dim) == (36, 8, 128)
    assert round(kv("qwen3-8b", 1000, "bf16") / GIB, 4) == 0.1373


@pytest.mark.parametrize("key,layers,hidden", [("gpt2", 12, 768), ("gpt2-large", 36, 1280), ("llama-2-7b", 32, 4096)])
@pytest.mark.parametrize("tokens", [512, 2048, 8192])
def test_seed_fp16_table(key: str, layers: int, hidden: int, tokens: int) -> None:
    res = calculate(PRESETS[key], MemoryRequest(seq_len=tokens, kv_dtype="fp16"))
    assert res.kv_bytes == 2 * layers * hidden * 2 * tokens  # 2 (K,V) x L x (H x hd) x 2 bytes x T
    beyond = tokens > PRESETS[key].max_positions  # type: ignore[operator]
    assert any("max_position_embeddings" in w for w in res.warnings) == beyond  # computed anyway, warned


def test_llama3_8b_4gb_claim_is_the_mha_figure() -> None:
    res = calculate(PRESETS["llama-3-8b"], MemoryRequest(seq_len=8192, batch=1, kv_dtype="bf16"))
    assert res.kv_bytes_mha == 4_294_967_296 and round(res.kv_bytes_mha / GB, 2) == 4.29
    assert res.kv_bytes == GIB and round(res.kv_bytes / GB, 2) == 1.07


# ----------------------------------------------------------------------------- presets
def test_at_least_22_presets_each_with_a_config_json_source() -> None:
    assert len(PRESETS) >= 22
    for spec in PRESETS.values():
        assert spec.source.startswith("https://huggingface.co/") and spec.source.endswith("/config.json")
    wanted = {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-2-7b", "llama-2-13b", "llama-2-70b",
              "llama-3-8b", "llama-3-70b", "llama-3.1-405b", "mistral-7b-v0.1", "mixtral-8x7b", "qwen2.5-7b",
              "qwen2.5-72b", "gemma-2-9b", "phi-3-mini-4k", "falcon-7b", "deepseek-v2", "deepseek-v3",
              "smollm-135m", "tinyllama-1.1b", "opt-13b",
              # issue 16: hybrid layouts
              "smollm2-135m", "gemma-3-1b", "gemma-3-4b", "gpt-oss-20b", "llama-4-scout", "qwen3-8b",
              "qwen3-next-80b-a3b"}
    assert wanted <= set(PRESETS)


# Published totals: the model cards / Hugging Face safetensors metadata of each source repository.
PUBLISHED_PARAMS = {
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200,
    "llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496, "llama-3.1-405b": 405_853_388_800,
    "mistral-7b-v0.1": 7_241_732_096, "mixtral-8x7b": 46_702_792_704, "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-72b": 72_706_203_648, "gemma-2-9b": 9_241_705_984, "phi-3-mini-4k": 3_821_079_552,
    "falcon-7b": 6_921_720_704, "tinyllama-1.1b": 1_100_048_384, "smollm-135m": 134_515_008,
    "deepseek-v3": 671_026_419_200,
    # SmolLM2-135M has SmolLM-135M's architecture; Gemma 3 1B is text-only (its safetensors total).
    "smollm2-135m": 134_515_008, "gemma-3-1b": 999_885_952,
}
# Known only to the published rounding, in billions: ("236B", "8.19B", ...).
ROUNDED_PARAMS = {"deepseek-v2": "236", "qwen3-8b": "8.19", "mistral-nemo-12b": "12.2", "opt-13b": "12.85",
                  "gpt-oss-20b": "21", "qwen3-next-80b-a3b": "80"}


@pytest.mark.parametrize("key", sorted(PUBLISHED_PARAMS))
def test_parameter_count_from_config_matches_published(key: str) -> None:
    assert PRESETS[key].params == PUBLISHED_PARAMS[key]


@pytest.mark.parametrize("key", sorted(ROUNDED_PARAMS))
def test_parameter_count_matches_published_rounding(key: str) -> None:
    published = ROUNDED_PARAMS[key]
    digits = len(published.partition(".")[2])
    assert round(PRESETS[key].params / 1e9, digits) == float(published)  # type: ignore[operator]


def test_moe_active_params() -> None:
    assert PRESETS["llama-4-scout"].active_params == pytest.approx(17e9, rel=0.02)  # "17B active"
    oss = PRESETS["gpt-oss-20b"]  # OpenAI's "3.6B active" leaves the input embedding out
    assert oss.active_params - oss.vocab_size * oss.hidden == pytest.approx(3.6e9, rel=0.01)  # type: ignore[operator]
    assert PRESETS["mixtral-8x7b"].active_params == pytest.approx(12.9e9, rel=0.01)
    assert PRESETS["deepseek-v3"].active_params == pytest.approx(37e9, rel=0.02)
    assert PRESETS["deepseek-v2"].active_params == pytest.approx(21e9, rel=0.03)


def test_find_preset_is_case_insensitive_and_names_close_matches() -> None:
    assert find_preset("Llama-3-8B", PRESETS).key == "llama-3-8b"
    with pytest.raises(CalcError, match="did you mean"):
        find_preset("llama", PRESETS)


# ----------------------------------------------------------------------------- config parsing
def test_falcon_multi_query_ignores_num_kv_heads() -> None:
    f = PRESETS["falcon-7b"]
    assert (f.n_kv_heads, f.head_dim, f.attention, f.max_positions) == (1, 64, "MQA", 2048)
    assert any("num_kv_heads 71 ignored" in n for n in f.notes)
    new = parse_config({"model_type": "falcon", "hidden_size": 8192, "num_attention_heads": 128,
                        "num_hidden_layers": 60, "new_decoder_architecture": True, "num_kv_heads": 8,
                        "vocab_size": 65024})
    assert (new.n_kv_heads, new.attention) == (8, "GQA")
    mha = parse_config({"model_type": "falcon", "hidden_size": 2048, "num_attention_heads": 32,
                        "num_hidden_layers": 24, "multi_query": False, "vocab_size": 50304})
    assert mha.attention == "MHA"


def test_head_dim_from_config_not_hidden_over_heads() -> None:
    assert PRESETS["gemma-2-9b"].head_dim == 256 != 3584 // 16
    assert PRESETS["mistral-nemo-12b"].head_dim == 128 != 5120 // 32
    assert PRESETS["qwen3-8b"].head_dim == 128
    assert parse_config({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
                         "hidden_size": 64, "head_dim": None}).head_dim == 16  # null head_dim: hidden / heads


def test_published_layouts_of_the_new_presets() -> None:
    shape = {k: (s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim, s.hidden, s.max_positions) for k, s in PRESETS.items()}
    assert shape["smollm2-135m"] == (30, 9, 3, 64, 576, 8192)
    assert shape["gemma-3-1b"] == (26, 4, 1, 256, 1152, 32_768)
    assert shape["gemma-3-4b"] == (34, 8, 4, 256, 2560, 131_072)
    assert shape["gpt-oss-20b"] == (24, 64, 8, 64, 2880, 131_072)
    assert shape["llama-4-scout"] == (48, 40, 8, 128, 5120, 262_144)  # the base model; 10,485,760 is the Instruct's
    assert shape["qwen3-next-80b-a3b"] == (48, 16, 2, 256, 2048, 262_144)
    summary = {k: PRESETS[k].window_summary() for k in ("gemma-3-1b", "gemma-3-4b", "gpt-oss-20b", "llama-4-scout",
                                                          "qwen3-next-80b-a3b")}
    assert summary == {"gemma-3-1b": "22 layers x 512, 4 global layers", "gemma-3-4b": "29 layers x 1,024, 5 global layers",
                       "gpt-oss-20b": "12 layers x 128, 12 global layers",
                       "llama-4-scout": "36 chunked layers x 8,192, 12 global layers",
                       "qwen3-next-80b-a3b": "12 global layers, 36 linear layers (no KV)"}
    assert any("quantized (mxfp4)" in n for n in PRESETS["gpt-oss-20b"].notes)


def test_sliding_windows_per_model() -> None:
    assert PRESETS["mistral-7b-v0.1"].windows == (4096,) * 32
    g = PRESETS["gemma-2-9b"].windows
    assert g[0] == g[2] == 4096 and g[1] is None and g[41] is None and sum(w is not None for w in g) == 21
    assert PRESETS["qwen2.5-7b"].windows == ()  # use_sliding_window: false
    assert PRESETS["mixtral-8x7b"].windows == ()  # sliding_window: null
    on = parse_config({"model_type": "qwen2", "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64,
                       "use_sliding_window": True, "sliding_window": 128, "max_window_layers": 2})
    assert on.windows == (None, None, 128, 128)  # transformers: layers from max_window_layers on slide
    typed = parse_config({"model_type": "mistral", "num_hidden_layers": 3, "num_attention_heads": 4, "hidden_size": 64,
                          "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention",
                                                                "sliding_attention"]})
    assert typed.windows == (32, None, 32)
    # Gemma 2 at 8,192 tokens: 21 layers x 4,096 + 21 layers x 8,192.
    assert kv("gemma-2-9b", 8192) == 2 * 8 * 256 * 2 * (21 * 4096 + 21 * 8192)


def test_generic_keys_and_text_config() -> None:
    s = parse_config({"model_type": "somethingnew", "n_layer": 6, "n_head": 8, "n_embd": 512, "n_kv_heads": 2,
                      "n_positions": 2048})
    assert (s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim, s.max_positions) == (6, 8, 2, 64, 2048)
    assert s.params is None and any("not one kvviz knows" in n for n in s.notes)
    res = calculate(s, MemoryRequest(seq_len=10))
    assert res.weights_bytes is None and any("--params" in w for w in res.warnings)
    assert calculate(s, MemoryRequest(seq_len=10, params=1000, weight_dtype="int4")).weights_bytes == 500
    nested = parse_config({"model_type": "llava", "text_config": {"model_type": "llama", "num_hidden_layers": 2,
                                                                   "num_attention_heads": 4, "hidden_size": 64}})
    assert nested.n_layers == 2


def test_every_problem_is_named_in_one_message() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"model_type": "llama", "num_hidden_layers": 0, "num_attention_heads": 7, "hidden_size": 64,
                      "num_key_value_heads": 3})
    msg = str(e.value)
    assert "num_hidden_layers must be positive (got 0)" in msg
    assert "7 attention heads do not divide hidden size 64" in msg
    assert "3 key/value heads do not divide the 7 attention heads" in msg
    with pytest.raises(ConfigError) as e:
        parse_config({"model_type": "llama"})
    assert all(f"missing {k}" in str(e.value) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size"))
    with pytest.raises(ConfigError, match="must be an integer"):
        parse_config({"model_type": "gpt2", "n_layer": "12", "n_head": 12, "n_embd": 768})
    with pytest.raises(ConfigError, match="must be an integer"):
        parse_config({"model_type": "gpt2", "n_layer": True, "n_head": 12, "n_embd": 768})
    with pytest.raises(ConfigError, match="implausibly large"):
        parse_config({"model_type": "gpt2", "n_layer": 10**9, "n_head": 12, "n_embd": 768})
    with pytest.raises(ConfigError, match="more than the"):
        parse_config({"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 4, "hidden_size": 64,
                      "num_key_value_heads": 8})
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        parse_config({"model_type": "deepseek_v3", "num_hidden_layers": 1, "num_attention_heads": 4, "hidden_size": 64})


@pytest.mark.parametrize("text,match", [
    ("{not json", "not valid JSON"), ("[1, 2]", "JSON object"), ("", "empty"), (b"\xff\xfe", "UTF-8"),
    ("[" * 100_000 + "]" * 100_000, "JSON|nested"), (" " * (MAX_CONFIG_BYTES + 1), "at most"),
])
def test_bad_config_text_is_a_config_error(text: str | bytes, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config_text(text)


def test_load_config_file(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
                             "hidden_size": 64, "intermediate_size": 128, "vocab_size": 100}))
    s = load_config_file(p)
    assert s.params == 100 * 64 * 2 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    with pytest.raises(ConfigError, match="no such file"):
        load_config_file(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="folder"):
        load_config_file(tmp_path)


# ----------------------------------------------------------------------------- formats, paging, fit
def test_int8_int4_scale_overhead_is_counted_per_group() -> None:
    spec = PRESETS["llama-2-7b"]  # head_dim 128: two groups of 64 per head vector
    assert layer_token_bytes(spec, KVFormat("int8")) == 2 * 32 * (128 + 2 * 2)
    assert layer_token_bytes(spec, KVFormat("int4")) == 2 * 32 * (64 + 2 * 2)
    assert layer_token_bytes(spec, KVFormat("int4", group_size=128, scale_dtype="fp32")) == 2 * 32 * (64 + 4)
    assert layer_token_bytes(spec, KVFormat("int4", zero_point=True)) == 2 * 32 * (64 + 2 * 4)
    assert layer_token_bytes(spec, KVFormat("fp8")) == 2 * 32 * 128
    assert "ceil(128 / 64) groups x 2 B scale = 68 B" in "\n".join(
        formula_lines(spec, MemoryRequest(seq_len=1, kv_dtype="int4")))


def test_paging_rounds_up_and_shows_the_waste() -> None:
    res = calculate(PRESETS["llama-2-7b"], MemoryRequest(seq_len=1000, batch=3, paged=True))
    assert res.kv_bytes == 3 * 1008 * 524_288
    assert res.paging_waste_bytes == 3 * 8 * 524_288
    assert calculate(PRESETS["llama-2-7b"], MemoryRequest(seq_len=1024, paged=True)).paging_waste_bytes == 0


def test_beams_multiply_like_batch() -> None:
    assert kv("llama-3-8b", 777, batch=2, beams=4) == 8 * kv("llama-3-8b", 777)


def test_weights_bytes_by_dtype() -> None:
    assert weight_bytes(7, "int4") == 4 and weight_bytes(7, "fp32") == 28 and weight_bytes(7, "bf16") == 14
    res = calculate(PRESETS["llama-2-7b"], MemoryRequest(seq_len=1, weight_dtype="int8"))
    assert res.weights_bytes == 6_738_415_616 and res.total_bytes == res.weights_bytes + res.kv_bytes


def test_gpu_fit_max_batch_and_context_are_exact() -> None:
    spec = PRESETS["llama-3-8b"]
    req = MemoryRequest(seq_len=8192, batch=1, kv_dtype="bf16", weight_dtype="bf16", gpu_gib=24, reserve=0.1)
    res = calculate(spec, req)
    fit = res.fit
    assert fit is not None and fit.fits and fit.usable_bytes == int(24 * GIB * 0.9)
    budget = fit.usable_bytes - res.weights_bytes  # type: ignore[operator]
    fmt = req.kv_format
    assert kv_bytes(spec, fmt, 8192, fit.max_batch) <= budget < kv_bytes(spec, fmt, 8192, fit.max_batch + 1)
    assert kv_bytes(spec, fmt, fit.max_seq_len, 1) <= budget < kv_bytes(spec, fmt, fit.max_seq_len + 1, 1)  # type: ignore[arg-type]
    big = calculate(PRESETS["llama-3.1-405b"], replace(req, gpu_gib=80))
    assert big.fit is not None and not big.fit.fits and big.fit.max_batch == 0 and big.fit.max_seq_len == 0
    assert any("weights alone" in w for w in big.warnings)


def test_all_windowed_model_has_unbounded_context() -> None:
    res = calculate(PRESETS["mistral-7b-v0.1"], MemoryRequest(seq_len=4096, gpu_gib=80))
    assert res.fit is not None and res.fit.max_seq_len is None
    res = calculate(PRESETS["mistral-7b-v0.1"], MemoryRequest(seq_len=4096, gpu_gib=80, use_windows=False))
    assert res.fit is not None and res.fit.max_seq_len and res.fit.max_seq_len > 100_000


def test_beyond_max_positions_computes_and_warns() -> None:
    res = calculate(PRESETS["llama-2-7b"], MemoryRequest(seq_len=1_000_000))
    assert res.kv_bytes == 524_288 * 1_000_000
    assert any("beyond" in w for w in res.warnings)


def test_bad_requests_name_every_problem() -> None:
    with pytest.raises(CalcError) as e:
        MemoryRequest(seq_len=0, batch=-1, kv_dtype="fp64", reserve=1.5, gpu_gib=-3)
    msg = str(e.value)
    for word in ("seq_len", "batch", "kv_dtype", "reserve", "gpu_gib"):
        assert word in msg


def test_attention_variants_for_the_same_shape() -> None:
    v = dict(attention_variants(PRESETS["llama-3-8b"], MemoryRequest(seq_len=8192, kv_dtype="bf16")))
    assert v["MHA (32 KV heads)"] == 4 * GIB and v["GQA (8 KV heads)"] == GIB and v["MQA (1 KV head)"] == GIB // 8
    assert v["MLA (512 + 64 latent)"] == 32 * 576 * 2 * 8192
    ds = dict(attention_variants(PRESETS["deepseek-v2"], MemoryRequest(seq_len=1, kv_dtype="fp16")))
    assert ds["MHA (128 KV heads)"] // 2 == 2 * 128 * 128 * 60  # the DeepSeek-V2 paper's MHA row
    assert ds["MLA (512 + 64 latent)"] // 2 == 34_560


def test_result_dict_has_the_cli_contract_keys() -> None:
    d = calculate(PRESETS["gpt2"], MemoryRequest(seq_len=100)).to_dict()
    assert {"kv_bytes_per_token", "kv_bytes", "weights_bytes", "warnings"} <= set(d)
    json.dumps(d)


# ----------------------------------------------------------------------------- properties
@st.composite
def specs(draw: st.DrawFn) -> ModelSpec:
    kv_heads = draw(st.integers(1, 8))
    group = draw(st.integers(1, 8))
    heads = kv_heads * group
    layers = draw(st.integers(1, 40))
    hd = draw(st.integers(1, 256))
    win = draw(st.none() | st.integers(1, 5000))
    pattern = draw(st.sampled_from(["none", "all", "even", "chunked", "linear"]))
    kinds: tuple[Layer, ...] = ()
    if win is not None and pattern == "all":
        kinds = (Layer("sliding", win),) * layers
    elif win is not None and pattern == "even":
        kinds = tuple(Layer("sliding", win) if i % 2 == 0 else FULL for i in range(layers))
    elif win is not None and pattern == "chunked":  # Llama 4: three chunked layers, then a full one
        kinds = tuple(FULL if (i + 1) % 4 == 0 else Layer("chunked", win) for i in range(layers))
    elif pattern == "linear":  # Qwen3-Next: three linear layers (no KV), then a full one
        kinds = tuple(FULL if (i + 1) % 4 == 0 else Layer("linear") for i in range(layers))
    return ModelSpec("prop", "test", layers, heads, kv_heads, hd, heads * hd, layers=kinds)


FAST = settings(max_examples=60, deadline=None)


@FAST
@given(specs(), st.integers(1, 20_000), st.integers(1, 64), st.sampled_from(["fp16", "int4", "fp8"]), st.booleans())
def test_linear_in_batch(spec: ModelSpec, t: int, b: int, dtype: str, paged: bool) -> None:
    fmt = KVFormat(dtype)
    block = 16 if paged else None
    assert kv_bytes(spec, fmt, t, b, True, block) == b * kv_bytes(spec, fmt, t, 1, True, block)


@FAST
@given(specs(), st.integers(1, 20_000), st.integers(1, 20_000))
def test_linear_in_seq_without_windows_and_sublinear_with(spec: ModelSpec, t1: int, t2: int) -> None:
    fmt = KVFormat("bf16")
    assert kv_bytes(spec, fmt, t1, 1, False) == t1 * kv_bytes(spec, fmt, 1, 1, False)
    lo, hi = sorted((t1, t2))
    assert kv_bytes(spec, fmt, lo) <= kv_bytes(spec, fmt, hi) <= hi * kv_bytes(spec, fmt, 1)
    if all(w is None or w >= hi for w in spec.windows):
        assert kv_bytes(spec, fmt, hi) == hi * kv_bytes(spec, fmt, 1)  # linear until a window is reached


@FAST
@given(specs(), st.integers(1, 50_000), st.sampled_from(["fp32", "fp16", "int8", "int4"]))
def test_mqa_le_gqa_le_mha_and_windows_never_add(spec: ModelSpec, t: int, dtype: str) -> None:
    fmt = KVFormat(dtype)
    mqa = kv_bytes(replace(spec, n_kv_heads=1), fmt, t)
    gqa = kv_bytes(spec, fmt, t)
    mha = kv_bytes(replace(spec, n_kv_heads=spec.n_heads), fmt, t)
    assert mqa <= gqa <= mha
    assert kv_bytes(spec, fmt, t, use_windows=True) <= kv_bytes(spec, fmt, t, use_windows=False)


@FAST
@given(specs(), st.integers(1, 50_000), st.sampled_from([32, 64, 128]))
def test_dtype_ordering(spec: ModelSpec, t: int, group: int) -> None:
    # With a 2-byte scale per group, int8 beats fp16 only once a vector holds a few values: a
    # 1-wide head would cost 1 + 2 bytes. Every real head_dim is 64 or more.
    assume(spec.head_dim >= 8)
    size = {d: kv_bytes(spec, KVFormat(d, group_size=group), t) for d in ("fp32", "fp16", "bf16", "fp8", "int8", "int4")}
    assert size["fp32"] >= size["fp16"] == size["bf16"] >= size["int8"] >= size["fp8"]
    assert size["int8"] >= size["fp8"] >= size["int4"]
    assert size["fp32"] == 2 * size["fp16"] == 4 * size["fp8"]


@FAST
@given(specs(), st.integers(1, 10_000), st.integers(1, 8), st.integers(1, 4096))
def test_paging_waste_is_under_one_block_per_layer(spec: ModelSpec, t: int, seqs: int, block: int) -> None:
    fmt = KVFormat("fp16")
    paged, plain = kv_bytes(spec, fmt, t, seqs, True, block), kv_bytes(spec, fmt, t, seqs)
    assert plain <= paged < plain + seqs * spec.n_layers * block * layer_token_bytes(spec, fmt) + 1


@FAST
@given(specs(), st.integers(1, 10**10), st.integers(1, 4), st.booleans())
def test_max_seq_len_is_the_largest_that_fits(spec: ModelSpec, budget: int, seqs: int, paged: bool) -> None:
    fmt = KVFormat("fp16")
    block = 16 if paged else None
    t = max_seq_len_for(spec, fmt, budget, seqs, True, block)
    if t is None:
        assert kv_bytes(spec, fmt, 1 << 40, seqs, True, block) <= budget
    else:
        assert t == 0 or kv_bytes(spec, fmt, t, seqs, True, block) <= budget
        assert kv_bytes(spec, fmt, t + 1, seqs, True, block) > budget


# ----------------------------------------------------------------------------- kvviz's own models
torch = pytest.importorskip("torch")


def _builtin() -> dict[str, ModelSpec]:
    from kvviz.cli.memory_cli import all_presets

    return all_presets()


def test_builtin_entries_come_from_random_shapes() -> None:
    from kvviz.engine.loading.loader import RANDOM_SHAPES

    specs_ = _builtin()
    for name, cfg in RANDOM_SHAPES.items():
        s = specs_[f"kvviz:random:{name}"]
        assert (s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim, s.max_positions) == (
            cfg.n_layer, cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.block_size)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_calculator_equals_static_cache_bytes_allocated(dtype: str) -> None:
    from kvviz.engine.kvcache.dense import StaticKVCache
    from kvviz.engine.loading.loader import DTYPES, RANDOM_SHAPES, config_from_json, read_config, SHAKESPEARE_DIR

    configs = dict(RANDOM_SHAPES)
    if (SHAKESPEARE_DIR / "config.json").is_file():  # the shipped model, once it has been trained
        configs["shakespeare"] = config_from_json(read_config(SHAKESPEARE_DIR))[0]
    specs_ = _builtin()
    for name, cfg in configs.items():
        spec = specs_[f"kvviz:random:{name}" if name != "shakespeare" else "kvviz:shakespeare"]
        for batch in (1, 3):
            # meta tensors report exact nbytes without allocating the (up to 600 MB) buffers
            device = "cpu" if cfg.n_embd * cfg.n_layer <= 1024 else "meta"
            cache = StaticKVCache(cfg, batch, device=device, dtype=DTYPES[dtype])
            res = calculate(spec, MemoryRequest(seq_len=cfg.block_size, batch=batch, kv_dtype=dtype))
            assert res.kv_bytes == cache.bytes_allocated, (name, batch)
            assert res.kv_bytes_per_token * batch == cache.bytes_per_token


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_live_panel_measures_smollm2_from_its_own_gguf_file(dtype: str) -> None:
    """The calculator page's live panel for the smollm2-135m preset: the engine's caches built from
    the installed GGUF file's metadata hold exactly the preset's bytes (30 layers x 3 K/V heads x 64
    x 2 (K and V) x 4 bytes = 46,080 bytes per token in fp32)."""
    from kvviz.engine.loading.llama_loader import smollm2_path
    from kvviz.errors import KVVizError
    from kvviz.ui.pages.calculator.calculator_measured import measure_caches

    try:
        smollm2_path()
    except KVVizError:
        pytest.skip("SmolLM2 is not installed")
    spec = load_presets()["smollm2-135m"]
    got = measure_caches("smollm2-135m", dtype, 2, 1000)
    assert got is not None and [m.kind for m in got] == ["static", "concat"]
    static, concat = got
    per_token = 30 * 3 * 64 * 2 * (4 if dtype == "fp32" else 2)
    assert (static.tokens, concat.tokens) == (8192, 1000)
    assert static.bytes_allocated == 2 * 8192 * per_token and concat.bytes_allocated == 2 * 1000 * per_token
    for m in got:
        res = calculate(spec, MemoryRequest(seq_len=m.tokens, batch=2, kv_dtype=dtype))
        assert res.kv_bytes == m.bytes_allocated
    assert measure_caches("llama-3-8b", dtype, 1, 10) is None  # a model kvviz does not run


def test_builtin_param_count_equals_the_model() -> None:
    from kvviz.engine.loading.loader import RANDOM_SHAPES
    from kvviz.engine.models.gpt2 import GPT

    specs_ = _builtin()
    for name, cfg in RANDOM_SHAPES.items():
        if cfg.n_embd * cfg.n_layer <= 1024:  # small enough to build on the CPU in milliseconds
            assert specs_[f"kvviz:random:{name}"].params == GPT(cfg).num_params(), name
    # The GPT-2 shapes are GPT-2 itself (tied head, same layout): the published counts.
    assert specs_["kvviz:random:gpt2-small"].params == PUBLISHED_PARAMS["gpt2"]
    assert specs_["kvviz:random:gpt2-medium"].params == PUBLISHED_PARAMS["gpt2-medium"]


def test_report_uses_units_fmt_bytes_in_both_units() -> None:
    from kvviz.calculator import summary_text

    text = summary_text(calculate(PRESETS["llama-3-8b"], MemoryRequest(seq_len=8192, kv_dtype="bf16")))
    assert "KV per token:  131,072 B (128.0 KiB)" in text  # the calculator's format, now from kvviz.units
    assert "KV total:      1.00 GiB (1.07 GB)" in text  # binary first, as on every page
    small = summary_text(calculate(PRESETS["gpt2"], MemoryRequest(seq_len=10)))
    assert "KV total:      368,640 B (360.0 KiB)" in small
