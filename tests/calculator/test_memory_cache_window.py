"""The calculator's run-time cache window (S sinks + the last W positions on every KV layer):
figures by hand, equality with kvviz's own windowed caches, the CLI flags and the page."""
from __future__ import annotations

import json

import pytest
from streamlit.testing.v1 import AppTest

from kvviz.cli.main import main
from kvviz.calculator import (
    MemoryRequest, calculate, cache_window_problems, find_preset, load_presets, with_cache_window,
)
from kvviz.calculator.compressed import CacheShape, Compression, cache_bytes

LLAMA3 = find_preset("llama-3-8b", load_presets())  # 32 layers, 8 KV heads, head_dim 128, 8,192 positions
PER_TOKEN_BF16 = 2 * 32 * 8 * 128 * 2  # K and V, every layer: 131,072 bytes


def test_window_caps_every_layer_by_hand() -> None:
    spec = with_cache_window(LLAMA3, 1020, 4)
    for t, held in ((100, 100), (1024, 1024), (1025, 1024), (8192, 1024)):
        res = calculate(spec, MemoryRequest(seq_len=t, kv_dtype="bf16"))
        assert res.kv_bytes == held * PER_TOKEN_BF16
        assert [(g.kind, g.span, g.count, g.tokens_held) for g in res.layers] == [("sliding", 1024, 32, held)]
    assert spec.window_summary() == "32 layers x (1,020 + 4 sinks)"
    assert spec.layers[0].label() == "sliding (window 1,020 + 4 sinks)"
    assert "cache window 1,020 + 4 sinks" in spec.notes[-1]
    # the fit is unbounded in context: every layer stops growing
    fit = calculate(spec, MemoryRequest(seq_len=8192, kv_dtype="bf16", gpu_gib=80)).fit
    assert fit is not None and fit.max_seq_len is None


def test_window_with_int4_and_paging() -> None:
    # int4 packs 64 bytes per head vector + one fp16 scale per group of 64 values (2 groups): 68 bytes
    spec = with_cache_window(LLAMA3, 500, 0)
    res = calculate(spec, MemoryRequest(seq_len=4000, kv_dtype="int4", group_size=64, paged=True, block_size=16))
    assert res.kv_bytes == 2 * 32 * 8 * 68 * 512  # 500 rounded up to 32 blocks of 16


def test_model_windows_shorter_than_the_cache_window_are_kept() -> None:
    gemma = find_preset("gemma-3-4b", load_presets())
    own = {layer.span for layer in gemma.layers if layer.caps}
    assert own == {1024}
    spec = with_cache_window(gemma, 4096, 4)  # the global layers are capped, the 1,024-token windows stay
    kinds = {(layer.kind, layer.span, layer.sinks) for layer in spec.layers}
    assert kinds == {("sliding", 1024, 0), ("sliding", 4100, 4)}
    narrow = with_cache_window(gemma, 100, 0)  # a window narrower than the model's own replaces it
    assert {(layer.span) for layer in narrow.layers} == {100}


def test_equals_kvviz_windowed_cache_formula() -> None:
    # calculator/compressed.py counts kvviz's live WindowKVCache (tests/engine/test_kvcompress.py holds it to the
    # cache step by step); the calculator's window must give the same bytes at every length
    shape = CacheShape(n_layer=32, n_kv_heads=8, head_dim=128, elem_bytes=2)
    spec = with_cache_window(LLAMA3, 64, 4)
    for t in (1, 60, 68, 69, 500):
        calc = calculate(spec, MemoryRequest(seq_len=t, kv_dtype="bf16")).kv_bytes
        assert calc == cache_bytes(shape, Compression(window=64, sinks=4), t)
        calc8 = calculate(spec, MemoryRequest(seq_len=t, kv_dtype="int8", group_size=128)).kv_bytes
        assert calc8 == cache_bytes(shape, Compression("int8", None, window=64, sinks=4), t)


@pytest.mark.parametrize("window,sinks,words", [
    (0, 0, "positive number of positions"),
    (64, 64, "must be fewer than the window"),
    (64, -1, "sinks must be 0..1024"),
    (10_000, 4, "larger than the model's context of 8,192"),
])
def test_bad_windows_are_sentences(window: int, sinks: int, words: str) -> None:
    assert any(words in p for p in cache_window_problems(LLAMA3, window, sinks))


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["memory", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_window_flags(capsys: pytest.CaptureFixture[str]) -> None:
    d = _json(capsys, "--preset", "llama-3-8b", "--seq-len", "8192", "--dtype", "bf16", "--window", "1020",
              "--sinks", "4")
    assert d["kv_bytes"] == 1024 * PER_TOKEN_BF16
    assert d["cache_window"] == {"window": 1020, "sinks": 4, "positions_held": 1024}
    assert _json(capsys, "--preset", "llama-3-8b", "--seq-len", "8192")["cache_window"] is None


@pytest.mark.parametrize("argv,words", [
    (["--sinks", "4"], "--sinks needs --window"),
    (["--window", "64", "--no-windows"], "contradict"),
    (["--window", "64", "--sinks", "64"], "must be fewer than the window"),
    (["--window", "9000"], "larger than the model's context"),
])
def test_cli_window_errors(capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    with pytest.raises(SystemExit) as e:
        main(["memory", "--preset", "llama-3-8b", "--seq-len", "8192", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def _page() -> None:
    from kvviz.ui.pages.calculator import calculator

    calculator.page()


def test_page_window_and_its_message() -> None:
    at = AppTest.from_function(_page, default_timeout=60)
    at.run()
    assert not at.exception
    before = next(m for m in at.metric if m.label.startswith("KV cache")).value
    at.checkbox(key="mem_cache_window").check().run()
    at.number_input(key="mem_window").set_value(1020).run()
    assert not at.exception and not at.error
    after = next(m for m in at.metric if m.label.startswith("KV cache")).value
    assert before != after and after.startswith("128.00 MiB")  # 1,024 positions x 131,072 bytes
    assert any(r"cache window 1\,020 \+ 4 sinks" in c.value for c in at.caption)  # Markdown-escaped
    at.number_input(key="mem_sinks").set_value(1020).run()
    assert not at.exception
    assert any("must be fewer than the window" in e.value for e in at.error)
    assert at.number_input(key="mem_sinks").value == 1020  # the input stays as typed
