"""Compressed KV caches on the real SmolLM2-135M (the session's one `smollm2` fixture), kept short.

Measured on this machine (docs/benchmarks.md): int8 KV (one fp16 scale per head vector) gives
the same greedy text as the fp32 cache for all 128 tokens of this prompt; int4 leaves it at the
third token. The test pins 64 tokens of int8 agreement.
"""
from __future__ import annotations

from kvviz.engine.generation.loop import generate
from kvviz.memory.compressed import CacheShape, Compression, cache_bytes

PROMPT = "Once upon a time, there was a little"
INT8_AGREES_FOR = 64


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_int8_kv_agrees_with_fp32_greedy(smollm2) -> None:
    full = generate(smollm2, prompt=PROMPT, max_new_tokens=INT8_AGREES_FOR)
    int8 = generate(smollm2, prompt=PROMPT, max_new_tokens=INT8_AGREES_FOR, kv_dtype="int8")
    assert len(full.generated_ids) == INT8_AGREES_FOR  # no early EOS: every token is compared
    assert int8.generated_ids == full.generated_ids
    int4 = generate(smollm2, prompt=PROMPT, max_new_tokens=16, kv_dtype="int4")
    d = _first_difference(full.generated_ids, int4.generated_ids)
    assert d is not None and d < 16  # int4 does change the text (measured: at token 2)
    # int8: 64 bytes + one fp16 scale per head vector, vs fp32's 256
    assert int8.events[-1].cache_bytes_used * 256 == full.events[-1].cache_bytes_used * 66


def test_streaming_window_runs_past_the_window(smollm2) -> None:
    sinks, window = 4, 16
    full = generate(smollm2, prompt=PROMPT, max_new_tokens=24)
    run = generate(smollm2, prompt=PROMPT, max_new_tokens=24, window=window, sinks=sinks)
    assert run.cache_kind == "window 16 + 4 sinks"  # StreamingLLM's positions within the cache: the default
    n = len(run.prompt_ids)
    c = smollm2.config
    shape = CacheShape(c.n_layer, c.kv_heads, c.head_dim, 4)
    comp = Compression(window=window, sinks=sinks)
    for e in run.events:
        assert e.cache_len == min(n + e.step, sinks + window)
        assert e.cache_bytes_used == cache_bytes(shape, comp, n + e.step)
    # until the first eviction the window is the full cache, token for token
    before = sinks + window - n + 1
    assert run.generated_ids[:before] == full.generated_ids[:before]
