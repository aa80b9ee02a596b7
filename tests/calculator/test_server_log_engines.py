"""server_log_engines: llama.cpp and SGLang log lines read (every format named in its docstring), odd text
never raising, and a differing figure named as differing with a reason. Hand-worked figures; the real
held-out logs are in test_calculator_server_heldout_logs.py."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvviz.calculator import CalcError, load_presets, parse_config
from kvviz.calculator.server_log_engines import (
    parse_llamacpp_log, parse_sglang_log, reconcile_llamacpp, reconcile_sglang,
)

LLAMA_8B = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "max_position_embeddings": 8192}


def test_pre_unified_llamacpp_line_with_its_n_ctx():
    """Builds before the unified cache: "n_ctx = 8192" and "KV self size = 1024.00 MiB, K (f16): 512.00 MiB, V
    (f16): 512.00 MiB": 32 layers x 8,192 x 8 x 128 x 2 B = 512 MiB each (hand-worked)."""
    log = parse_llamacpp_log("llama_new_context_with_model: n_ctx      = 8192\nllama_new_context_with_model: "
                             "KV self size  = 1024.00 MiB, K (f16):  512.00 MiB, V (f16):  512.00 MiB\n")
    assert log.n_ctx == 8192 and log.lines[0].cells is None
    rows, _ = reconcile_llamacpp(parse_config(LLAMA_8B), log)
    assert rows[0].agrees and rows[0].predicted.startswith("1024.00 MiB (8,192 cells, 32 layers)")


def test_llamacpp_sliding_cells_from_the_logged_ubatch_and_a_difference_explained():
    """gpt-oss-20b (the preset) at -c 131072 -ub 2048: pad(128 + 2,048, 256) = 2,304 sliding cells (54 MiB); the
    log's n_ubatch line is read. Without it kvviz uses 512 (768 cells), says so, and names the cell count."""
    spec = load_presets()["gpt-oss-20b"]
    lines = ("llama_context: n_ubatch      = 2048\n"
             "llama_kv_cache_iswa: creating non-SWA KV cache, size = 131072 cells\n"
             "llama_kv_cache: size = 3072.00 MiB (131072 cells,  12 layers,  1/1 seqs), K (f16): 1536.00 MiB, V (f16): 1536.00 MiB\n"
             "llama_kv_cache_iswa: creating     SWA KV cache, size = 2304 cells\n"
             "llama_kv_cache: size =   54.00 MiB (  2304 cells,  12 layers,  1/1 seqs), K (f16):   27.00 MiB, V (f16):   27.00 MiB\n")
    rows, _ = reconcile_llamacpp(spec, parse_llamacpp_log(lines))
    assert [r.agrees for r in rows] == [True, True] and [r.what for r in rows] == ["KV cache non-SWA", "KV cache SWA"]
    rows, notes = reconcile_llamacpp(spec, parse_llamacpp_log(lines.split("\n", 1)[1]))
    assert [r.agrees for r in rows] == [True, False] and "cell count" in rows[1].why
    assert any("default 512" in n for n in notes)


def test_sglang_without_memory_lines_compares_the_sizes_only():
    """#tokens 1,000 of Llama-3-8B in bf16: (1,000 + 1) x 8 x 128 x 32 x 2 B = 65,601,536 B = 0.06 GB each."""
    rows, notes = reconcile_sglang(parse_config(LLAMA_8B), parse_sglang_log(
        "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1000, K size: 0.06 GB, V size: 0.06 GB"))
    assert [r.what for r in rows] == ["K size / V size"] and rows[0].agrees and "only the sizes" in notes[0]
    rows, _ = reconcile_sglang(parse_config(LLAMA_8B), parse_sglang_log(
        "KV Cache is allocated. #tokens: 1000, K size: 0.12 GB, V size: 0.12 GB"))
    assert not rows[0].agrees and "differs" in rows[0].why


def test_no_kv_line_is_one_sentence():
    with pytest.raises(CalcError, match="no llama.cpp KV-cache line"):
        reconcile_llamacpp(parse_config(LLAMA_8B), parse_llamacpp_log("hello"))
    with pytest.raises(CalcError, match="no SGLang KV-cache line"):
        reconcile_sglang(parse_config(LLAMA_8B), parse_sglang_log("hello"))
    with pytest.raises(CalcError, match="cache type 'q9_9'"):
        reconcile_llamacpp(parse_config(LLAMA_8B), parse_llamacpp_log(
            "llama_kv_cache: size = 1.00 MiB (256 cells, 32 layers, 1/1 seqs), K (q9_9): 0.50 MiB, V (f16): 0.50 MiB"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=st.sampled_from(list("llama_kv_cache: size=MiB(cells,layers/seqs)K(f16)V 0123456789.\n"
                                             "KV Cache is allocated.#tokens avail mem=GB Load weight begin end")),
               max_size=400))
def test_odd_text_never_raises_when_read(text):
    parse_llamacpp_log(text)
    parse_sglang_log(text)
