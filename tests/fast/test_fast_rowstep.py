"""The whole one-row decode step in C (kvviz.fast.rowstep, csrc/rowstep.c) against the per-layer
path it replaces and the readable model: logits, cache contents and byte counts, captures, long
caches (heads shared among threads, scores on the heap), and the caches it must leave alone."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import kvviz.fast.rowstep
from kvviz.engine.kvcache.dense import ConcatKVCache, StaticKVCache
from kvviz.engine.generation.capture import ForwardCapture
from kvviz.engine.loading.loader import LoadedModel
from kvviz.fast import rowops
from kvviz.fast.rowstep import LlamaStep, step_for
from test_fast_llama import BASE, make_llama, reference, tokens

pytestmark = pytest.mark.skipif(rowops.load() is None, reason="needs the C row ops")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The slots the C step wrote, one per call."""
    seen: list[int] = []
    real = LlamaStep.__call__

    def spy(self: LlamaStep, x: torch.Tensor, pos: int, slot: int, *wants: bool) -> None:
        seen.append(slot)
        real(self, x, pos, slot, *wants)
    monkeypatch.setattr(LlamaStep, "__call__", spy)
    return seen


def per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn the C step off: fast/llama_flat.py's per-layer path (four C calls per layer, SDPA)."""
    monkeypatch.setattr(kvviz.fast.llama_flat, "step_for", lambda *a: None)


def decode(m: LoadedModel, idx: torch.Tensor, prefill: int, layers: frozenset[int] = frozenset(),
           wants: bool = False, kv_layer: int | None = None) -> tuple[torch.Tensor, StaticKVCache, list[ForwardCapture]]:
    """Prefill idx[:, :prefill], then one token at a time: logits (1, T, V), the cache, captures
    (``wants``: asking for attention weights and new K/V norms, which the C step hands over;
    ``kv_layer``: the layer whose raw K/V the capture records)."""
    T = idx.shape[1]
    cache = StaticKVCache(m.config, batch=1, dtype=m.dtype)
    caps = []
    with torch.inference_mode():
        out = [m.fast.forward(idx[:, :prefill], torch.arange(prefill), cache)]
        cache.advance(prefill)
        for t in range(prefill, T):
            fc = ForwardCapture(layers, want_attn=wants, want_norms=wants, kv_layer=kv_layer)
            out.append(m.fast.forward(idx[:, t:t + 1], torch.tensor([t]), cache, fc))
            cache.advance(1)
            caps.append(fc)
    return torch.cat(out, dim=1), cache, caps


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("kind", ["mha", "gqa", "mqa", "head_dim", "untied"])
def test_step_equals_the_per_layer_path_and_float64(kind: str, threads: int, calls: list[int],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    m = make_llama(kind, seed=21)
    idx = tokens(1, 20, seed=22)
    layers = frozenset(range(m.config.n_layer))
    got, cache, caps = decode(m, idx, 4, layers)
    assert calls == list(range(4, 20))  # every decode step went through C, at the cache's position
    torch.testing.assert_close(got.double(), reference(m, idx), atol=2e-5, rtol=1e-5)
    per_layer(monkeypatch)
    want, cache2, caps2 = decode(m, idx, 4, layers)
    assert calls == list(range(4, 20))  # no more calls into the C step
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert cache.bytes_copied == cache2.bytes_copied and cache.pos == cache2.pos == 20
    for i in layers:
        torch.testing.assert_close(cache.layer(i)[0], cache2.layer(i)[0], atol=1e-5, rtol=1e-5)  # post-RoPE K
        torch.testing.assert_close(cache.layer(i)[1], cache2.layer(i)[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(caps, caps2):  # captures: the same q, and the cache's own K/V up to the new position
        for i in layers:
            torch.testing.assert_close(a.q_last[i], b.q_last[i], atol=1e-5, rtol=1e-5)
            assert a.k[i].shape == b.k[i].shape and a.v[i].shape == b.v[i].shape
    # a capture's q is its own copy: the next step's query does not overwrite it
    assert not torch.equal(caps[0].q_last[0], caps[1].q_last[0])


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("kind", ["gqa", "untied"])
def test_bf16_step_equals_the_per_layer_path(kind: str, threads: int, calls: list[int],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 weights and a bf16 cache: K/V rounded to bf16 as Tensor.to rounds them (the cache
    contents equal the per-layer path's bit for bit), attention in fp32 over the widened values,
    logits in bf16 close to the per-layer path's, and as close to a float64 run of the same bf16
    weights as the per-layer path is."""
    m = make_llama(kind, seed=27, dtype=torch.bfloat16)
    idx = tokens(1, 16, seed=28)
    got, cache, _ = decode(m, idx, 4)
    assert calls == list(range(4, 16)) and got.dtype == torch.bfloat16 and cache.k[0].dtype == torch.bfloat16
    per_layer(monkeypatch)
    want, cache2, _ = decode(m, idx, 4)
    ref = reference(m, idx)  # the same bf16 weights in float64: both paths round K/V and logits alike
    err, err_per_layer = float((got.double() - ref).abs().max()), float((want.double() - ref).abs().max())
    assert err < 0.02 * float(ref.abs().max()) and err <= 1.25 * err_per_layer
    torch.testing.assert_close(got.float(), want.float(), atol=0.02 * float(want.abs().max()), rtol=0.0)
    assert cache.bytes_copied == cache2.bytes_copied
    # layer 0's K/V come from identical inputs, rounded alike: equal bit for bit
    assert torch.equal(cache.layer(0)[0], cache2.layer(0)[0]) and torch.equal(cache.layer(0)[1], cache2.layer(0)[1])
    for i in range(1, m.config.n_layer):
        torch.testing.assert_close(cache.layer(i)[0].float(), cache2.layer(i)[0].float(), atol=0.05, rtol=0.02)


def softmax_rows(fc: ForwardCapture, n_layer: int, group: int) -> torch.Tensor:
    """(n_layer, nh, S) float64: softmax(q k^T / sqrt(hs)) of the captured q over the captured keys,
    query head h reading K/V head h // group, as record() computes it without the C step."""
    rows = []
    for i in range(n_layer):
        q, k = fc.q_last[i][0, :, -1].double(), fc.k[i][0].double()  # (nh, hs), (nkv, S, hs)
        k = k.repeat_interleave(group, dim=0)  # (nh, S, hs)
        rows.append(torch.softmax((k @ q.unsqueeze(-1)).squeeze(-1) / q.shape[-1] ** 0.5, dim=-1))
    return torch.stack(rows)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("kind", ["mha", "gqa", "mqa", "head_dim"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_hands_over_attention_weights_and_new_kv_norms(kind: str, dtype: torch.dtype, threads: int,
                                                                calls: list[int]) -> None:
    """Asked for, C leaves each layer's attention row and the new K/V norms, which a capture reads
    instead of recomputing them: they equal softmax(q k^T) over the cache and the norms of the
    column just written (as stored, bf16-rounded in a bf16 cache), and the logits do not change."""
    m = make_llama(kind, seed=29, dtype=dtype)
    c = m.config
    idx = tokens(1, 12, seed=30)
    layers = frozenset(range(c.n_layer))
    plain, plain_cache, refs = decode(m, idx, 4, layers)
    unasked: Any = step_for(m.fast.plan().rows.step_ops, plain_cache, c)
    assert unasked.probs is None and unasked.norms is None  # a run without the request holds no buffers
    kv_layer = c.n_layer - 1
    got, cache, caps = decode(m, idx, 4, layers, wants=True, kv_layer=kv_layer)
    assert calls == list(range(4, 12)) * 2
    assert torch.equal(got, plain)  # writing the weights out changes nothing computed
    for j, (fc, ref) in enumerate(zip(caps, refs)):
        S = 5 + j  # positions attended: the prompt, the tokens so far, and this one
        assert fc.probs is not None and fc.probs.shape == (c.n_layer, c.n_head, S)
        # the reference: the same step's q and keys, as the run that asked for no weights captured them
        torch.testing.assert_close(fc.probs.double(), softmax_rows(ref, c.n_layer, c.n_head // c.kv_heads),
                                   atol=2e-6, rtol=1e-5)
        # with the weights and norms from C, only the raw K/V layer's references are taken
        assert not fc.q_last and set(fc.k) == set(fc.v) == {kv_layer}
        assert torch.equal(fc.k[kv_layer], cache.k[kv_layer][:, :, :S]) and torch.equal(fc.v[kv_layer], cache.v[kv_layer][:, :, :S])
        new = torch.stack([torch.stack([cache.k[i][0, :, S - 1], cache.v[i][0, :, S - 1]])
                           for i in range(c.n_layer)]).double().norm(dim=-1)  # (L, 2, nkv) of what is stored
        assert fc.new_norms is not None
        torch.testing.assert_close(fc.new_norms.double(), new, atol=1e-6, rtol=1e-5)
    assert plain is not got and all(fc.probs is None for fc in decode(m, idx, 4, layers)[2])  # only on request


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_a_long_cache_reads_every_position(threads: int, calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """2,100 cached positions: the heads are shared among the threads (S >= 256), and the
    8 heads x S scores no longer fit the stack (> 16,384 floats)."""
    monkeypatch.setitem(BASE, "block_size", 2112)
    m = make_llama("gqa", seed=23)
    idx = tokens(1, 2104, seed=24)
    got, _, _ = decode(m, idx, 2100)
    assert calls == [2100, 2101, 2102, 2103]
    per_layer(monkeypatch)
    want, _, _ = decode(m, idx, 2100)
    torch.testing.assert_close(got[:, -4:], want[:, -4:], atol=2e-5, rtol=1e-5)


def test_other_caches_keep_the_per_layer_path() -> None:
    m = make_llama("gqa", seed=25)
    ops = m.fast.plan().rows.step_ops
    c = m.config
    assert len(ops) == 4 * c.n_layer and step_for(ops, StaticKVCache(c), c) is not None
    assert step_for(ops, StaticKVCache(c, batch=2), c) is None
    assert step_for(ops, StaticKVCache(c, dtype=torch.bfloat16), c) is None  # fp32 weights, bf16 cache: mixed
    assert step_for(ops, ConcatKVCache(c), c) is None
    half = make_llama("gqa", dtype=torch.bfloat16)
    hops = half.fast.plan().rows.step_ops
    assert step_for(hops, StaticKVCache(c, dtype=torch.bfloat16), c) is not None  # bf16 weights, bf16 cache
    assert step_for(hops, StaticKVCache(c), c) is None

    class Counting(StaticKVCache):  # a subclass may override update(): never bypassed
        pass
    assert step_for(ops, Counting(c), c) is None


def test_a_reorder_to_a_new_batch_rebuilds_the_step() -> None:
    """Beam search may replace a static cache's buffers; the step must not write the old ones."""
    m = make_llama("gqa", seed=26)
    ops, c = m.fast.plan().rows.step_ops, m.config
    cache = StaticKVCache(c)
    first: Any = step_for(ops, cache, c)
    assert step_for(ops, cache, c) is first  # built once per cache
    cache.reorder(torch.tensor([0, 0]))  # fanned out to 2 rows: new buffers, batch 2
    assert step_for(ops, cache, c) is None
    cache.reorder(torch.tensor([1]))  # back to one row, in new buffers again
    again = step_for(ops, cache, c)
    assert again is not None and again is not first and again.buffers[0] is cache.k[0]


def test_the_step_writes_where_the_cache_says_and_the_cache_counts_it(calls: list[int]) -> None:
    """C writes only into the buffers the cache hands out (``step_buffers``) at the slot it names
    (``step_slots``, which counts the bytes as update does and notes the write for a restore): a
    step taken through run_step and never committed is undone by a restore like any update, and a
    cache whose ring would wrap hands out no buffers, so C never writes it."""
    from kvviz.engine.core.step import run_step

    m = make_llama("gqa", seed=31)
    c = m.config
    idx = tokens(1, 6, seed=32)
    cache = StaticKVCache(c)
    bufs = cache.step_buffers()
    assert bufs is not None and all(a is b for a, b in zip(bufs, (t for kv in zip(cache.k, cache.v) for t in kv)))
    with torch.inference_mode():
        run_step(m, cache, idx[:, :5], torch.arange(5))  # the prefill: per-layer updates
        before, k4 = cache.bytes_copied, cache.k[0][:, :, 4].clone()
        cp = cache.checkpoint(5)
        run_step(m, cache, idx[:, 5:], torch.tensor([5]), commit=False)  # C writes slot 5, not committed
    assert calls == [5] and cache.pos == 5
    # one position's K and V of every layer, as n_layer updates of (1, nkv, 1, hs) count them
    assert cache.bytes_copied - before == 2 * c.n_layer * c.kv_heads * c.head_dim * 4
    assert bool(cache.k[0][:, :, 5].ne(0).any())  # C wrote it
    cache.restore(cp)
    assert bool((cache.k[0][:, :, 5] == 0).all()) and bool((cache.v[-1][:, :, 5] == 0).all())  # as never written
    assert torch.equal(cache.k[0][:, :, 4], k4) and cache.bytes_copied == before
    ringed = StaticKVCache(c)
    ringed.windows = (4,) + ringed.windows[1:]  # a sliding first layer: a ring of 4 rows
    assert ringed.step_buffers() is not None  # positions 0..3 are its slots 0..3
    ringed.pos = 4  # position 4 would go to slot 0: slot != position, so only update writes it
    assert ringed.step_buffers() is None and step_for(m.fast.plan().rows.step_ops, ringed, c) is None
