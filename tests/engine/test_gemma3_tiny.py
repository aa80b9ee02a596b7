"""Gemma 3's readable model on a tiny random config: the sliding window, the layer kinds and the
cache contract, checked without the real weights (the real model: test_gemma3_real.py)."""
from __future__ import annotations

import math

import pytest
import torch

import kvviz
from kvviz.engine.core.step import run_step
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.loaded import wrap_model
from kvviz.engine.models.attention import sliding_mask
from kvviz.engine.models.gemma3 import FULL, SLIDING, Gemma3, Gemma3Config, param_shapes
from kvviz.engine.tokenize.tokenizer import ByteTokenizer
from kvviz import CacheSpec
from keyword_sets import request_kwargs

# 3 layers, every 3rd global: two sliding layers with a window of 5, one global; MQA like 270M.
TINY = dict(vocab_size=256, block_size=64, context_length=64, n_layer=3, n_head=4, n_kv_head=1, n_embd=32,
            head_dim=16, intermediate_size=48, sliding_window=5, sliding_pattern=3, eos_token_id=None)


def tiny(seed: int = 0, **over: object) -> kvviz.LoadedModel:
    cfg = Gemma3Config(**{**TINY, **over})
    net = Gemma3(cfg)
    net.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # spread the logits so greedy never sits on a float-noise tie
        net.model.norm.weight.fill_(9.0)
        for p in net.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return wrap_model(net, ByteTokenizer(256), "tiny-gemma3", torch.device("cpu"), torch.float32, True, "tests")


def test_layer_kinds_follow_the_pattern() -> None:
    assert Gemma3Config().layer_types == tuple(FULL if i in (5, 11, 17) else SLIDING for i in range(18))
    assert Gemma3Config(**TINY).layer_types == (SLIDING, SLIDING, FULL)


def test_param_shapes_match_270m() -> None:
    shapes = param_shapes(Gemma3Config())
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (1024, 640)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (256, 640)
    assert shapes["model.layers.0.self_attn.k_norm.weight"] == (256,)
    # 268,098,176 parameters: Google's published count for gemma-3-270m (the head is tied).
    assert sum(math.prod(s) for s in shapes.values()) == 268_098_176


def test_sliding_mask_keeps_the_last_window() -> None:
    pos = torch.arange(3, 7)  # a chunk of 4 queries after 3 cached tokens, window 3
    mask, causal = sliding_mask(4, 3, pos, 3)
    assert not causal and mask is not None
    want = [[k <= p and k > p - 3 for k in range(7)] for p in range(3, 7)]
    assert mask.tolist() == want
    # Before the last query passes the window it is the plain causal mask.
    assert sliding_mask(4, 0, torch.arange(4), 5) == (None, True)


def test_sliding_layers_ignore_keys_outside_the_window() -> None:
    m = tiny()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        base = m.model(ids)[0, -1]
        # Changing a token 12 places back reaches the last position only through the global layer
        # and through chains of windows; with every layer sliding, it cannot (3 layers x 4 < 12).
        all_sliding = tiny(sliding_pattern=64)
        a = all_sliding.model(ids)[0, -1]
        ids2 = ids.clone()
        ids2[0, 19 - 13] = (ids2[0, 19 - 13] + 1) % 256
        assert torch.equal(all_sliding.model(ids2)[0, -1], a)
        assert not torch.allclose(m.model(ids2)[0, -1], base)  # the global layer sees it


@pytest.mark.parametrize("kind", ["static", "concat", "paged"])
def test_cached_decode_equals_one_forward_past_the_window(kind: str) -> None:
    """A prefill of 6 then 14 one-token steps through each cache kind give the logits of one
    uncached forward over all 20 tokens: the sliding layers' mask over the cache is exact."""
    m = tiny()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        whole = m.model(ids)  # (1, 20, V)
        cache = make_cache(kind, m.config, 1, "cpu", torch.float32)
        steps = [run_step(m, cache, ids[:, :6], torch.arange(6), backend="readable", last_only=False, hash_ids=False)]
        for t in range(6, 20):
            steps.append(run_step(m, cache, ids[:, t:t + 1], torch.tensor([t]), backend="readable", hash_ids=False))
    torch.testing.assert_close(torch.cat(steps, 1), whole, atol=1e-5, rtol=1e-5)


def test_generate_cached_equals_uncached() -> None:
    m = tiny(seed=1)
    kw = dict(prompt_ids=list(range(40, 52)), max_new_tokens=12, temperature=1.0, seed=7)
    assert kvviz.generate(m, **request_kwargs(**kw)).generated_ids == kvviz.generate(m,
                                                                                     **request_kwargs(use_cache=False, **kw)).generated_ids


def test_chunked_prefill_equals_one_forward() -> None:
    m = tiny()
    ids = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        whole = m.model(ids)
        cache = make_cache("static", m.config, 1, "cpu", torch.float32)
        parts = []
        for a, b in ((0, 6), (6, 13), (13, 17)):
            parts.append(m.model(ids[:, a:b], cache=cache))
            cache.advance(b - a)
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-5, rtol=1e-5)


def test_bad_config_refused() -> None:
    with pytest.raises(ValueError, match="n_kv_head"):
        Gemma3Config(**{**TINY, "n_kv_head": 3})
    with pytest.raises(ValueError, match="sliding_window"):
        Gemma3Config(**{**TINY, "sliding_window": 0})


def test_accelerator_without_codes_and_quantized_kv_run_a_window_past_the_context_refused() -> None:
    m = tiny()
    # A model built in memory has no GGUF codes: kvviz.fast's Gemma 3 runs its fp32 weights in C
    # where the kernel builds, else the readable model; int8 K/V gives the same tokens either way.
    assert type(m.fast).__name__ == "FastGemma3" and m.fast.codes == {}
    run = kvviz.generate(m, prompt=list(range(40, 52)), max_new_tokens=10, cache=CacheSpec(kv_dtype="int8"))
    slow = kvviz.generate(m, prompt=list(range(40, 52)), max_new_tokens=10, backend="readable",
                          cache=CacheSpec(kv_dtype="int8"))
    assert len(run.generated_ids) == 10 and run.generated_ids == slow.generated_ids
    # A run-time window runs (test_gemma3_window.py); one larger than the context is still refused.
    assert kvviz.generate(m, prompt=[1, 2, 3], max_new_tokens=2, cache=CacheSpec(window=8)).cache_kind == "window 8"
    with pytest.raises(kvviz.KVVizError, match="a window of 65 positions is larger than the model's context of 64"):
        kvviz.generate(m, prompt=[1, 2, 3], max_new_tokens=2, cache=CacheSpec(window=65))


# ----------------------------------------------------------------------------- per-layer cache kinds
def _feed(m: kvviz.LoadedModel, cache, ids: torch.Tensor, cuts: tuple[int, ...]) -> torch.Tensor:
    """Logits of ``ids`` fed through ``cache`` in chunks ending at each cut (then one token at a time),
    each chunk a step of the readable model through the step driver (no ids told: nothing hashed)."""
    out, a = [], cache.pos
    for b in (*cuts, *range(cuts[-1] + 1, ids.shape[1] + 1)) if cuts else range(a + 1, ids.shape[1] + 1):
        out.append(run_step(m, cache, ids[:, a:b], torch.arange(a, b), backend="readable", last_only=False,
                            hash_ids=False))
        a = b
    return torch.cat(out, 1)


def test_static_cache_keeps_a_ring_of_the_window_on_sliding_layers() -> None:
    m = tiny()
    cache = make_cache("static", m.config, 1, "cpu", torch.float32)
    # (B, nkv, rows, hs): 5 rows on the two sliding layers, block_size (64) on the global one
    assert [t.shape[2] for t in cache.k] == [5, 5, 64]
    assert cache.bytes_allocated == 2 * (5 + 5 + 64) * 16 * 4
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        whole = m.model(ids)
        # decode far past the window: 25 one-token steps after a 5-token prefill
        torch.testing.assert_close(_feed(m, cache, ids, (5,)), whole, atol=1e-5, rtol=1e-5)
    assert cache.layer(0)[0].shape[2] == 5 and cache.layer(2)[0].shape[2] == 30


@pytest.mark.parametrize("cuts", [(3, 7, 12, 20, 30), (4, 11, 30), (2, 3, 9, 10, 17), (13,)])
def test_ring_chunked_prefill_across_the_window_equals_one_forward(cuts: tuple[int, ...]) -> None:
    """Chunks that cross the window's edge, are longer than it (7, 8, 19 > 5) or start mid-ring."""
    m = tiny()
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        whole = m.model(ids)
        cache = make_cache("static", m.config, 1, "cpu", torch.float32)
        torch.testing.assert_close(_feed(m, cache, ids, cuts), whole, atol=1e-5, rtol=1e-5)


def test_ring_greedy_equals_uncached_past_the_window() -> None:
    m = tiny(seed=2)
    kw = dict(prompt_ids=list(range(60, 63)), max_new_tokens=40)
    cached = kvviz.generate(m, **request_kwargs(**kw))
    assert cached.generated_ids == kvviz.generate(m, **request_kwargs(use_cache=False, **kw)).generated_ids
    assert cached.cache_kind == "static"


def test_ring_checkpoint_restore_is_exact_and_truncate_refused_once_overwritten() -> None:
    m = tiny()
    ids = torch.randint(0, 256, (1, 26), generator=torch.Generator().manual_seed(10))
    with torch.inference_mode():
        cache = make_cache("static", m.config, 1, "cpu", torch.float32)
        _feed(m, cache, ids[:, :12], (12,))
        before = [t.clone() for t in (*cache.k, *cache.v)]
        cp = cache.checkpoint(10)
        _feed(m, cache, ids, (16,))  # a turn of 14 tokens rewrites every ring row
        cache.restore(cp)
        assert cache.pos == 12
        for t, b in zip((*cache.k, *cache.v), before):
            assert torch.equal(t[:, :, : min(12, t.shape[2])], b[:, :, : min(12, t.shape[2])])
        # the restored cache continues exactly as one that never saw the turn
        torch.testing.assert_close(_feed(m, cache, ids, (14,)), m.model(ids)[:, 12:], atol=1e-5, rtol=1e-5)
    assert not cache.can_truncate(20) and cache.can_truncate(26)
    with pytest.raises(ValueError, match="ring of their last 5 positions"):
        cache.truncate(20)
    assert cache.pos == 26  # refused before anything moved
    small = make_cache("static", m.config, 1, "cpu", torch.float32)
    with torch.inference_mode():
        _feed(m, small, ids[:, :4], (4,))
        small.truncate(2)  # inside the window nothing was overwritten: an ordinary rollback
        torch.testing.assert_close(_feed(m, small, ids[:, :9], (9,)), m.model(ids[:, :9])[:, 2:], atol=1e-5,
                                   rtol=1e-5)


def test_ring_reorder_moves_rows() -> None:
    m = tiny()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(11))
    with torch.inference_mode():
        cache = make_cache("static", m.config, 2, "cpu", torch.float32)
        _feed(m, cache, ids[:, :9], (9,))
        moved = cache.reorder(torch.tensor([1, 1, 0]))
        assert moved == 2 * 3 * 16 * 4 * (5 + 5 + 9)  # the rings' 5 rows, the global layer's 9, 3 new rows
        nxt = ids[[1, 1, 0], 9:]
        got = _feed(m, cache, torch.cat([ids[[1, 1, 0], :9], nxt], 1), (10,))
        torch.testing.assert_close(got, m.model(ids[[1, 1, 0]])[:, 9:], atol=1e-5, rtol=1e-5)
    assert cache.layer_bytes() == [2 * 3 * 16 * 4 * n for n in (5, 5, 12)]


def _calculator_layers(cfg: Gemma3Config, length: int, kv_dtype: str) -> list[int]:
    """The memory calculator's bytes per layer for this config at ``length`` tokens, through its
    public functions on the config as a Hugging Face config.json would state it."""
    from kvviz.calculator.formulas import layer_token_bytes, tokens_held
    from kvviz.calculator.hf_config import parse_config
    from kvviz.calculator.spec import MemoryRequest

    spec = parse_config({
        "model_type": "gemma3_text", "hidden_size": cfg.n_embd, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.n_head,
        "num_hidden_layers": cfg.n_layer, "num_key_value_heads": cfg.n_kv_head, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.context_length, "sliding_window": cfg.sliding_window,
        "layer_types": [f"{k}_attention" for k in cfg.layer_types]})
    req = MemoryRequest(seq_len=length, kv_dtype=kv_dtype)
    return [layer_token_bytes(spec, req.kv_format) * tokens_held(spec.layer(i), length)
            for i in range(cfg.n_layer)]


def test_live_layer_bytes_equal_the_calculator_at_every_step() -> None:
    m = tiny()
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(12))
    cache = make_cache("static", m.config, 1, "cpu", torch.float32)
    with torch.inference_mode():
        m.model(ids[:, :3], cache=cache)
        cache.advance(3)
        for t in range(3, 14):
            assert cache.layer_bytes() == _calculator_layers(m.config, cache.pos, "fp32"), cache.pos
            assert cache.bytes_used == sum(cache.layer_bytes())
            m.model(ids[:, t:t + 1], cache=cache)
            cache.advance(1)
    assert cache.layer_bytes() == [5 * 128, 5 * 128, 14 * 128]


@pytest.mark.parametrize("length", [100, 512, 513, 2000])
def test_real_gemma3_layer_bytes_equal_the_calculator(length: int) -> None:
    """The 270M's shapes (no weights): 15 sliding layers level off at 512 positions, 3 global grow.
    The cache is bf16, as the calculator's preset is counted in 16-bit floats."""
    from kvviz.calculator.presets import load_presets
    from kvviz.calculator.formulas import layer_token_bytes, tokens_held
    from kvviz.calculator.spec import MemoryRequest

    cfg = Gemma3Config(block_size=2048)
    cache = make_cache("static", cfg, 1, "cpu", torch.bfloat16)
    cache.advance(length)
    spec = load_presets()["gemma-3-270m"]
    fmt = MemoryRequest(seq_len=length, kv_dtype="bf16").kv_format
    preset = [layer_token_bytes(spec, fmt) * tokens_held(spec.layer(i), length) for i in range(18)]
    assert cache.layer_bytes() == preset == _calculator_layers(cfg, length, "bf16")
    row = 2 * 1 * 256 * 2  # K and V, one head of 256 bf16 numbers
    assert cache.layer_bytes()[0] == min(length, 512) * row and cache.layer_bytes()[5] == length * row


def test_chat_on_the_ring_answers_as_a_full_cache() -> None:
    """Turns, an edit and a regenerate past the window: the static cache's rings cannot roll back to
    the shared prefix, so each such turn starts again, and answers as the concat cache (every
    position kept) does, greedy, token for token."""
    from chat_fixtures import chat_model
    from kvviz.engine.sessions.conversation import Conversation

    m = chat_model(tiny(seed=3, block_size=256))
    got = {}
    for kind in ("static", "concat"):
        conv = Conversation(m, cache=CacheSpec(kind=kind), max_new_tokens=6)
        turns = [conv.send("hi there"), conv.send("and more"), conv.edit(0, "edited"), conv.regenerate()]
        got[kind] = [t.generated_ids for t in turns]
        if kind == "static":
            # the second turn appends to all the cache holds (no rollback); the edit and the regenerate
            # would roll back past rings that had slid, so they start again
            assert [t.reused_tokens for t in turns] == [0, turns[1].cached_before, 0, 0]
            assert turns[1].cached_before > 5
    assert got["static"] == got["concat"]


@pytest.mark.parametrize("kind", ["static", "concat"])
def test_every_step_event_carries_the_layer_bytes(kind: str) -> None:
    """The run's events: the static cache's per-layer bytes equal the calculator's at every step
    (sliding layers level off at the window); the concat cache holds every position on every layer."""
    from kvviz.ui.pages.generate.metrics import bytes_formula

    m = tiny(seed=1)
    run = kvviz.generate(m, prompt=list(range(40, 43)), max_new_tokens=10, cache=CacheSpec(kind=kind))
    for ev in run.events:
        want = (_calculator_layers(m.config, ev.position, "fp32") if kind == "static"
                else [ev.position * 128] * 3)
        assert list(ev.cache_layer_bytes) == want, ev.step
        assert sum(ev.cache_layer_bytes) == ev.cache_bytes_used
    text = bytes_formula(run)
    assert "⚠️" not in text and f"{run.events[-1].cache_bytes_used:,} B" in text
    if kind == "static":
        assert "(1 layer × 12 tokens + 2 layers × 5 tokens)" in text


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_store_layer_bytes_level_off_at_the_window(kv_dtype: str) -> None:
    """The quantized store keeps a ring of the window on each sliding layer: per layer, the held
    positions times one position's bytes (int8: 16 payload + one fp16 scale, K and V = 36 B; fp8:
    16 B each, K and V = 32 B) plus fp8's per-layer K and V scales (2 x 4 B), summing to bytes_used;
    int8's equal the calculator's at every step."""
    run = kvviz.generate(tiny(), prompt=list(range(40, 43)), max_new_tokens=8, cache=CacheSpec(kv_dtype=kv_dtype))
    per, fixed = (36, 0) if kv_dtype == "int8" else (32, 8)
    for ev in run.events:
        p = ev.position
        assert list(ev.cache_layer_bytes) == [min(p, 5) * per + fixed] * 2 + [p * per + fixed], ev.step
        assert sum(ev.cache_layer_bytes) == ev.cache_bytes_used
        if kv_dtype == "int8":
            assert list(ev.cache_layer_bytes) == _calculator_layers(tiny_config(), p, "int8")
    assert run.events[-1].cache_layer_bytes[:2] == (5 * per + fixed,) * 2  # levelled off (10 positions in)


def tiny_config() -> Gemma3Config:
    return Gemma3Config(**TINY)


def test_layer_strip_chart_colours_the_kinds_and_totals_them() -> None:
    from kvviz.charts.layer_charts import LAYER_COLORS, layer_strip

    m = tiny(seed=1)
    run = kvviz.generate(m, prompt=list(range(40, 43)), max_new_tokens=10)
    ev = run.events[-1]
    assert run.layer_kinds == ("sliding", "sliding", "full")
    fig = layer_strip(ev.cache_layer_bytes, run.layer_kinds, ev.position)
    bars = {t.name.split()[0]: t for t in fig.data}
    # The axis in KiB (the biggest layer holds 1,536 B), the exact bytes in the hover's customdata.
    assert fig.layout.yaxis.title.text == "held (KiB)"
    assert list(bars["sliding"].x) == [0, 1] and list(bars["sliding"].y) == [5 * 128 / 1024] * 2
    assert list(bars["sliding"].customdata) == [5 * 128, 5 * 128]
    assert list(bars["global"].x) == [2] and list(bars["global"].y) == [12 * 128 / 1024]
    assert list(bars["global"].customdata) == [12 * 128]
    assert bars["sliding"].marker.color == LAYER_COLORS["sliding"] != bars["global"].marker.color
    sub = fig.layout.title.subtitle.text
    assert sub == "after 12 tokens · 2 sliding: 1,280 B · 1 global: 1,536 B · total 2,816 B"
    assert "Generate" in layer_strip((), (), 0).layout.annotations[0].text  # nothing to draw: says why


def test_captures_over_the_ring_equal_a_full_cache_and_respect_the_window() -> None:
    """Attention, new-K/V norms and raw K/V captured through the static cache's rings equal the
    concat cache's and the uncached run's; a sliding layer's newest query gives no weight to keys
    before its window (the window is 5: 5 of 10 keys weighted)."""
    import numpy as np

    m = tiny(seed=1)
    cap = kvviz.Capture(attention=True, kv_norms=True, kv_layer=0)
    kw = dict(prompt_ids=list(range(40, 43)), max_new_tokens=8, capture=cap)
    runs = [kvviz.generate(m, **request_kwargs(cache_kind="static", **kw)), kvviz.generate(m,
                                                                                           **request_kwargs(cache_kind="concat", **kw))]
    runs.append(kvviz.generate(m, **request_kwargs(use_cache=False, **kw)))
    for evs in zip(*(r.events for r in runs)):
        for name in ("attn", "kv_norms", "kv_values"):
            ref = getattr(evs[0], name).astype(np.float32)
            for e in evs[1:]:
                if name != "attn" and e is evs[2] and e.step:
                    continue  # uncached steps capture the newest column only (kv_start moves)
                np.testing.assert_allclose(getattr(e, name).astype(np.float32), ref, atol=2e-3)
    last = runs[0].events[-1].attn.astype(np.float32)  # (3 layers, 4 heads, 10 keys)
    assert last.shape == (3, 4, 10)
    assert (last[:2, :, :5] == 0).all() and (last[:2, :, 5:] > 0).all() and (last[2] > 0).all()


def test_speculative_on_the_ring_refused_past_the_window_and_exact_elsewhere() -> None:
    m = tiny(seed=1)
    ids = [40, 41, 40, 41, 40, 41, 40]
    kw = dict(prompt_ids=ids, max_new_tokens=12, speculative="prompt_lookup", draft_tokens=3)
    with pytest.raises(kvviz.KVVizError, match="only the last 5 positions on its sliding layers"):
        kvviz.generate(m, **request_kwargs(**kw))
    want = kvviz.generate(m, prompt=ids, max_new_tokens=12).generated_ids
    assert kvviz.generate(m, **request_kwargs(cache_kind="concat", **kw)).generated_ids == want
    assert kvviz.generate(m, **request_kwargs(cache_kind="paged", **kw)).generated_ids == want


def test_json_export_carries_each_layers_bytes_and_kinds() -> None:
    """`--json` and the run's export name each layer's kind and bytes at every step: past the window
    the two sliding layers hold 5 positions, the global one all of them (128 B a position here:
    K and V x 1 head x 16 dims x 4 B), and the layers sum to the step's cache bytes."""
    import json

    run = kvviz.generate(tiny(seed=1), prompt=list(range(40, 43)), max_new_tokens=10)
    d = json.loads(run.to_json())
    assert d["config"]["layer_kinds"] == ["sliding", "sliding", "full"]
    last = d["steps"][-1]
    assert last["cache_layer_bytes"] == [5 * 128, 5 * 128, 12 * 128]
    assert all(sum(s["cache_layer_bytes"]) == s["cache_bytes"] for s in d["steps"])


def test_allocated_bytes_are_counted_per_layer_kind_never_averaged() -> None:
    """Before the window fills, every layer holds the same tokens, yet a sliding layer's ring has W
    slots and a global layer block_size: the formula names both (issue 36: Gemma 3 270M's formula
    multiplied by "1,792 slots", the average of 15 x 512 and 3 x 8,192 over 18 layers; here it was
    "24 slots", (5 + 5 + 64) / 3 rounded down)."""
    from kvviz.ui.pages.generate.metrics import bytes_formula

    m = tiny(seed=1)
    run = kvviz.generate(m, prompt=[40, 41], max_new_tokens=2)  # 3 positions held < W = 5
    ev = run.events[-1]
    assert len(set(ev.cache_layer_bytes)) == 1  # no layer has let go of anything yet
    assert ev.cache_bytes_allocated == (2 * 5 + 64) * 128  # 128 B per layer and slot (K and V, fp32)
    text = bytes_formula(run)
    assert ("per layer and slot × (2 sliding layers × 5 slots + 1 global layer × 64 slots) = "
            f"**{ev.cache_bytes_allocated:,} B**") in text
    assert " 24 slots" not in text and "⚠️" not in text
