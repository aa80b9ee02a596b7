"""KV caches: contents, positions and exact byte accounting (by hand, and against real tensors)."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

import kvviz
from kvviz.engine.kvcache.dense import ConcatKVCache, StaticKVCache
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.kvcache.paged_cache import PagedKVCache
from kvviz.units import kv_bytes_per_token
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.models.gpt2_config import GPTConfig
from kvviz import CacheSpec

DTYPES = {"fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2), "fp16": (torch.float16, 2)}
CFGS = {
    "mha": GPTConfig(vocab_size=256, block_size=48, n_layer=3, n_head=4, n_embd=32),
    "gqa": GPTConfig(vocab_size=256, block_size=48, n_layer=3, n_head=4, n_kv_head=2, n_embd=32),
    "mqa": GPTConfig(vocab_size=256, block_size=48, n_layer=3, n_head=4, n_kv_head=1, n_embd=32),
}


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", list(CFGS))
@pytest.mark.parametrize("batch", [1, 3])
def test_static_bytes_allocated_is_real_and_matches_formula(dtype_name: str, shape: str, batch: int) -> None:
    dtype, itemsize = DTYPES[dtype_name]
    cfg = CFGS[shape]
    cache = StaticKVCache(cfg, batch=batch, dtype=dtype)
    real = sum(t.untyped_storage().nbytes() for t in cache.k + cache.v)
    # 2 (K and V) * L * B * n_kv * block * head_dim * itemsize
    by_hand = 2 * cfg.n_layer * batch * cfg.kv_heads * cfg.block_size * cfg.head_dim * itemsize
    assert cache.bytes_allocated == real == by_hand
    assert cache.bytes_used == 0
    per_token = 2 * cfg.n_layer * cfg.kv_heads * cfg.head_dim * itemsize * batch
    assert kv_bytes_per_token(cfg.n_layer, cfg.kv_heads, cfg.head_dim, dtype.itemsize, batch) == per_token
    cache.advance(5)
    assert cache.bytes_used == 5 * per_token
    assert cache.bytes_allocated == by_hand  # preallocated: never grows


def test_static_update_writes_at_pos_and_returns_the_prefix() -> None:
    cfg = CFGS["gqa"]
    cache = StaticKVCache(cfg, batch=2)
    k1, v1 = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    k_all, v_all = cache.update(1, k1, v1)
    assert k_all.shape == (2, 2, 5, 8)
    assert cache.pos == 0  # update never advances
    cache.advance(5)
    k2, v2 = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    k_all, v_all = cache.update(1, k2, v2)
    assert torch.equal(k_all, torch.cat([k1, k2], 2)) and torch.equal(v_all, torch.cat([v1, v2], 2))
    cache.advance(1)
    lk, lv = cache.layer(1)
    assert torch.equal(lk, torch.cat([k1, k2], 2)) and torch.equal(lv, torch.cat([v1, v2], 2))
    assert cache.layer(0)[0].shape == (2, 2, 6, 8)
    assert cache.bytes_copied == (k1.nbytes + v1.nbytes) + (k2.nbytes + v2.nbytes)
    cache.reset()
    assert cache.pos == 0 and cache.bytes_copied == 0 and cache.layer(1)[0].shape[2] == 0
    # Buffers are not cleared (reads stop at pos): a reused cache returns only the new tokens.
    k3, v3 = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    k_all, v_all = cache.update(1, k3, v3)
    assert torch.equal(k_all, k3) and torch.equal(v_all, v3)
    assert cache.bytes_copied == k3.nbytes + v3.nbytes


@pytest.mark.parametrize("cls", [StaticKVCache, ConcatKVCache])
def test_advance_past_block_size_raises(cls: type) -> None:
    cache = cls(CFGS["mha"])
    cache.advance(48)
    with pytest.raises(ValueError, match="overflow"):
        cache.advance(1)


def test_concat_cache_grows_and_copies_quadratically() -> None:
    cfg = CFGS["mqa"]
    cache = ConcatKVCache(cfg, batch=1)
    per_token = kv_bytes_per_token(cfg.n_layer, cfg.kv_heads, cfg.head_dim, 4)  # 2 * 3 * 1 * 8 * 4 = 192
    assert per_token == 192
    assert cache.bytes_allocated == 0
    copied = 0
    ks = []
    for n in (4, 1, 1, 1, 1):
        k = torch.randn(1, 1, n, 8)
        ks.append(k)
        for layer in range(cfg.n_layer):
            cache.update(layer, k, k.clone())
        cache.advance(n)
        copied += cache.pos * per_token  # every step re-copies the whole history
        assert cache.bytes_allocated == cache.bytes_used == cache.pos * per_token
        assert cache.bytes_copied == copied
    # 4 + 5 + 6 + 7 + 8 tokens copied in total
    assert cache.bytes_copied == (4 + 5 + 6 + 7 + 8) * 192
    assert torch.equal(cache.layer(2)[0], torch.cat(ks, 2))


def test_make_cache_kinds() -> None:
    assert isinstance(make_cache("static", CFGS["mha"], 1, "cpu", torch.float32), StaticKVCache)
    assert isinstance(make_cache("concat", CFGS["mha"], 1, "cpu", torch.float32), ConcatKVCache)
    assert isinstance(make_cache("paged", CFGS["mha"], 1, "cpu", torch.float32), PagedKVCache)
    with pytest.raises(ValueError, match="unknown cache kind"):
        make_cache("ring", CFGS["mha"], 1, "cpu", torch.float32)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("kv", [4, 1])
def test_generation_events_report_exact_cache_bytes(make_model: Callable[..., LoadedModel],
                                                     dtype_name: str, kv: int) -> None:
    dtype, itemsize = DTYPES[dtype_name]
    m = make_model(dtype=dtype, n_kv_head=kv)
    c = m.config
    per_token = 2 * c.n_layer * c.kv_heads * c.head_dim * itemsize  # bytes one token adds
    N, new = 6, 9
    run = kvviz.generate(m, prompt=list(range(65, 65 + N)), max_new_tokens=new)
    used = [e.cache_bytes_used for e in run.events]
    assert used[0] == N * per_token
    assert [b - a for a, b in zip(used, used[1:])] == [per_token] * (new - 1)
    allocated = 2 * c.n_layer * 1 * c.kv_heads * c.block_size * c.head_dim * itemsize
    assert {e.cache_bytes_allocated for e in run.events} == {allocated}
    assert [e.cache_len for e in run.events] == list(range(N, N + new))
    # Static cache writes each token once: bytes copied grow linearly.
    assert [e.cache_bytes_copied for e in run.events] == [(N + s) * per_token for s in range(new)]


def test_generation_concat_cache_bytes(small_model: LoadedModel) -> None:
    c = small_model.config
    per_token = 2 * c.n_layer * c.kv_heads * c.head_dim * 4  # 2 * 2 * 4 * 8 * 4 = 512
    assert per_token == 512
    N, new = 5, 8
    run = kvviz.generate(small_model, prompt=[1] * N, max_new_tokens=new, cache=CacheSpec(kind="concat"))
    for s, e in enumerate(run.events):
        assert e.cache_bytes_used == e.cache_bytes_allocated == (N + s) * per_token
        # Prefill copies N tokens; decode step j re-copies all N + j cached tokens.
        assert e.cache_bytes_copied == per_token * (N + sum(N + j for j in range(1, s + 1)))
    assert run.events[-1].cache_bytes_copied == 512 * (5 + 6 + 7 + 8 + 9 + 10 + 11 + 12)


def test_uncached_run_reports_no_cache(small_model: LoadedModel) -> None:
    run = kvviz.generate(small_model, prompt=[1, 2, 3], max_new_tokens=4, cache=CacheSpec(use_cache=False))
    assert run.cache_kind == "none"
    assert all(e.cache_len == e.cache_bytes_used == e.cache_bytes_allocated == e.cache_bytes_copied == 0
               for e in run.events)


@pytest.mark.parametrize("kind", ["static", "concat"])
def test_truncate_equals_a_cache_that_never_saw_the_rest(kind: str) -> None:
    cfg = GPTConfig(vocab_size=16, block_size=12, n_layer=2, n_head=4, n_kv_head=2, n_embd=16)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 9, 4, generator=g)
    v = torch.randn(1, 2, 9, 4, generator=g)
    full, short = make_cache(kind, cfg, 1, "cpu", torch.float32), make_cache(kind, cfg, 1, "cpu", torch.float32)
    for i in range(2):
        full.update(i, k, v)
        short.update(i, k[:, :, :5], v[:, :, :5])
    full.advance(9)
    short.advance(5)
    full.truncate(5)
    assert full.pos == 5 and full.bytes_used == short.bytes_used
    for i in range(2):
        assert all(torch.equal(a, b) for a, b in zip(full.layer(i), short.layer(i)))
    if kind == "static":  # the forgotten slots are cleared, not left holding rolled-back keys
        assert torch.count_nonzero(full.k[0][:, :, 5:9]) == 0
    with pytest.raises(ValueError, match="cannot truncate a cache of 5 positions to 6"):
        full.truncate(6)


@pytest.mark.parametrize("kind", ["static", "concat"])
def test_reorder_picks_parent_rows_and_counts_the_bytes(kind: str) -> None:
    cfg = GPTConfig(vocab_size=16, block_size=12, n_layer=2, n_head=4, n_kv_head=2, n_embd=16)
    cache = make_cache(kind, cfg, 2, "cpu", torch.float32)
    k = torch.arange(2 * 2 * 3 * 4, dtype=torch.float32).reshape(2, 2, 3, 4)
    for i in range(2):
        cache.update(i, k, -k)
    cache.advance(3)
    moved = cache.reorder(torch.tensor([1, 1, 0]))  # fan two rows out to three beams
    # 3 rows x 2 layers x (K+V) x 2 kv heads x 3 positions x 4 dims x 4 bytes, by hand:
    assert moved == 3 * 2 * 2 * 2 * 3 * 4 * 4 == 1152
    assert cache.batch == 3 and cache.bytes_used == 1152
    kk, vv = cache.layer(1)
    assert torch.equal(kk, k[[1, 1, 0]]) and torch.equal(vv, -k[[1, 1, 0]])
    cache.reorder(torch.tensor([2, 0, 0]))  # same batch: in place, rows may repeat
    assert torch.equal(cache.layer(0)[0], k[[0, 1, 1]])
    with pytest.raises(ValueError, match="pick rows in 0..2"):
        cache.reorder(torch.tensor([3]))
