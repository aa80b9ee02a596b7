"""Run-time window caches (StreamingLLM's sinks + a ring of W) on Gemma 3, on the tiny random model
of test_gemma3_tiny.py (3 layers: two sliding with their own window of 5, RoPE base 1e4, one global,
base 1e6; block_size 64).

The references: the full cache where the window holds the whole sequence; transformers'
Gemma3ForCausalLM on the same tensors given a hand-built 4-D mask per layer kind (keys kept by the
window cache, intersected on the sliding layers with their own window) where the keys keep their
positions; a fresh forward at the shifted positions for the sinks StreamingLLM renumbers.
"""
from __future__ import annotations

import pytest
import torch

import kvviz
from kvviz.engine.generation.capture import ForwardCapture
from kvviz.engine.generation.request import kv_spec
from kvviz.engine.kvcache.compressed_caches import WindowKVCache, layer_thetas
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.generation.kv_spec import position_rules
from kvviz.engine.models.gemma3 import inv_freq, layer_inputs
from kvviz.measure.kvcompare import compare
from test_gemma3_tiny import tiny
from kvviz import CacheSpec
from keyword_sets import request_kwargs

PROMPT = list(range(40, 52))
SW = 5  # the tiny model's own sliding window


def _through(m: kvviz.LoadedModel, ids: torch.Tensor, spec, forward, chunk: int = 4) -> torch.Tensor:
    """Logits (1, N, V) of ``ids`` teacher-forced through a window cache: chunks while it has room,
    then one token per forward (``max_feed``), as kvcompare feeds it."""
    cache = make_cache("static", m.config, 1, "cpu", torch.float32, kv=spec)
    assert isinstance(cache, WindowKVCache)
    out, a, N = [], 0, ids.shape[1]
    with torch.inference_mode():
        while a < N:
            n = min(chunk, cache.max_feed(), N - a)
            out.append(forward(ids[:, a:a + n], torch.arange(a, a + n), cache, None))
            cache.advance(n)
            a += n
    return torch.cat(out, 1)


def test_window_at_least_the_sequence_equals_the_full_cache() -> None:
    m = tiny()
    full = kvviz.generate(m, prompt=PROMPT, max_new_tokens=20, cache=CacheSpec(kind="concat"))  # 32 positions
    for opts in (dict(window=40), dict(window=32), dict(window=28, sinks=4),
                 dict(window=30, sinks=2, kv_positions="original")):
        run = kvviz.generate(m, **request_kwargs(prompt_ids=PROMPT, max_new_tokens=20, **opts))
        assert run.generated_ids == full.generated_ids, opts
        for a, b in zip(full.events, run.events):
            assert [t.prob for t in a.top] == pytest.approx([t.prob for t in b.top], abs=1e-6)
        assert run.events[-1].cache_len == 31  # the last sampled token is never fed


@pytest.mark.parametrize("sinks,window", [(0, 3), (0, 8), (1, 4), (2, 3), (2, 8)])
def test_original_positions_equal_transformers_with_the_window_as_a_mask(sinks: int, window: int) -> None:
    """positions="original": every query sees the sinks and its last W keys at their own positions,
    the sliding layers only those within their own window of 5, so one full-sequence forward of
    transformers' Gemma 3 with that mask gives every position's logits. S + W <= 5 and > 5 both."""
    pytest.importorskip("transformers")
    from kvviz.measure.bench_gemma3 import hf_gemma3

    m = tiny()
    hf = hf_gemma3(m)
    N = 24
    ids = torch.randint(0, 256, (1, N), generator=torch.Generator().manual_seed(4))
    p, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    kept = (j <= p) & ((j < sinks) | (j > p - window))  # (N, N): what the window cache holds for query p
    masks = {"full_attention": kept[None, None], "sliding_attention": (kept & (j > p - SW))[None, None]}
    with torch.inference_mode():
        want = hf(ids, attention_mask=masks).logits  # (1, N, V)
        assert not torch.allclose(want, hf(ids).logits, atol=1e-3)  # the window changes what is seen
    spec = kv_spec(m, window=window, sinks=sinks, positions="original")
    for forward in (m.model, m.fast.forward):
        torch.testing.assert_close(_through(m, ids, spec, forward), want, atol=2e-5, rtol=1e-5)


def test_streaming_sinks_rotate_by_each_layers_own_base() -> None:
    """positions="cache": the sink keys the cache hands back equal the keys a fresh forward of the two
    sink tokens computes at positions E, E + 1 (RoPE is relative, so their hidden states are the
    same), on the sliding layers (base 1e4) and the global one (base 1e6) alike."""
    m = tiny()
    c = m.config
    assert layer_thetas(c) == [1e4, 1e4, 1e6]
    ids = PROMPT * 2
    cache = make_cache("static", c, 1, "cpu", torch.float32, kv=kv_spec(m, window=6, sinks=2))
    every = frozenset(range(c.n_layer))
    with torch.inference_mode():
        for p, t in enumerate(ids):
            fc = ForwardCapture(every)
            m.model(torch.tensor([[t]]), torch.tensor([p]), cache, fc)
            cache.advance(1)
        e = cache.evicted
        assert e == len(ids) - 8
        ref = ForwardCapture(every)
        m.model(torch.tensor([ids[:2]]), torch.tensor([e, e + 1]), None, ref)
        for i in range(c.n_layer):
            torch.testing.assert_close(fc.k[i][:, :, :2], ref.k[i], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(cache.store.read(i, 2)[0], ref.k[i], atol=1e-3)  # stored at 0, 1
        # rotated by the global base, a sliding layer's sinks would be elsewhere
        wrong = cache._rotate(cache.store.read(0, 2)[0], e, inv_freq(c.rope_theta, c.head_dim).double())
        assert not torch.allclose(wrong, ref.k[0], atol=1e-3)


@pytest.mark.parametrize("positions", ["cache", "original"])
@pytest.mark.parametrize("sinks,window", [(0, 3), (2, 3), (1, 8)])
def test_ring_keeps_the_sinks_and_the_last_w_and_names_their_positions(positions: str, sinks: int,
                                                                       window: int) -> None:
    m = tiny()
    c = m.config
    spec = kv_spec(m, window=window, sinks=sinks, positions=positions)
    cache = WindowKVCache(c, spec)
    cache.inv_freq = [None] * c.n_layer  # keep the values readable: row p holds p (no rotation)
    for p in range(23):
        named = cache.ring_positions(SW, 1)
        k = torch.full((1, c.kv_heads, 1, c.head_dim), float(p))  # row p carries its position
        ks, vs = cache.update(0, k, -k)
        held = ks[0, 0, :, 0].tolist()
        kept = list(range(min(p + 1, sinks))) + list(range(max(sinks, p + 1 - window), p + 1))
        assert sorted(held) == kept and (vs == -ks).all()  # exactly the sinks and the last W
        if p + 1 <= sinks + window:
            assert named is None  # nothing evicted: slot = position, the model's usual masks
        else:
            shift = p + 1 - sinks - window if positions == "cache" else 0
            assert named.tolist() == [h + (shift if s < sinks else 0) for s, h in enumerate(held)]
        cache.advance(1)


def test_sliding_layers_mask_the_held_rows_outside_their_own_window() -> None:
    m = tiny()
    c = m.config
    pos = torch.tensor([15])
    for sinks, window, positions, want in [
        # slot order: the sinks, then the ring (position q in slot S + (q - S) % W: 10..15, then 8, 9)
        (2, 8, "cache", [k > 10 for k in [6, 7, 10, 11, 12, 13, 14, 15, 8, 9]]),  # S+W > 5: the ring's oldest too
        (2, 8, "original", [k > 10 for k in [0, 1, 10, 11, 12, 13, 14, 15, 8, 9]]),
        (1, 4, "cache", None),  # S + W <= 5 renumbered: the window cache is the tighter rule
        (1, 4, "original", [False, True, True, True, True]),  # the sink at 0 is 15 positions back
    ]:
        cache = WindowKVCache(c, kv_spec(m, window=window, sinks=sinks, positions=positions))
        cache.pos = 15  # the masks read only the position
        full, local = layer_inputs(c, 1, 15, pos, cache, torch.float32)
        assert full[:2] == (None, False)  # the global layer sees every held row
        if want is None:
            assert local[:2] == (None, False)
        else:
            assert local[0] is not None and local[0][0].tolist() == want


@pytest.mark.parametrize("opts", [dict(window=6, sinks=2), dict(window=6, sinks=2, kv_positions="original"),
                                  dict(window=4), dict(kv_dtype="int4", window=8, sinks=2)])
def test_both_engines_give_the_same_tokens_through_a_window(opts: dict) -> None:
    m = tiny()
    fast = kvviz.generate(m, **request_kwargs(prompt_ids=PROMPT, max_new_tokens=20, **opts))
    slow = kvviz.generate(m, **request_kwargs(prompt_ids=PROMPT, max_new_tokens=20, fast=False, **opts))
    assert fast.engine == "fast" and slow.engine == "readable"
    assert fast.generated_ids == slow.generated_ids
    for a, b in zip(fast.events, slow.events):
        assert [t.prob for t in a.top] == pytest.approx([t.prob for t in b.top], abs=1e-4)
    held = opts.get("sinks", 0) + opts["window"]
    assert [e.cache_len for e in fast.events] == [held] * 20  # the 12-token prompt already overflows
    assert len({e.cache_bytes_used for e in fast.events}) == 1


def test_the_compression_labs_window_comparison_runs_on_gemma3() -> None:
    m = tiny()
    assert position_rules("gemma3") == ["cache", "original"] and position_rules("gpt2") == ["original"]
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    spec = kv_spec(m, window=8, sinks=2)
    got = compare(m, ids, spec, chunk=8).summary()
    assert got["kv"] == "window 8 + 2 sinks" and got["tokens_scored"] == 29
    assert got["cache_bytes"] == 10 * make_cache("static", m.config, 1, "cpu", torch.float32, kv=spec).bytes_per_token
    assert got["max_logit_kl"] > 1e-4  # the window changes the predictions once it evicts
    # a window that holds all 30 gives the full cache's predictions (to float rounding: the
    # reference cache is the static one, whose sliding layers keep rings)
    whole = compare(m, ids, kv_spec(m, window=40), chunk=8).summary()
    assert whole["max_logit_kl"] < 1e-6 and whole["top1_agreement"] == 1.0
