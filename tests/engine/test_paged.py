"""The paged KV cache: the block pool by hand, and paged == static token for token."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from kvviz.engine.core.step import run_step
from kvviz.engine.kvcache.block_pool import ROOT_HASH, BlockPool, PoolFull, block_hash
from kvviz.engine.api import generate
from kvviz.engine.loading.loader import LoadedModel
from kvviz.engine.kvcache.paged_cache import PagedKVCache, PagedPool
from kvviz.engine.sessions.parallel_samples import ParallelSamples
from kvviz.errors import KVVizError
from kvviz.calculator import KVFormat, ModelSpec, kv_bytes
from kvviz import CacheSpec, SamplingParams
from keyword_sets import request_kwargs


# ----------------------------------------------------------------------------- the pool, by hand
def test_pool_ref_counts_free_list_and_lru_by_hand() -> None:
    p = BlockPool(num_blocks=3, block_size=4)
    a, b, c = p.allocate(), p.allocate(), p.allocate()
    assert (a, b, c) == (0, 1, 2) and p.ref_count == [1, 1, 1] and not p.free
    p.ref(a)  # a second table shares block 0
    assert p.ref_count[a] == 2 and p.shared == [0] and p.needs_copy(a)
    p.register(b, b"h1")  # block 1 is full: findable, immutable
    assert p.needs_copy(b) and p.lookup(b"h1") == b
    p.unref(b)  # ref 0 but hashed: cached (evictable), not free
    assert p.state(b) == "cached" and p.cached == [b] and list(p.free) == []
    p.unref(c)  # unhashed: straight to the free list
    assert p.state(c) == "free" and list(p.free) == [c]
    assert p.allocate() == c  # the free list first
    p.ref(b)  # a prefix hit takes the cached block back
    assert p.ref_count[b] == 1 and p.cached == []
    p.unref(b)
    assert p.allocate() == b and p.evictions == 1 and p.lookup(b"h1") is None  # LRU evicted, hash forgotten
    with pytest.raises(PoolFull, match="all 3 blocks"):
        p.allocate()
    p.check()


def test_pool_refuses_bad_moves() -> None:
    p = BlockPool(2, 4)
    with pytest.raises(ValueError, match="free"):
        p.ref(0)  # a free block cannot be referenced
    with pytest.raises(ValueError, match="no references"):
        p.unref(1)
    with pytest.raises(KVVizError, match="at least one block"):
        BlockPool(0, 16)


def test_lru_evicts_oldest_released_first() -> None:
    p = BlockPool(3, 2)
    bl = [p.allocate() for _ in range(3)]
    for i, b in enumerate(bl):
        p.register(b, bytes([i]))
    for b in (2, 0, 1):  # released in this order
        p.unref(b)
    assert p.cached == [2, 0, 1]
    assert [p.allocate() for _ in range(3)] == [2, 0, 1]
    p.check()


def test_equal_prefixes_hash_equal_and_chain_the_parent() -> None:
    h1 = block_hash(ROOT_HASH, [1, 2, 3, 4])
    assert h1 == block_hash(ROOT_HASH, [1, 2, 3, 4]) and len(h1) == 16
    assert block_hash(h1, [5, 6, 7, 8]) != block_hash(ROOT_HASH, [5, 6, 7, 8])  # same tokens, other prefix
    assert block_hash(ROOT_HASH, [1, 2, 3, 5]) != h1


def _cfg(model: LoadedModel) -> Any:
    return model.config


def _fill(cache: PagedKVCache, ids: list[int], seed: int = 0) -> None:
    """Write len(ids) random K/V positions, telling the cache their ids."""
    c = cache.config
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(cache.batch, c.kv_heads, len(ids), c.head_dim, generator=g)
    with torch.inference_mode():
        cache.plan_step(torch.tensor([ids] * cache.batch))
        for i in range(c.n_layer):
            cache.update(i, k, -k)
        cache.advance(len(ids))


def test_equal_prefixes_find_the_same_blocks(make_llama: Callable[..., LoadedModel]) -> None:
    cfg = make_llama().config
    a = PagedKVCache(cfg, block_size=4, num_blocks=16)
    _fill(a, list(range(10)))  # blocks 0..3, 4..7 full (hashed), 8..9 partial
    b = PagedKVCache(cfg, pool=a.pool)  # a second sequence on the same pool
    assert b.match_prefix(list(range(12))) == a.tables[0][:2]
    assert b.match_prefix([0, 1, 2, 3, 9, 9, 9, 9]) == a.tables[0][:1]  # stops at the first miss
    assert b.match_prefix([1, 2, 3, 4]) == []
    b.adopt_prefix(list(range(12)), b.match_prefix(list(range(12))))
    assert b.pos == 8 and a.pool.blocks.ref_count[a.tables[0][0]] == 2
    ka, _ = a.layer(1)
    kb, _ = b.layer(1)
    assert torch.equal(ka[:, :, :8], kb)
    st = b.stats()
    assert st.blocks_shared == 2 and st.prefix_hits == 2
    a.pool.blocks.check()


def test_reorder_shares_and_copy_on_write_by_hand(make_llama: Callable[..., LoadedModel]) -> None:
    cfg = make_llama().config
    cache = PagedKVCache(cfg, block_size=4, num_blocks=12)
    _fill(cache, [5, 6, 7, 8, 9, 10])  # one full block + a partial one of 2
    full, part = cache.tables[0]
    before = cache.layer(0)[0].clone()
    assert cache.reorder(torch.tensor([0, 0, 0])) == 0  # nothing moves
    bp = cache.pool.blocks
    assert bp.ref_count[full] == 3 and bp.ref_count[part] == 3
    st = cache.stats()
    assert (st.blocks_used, st.blocks_shared, st.cow_copies) == (2, 2, 0)
    assert st.bytes_saved_by_sharing == 4 * st.block_bytes  # 6 table entries, 2 blocks held
    _fill(cache, [11], seed=1)  # every row writes into the shared partial block: copy-on-write
    # The first two writers copy; the last one finds ref 1 and writes in place.
    assert bp.cow_copies == 2 and bp.ref_count[full] == 3 and bp.ref_count[part] == 1
    assert [t[0] for t in cache.tables] == [full] * 3 and len({t[1] for t in cache.tables}) == 3
    k = cache.layer(0)[0]
    for r in range(3):
        assert torch.equal(k[r, :, :6], before[0])  # the copied slots carry the prompt
    assert cache.bytes_copied >= 2 * cache.pool.block_bytes
    st = cache.stats()
    assert st.blocks_used == 4 and st.fragmentation_bytes == 3 * 1 * cache.pool.slot_bytes
    cache.truncate(4)  # back to the shared full block: the partial copies are freed
    assert bp.ref_count[full] == 3 and cache.stats().blocks_used == 1
    cache.reset()
    assert bp.ref_count[full] == 0 and bp.state(full) == "cached"  # hashed: kept for a prefix hit
    bp.check()


def test_blocks_a_failed_step_claimed_go_back_to_the_pool(make_llama: Callable[..., LoadedModel]) -> None:
    """A forward that claims blocks and then fails (an error in a later layer) never advances the
    cache; the next, shorter step must return the extra blocks, not drop them with ref count 1."""
    cfg = make_llama().config
    cache = PagedKVCache(cfg, block_size=4, num_blocks=8)
    _fill(cache, [5, 6, 7])  # one partial block
    free_before = len(cache.pool.blocks.free)
    k = torch.randn(1, cfg.kv_heads, 9, cfg.head_dim)
    with torch.inference_mode():
        cache.plan_step(torch.tensor([list(range(9))]))  # blocks for 3 + 9 = 12 positions
        cache.update(0, k, k)  # layer 0 writes, then the forward "fails" and nobody aborts
    assert len(cache.tables[0]) == 3 and len(cache.pool.blocks.free) == free_before - 2
    _fill(cache, [8])  # the next step needs the one block it had
    assert cache.tables[0] == cache.tables[0][:1] and cache.stats().blocks_used == 1
    assert len(cache.pool.blocks.free) == free_before  # both claimed blocks are free again
    cache.pool.blocks.check()


def test_a_write_whose_step_was_not_planned_is_refused(make_llama: Callable[..., LoadedModel]) -> None:
    """The plan is mandatory (as vLLM's scheduler allocates before the model runs): a layer that
    writes with no plan, or more positions than the plan claimed, raises and claims no block. The
    cache used to plan at layer 0 itself, so a forward run around the step driver went through."""
    m = make_llama()
    cfg = m.config
    cache = PagedKVCache(cfg, block_size=4, num_blocks=8)
    _fill(cache, [5, 6, 7])  # one partial block, committed
    tables, refs = [list(t) for t in cache.tables], list(cache.pool.blocks.ref_count)
    k = torch.randn(1, cfg.kv_heads, 2, cfg.head_dim)
    with torch.inference_mode():
        for layer in (0, cfg.n_layer - 1):
            with pytest.raises(RuntimeError, match=r"layer \d+ writes 2 positions at 3, but the step planned nothing"):
                cache.update(layer, k, k)
        with pytest.raises(RuntimeError, match="planned nothing"):  # the readable model run directly
            m.model(torch.tensor([[1, 2]]), torch.tensor([3, 4]), cache)
        assert cache.tables == tables and cache.pool.blocks.ref_count == refs and cache.pos == 3
        cache.plan_step(torch.tensor([[1]]))  # one position planned, two written
        with pytest.raises(RuntimeError, match=r"planned \(3, 1\)"):
            cache.update(0, k, k)
        cache.abort_step()
    assert cache.tables == tables and cache.pool.blocks.ref_count == refs
    cache.pool.blocks.check()


def test_write_into_a_hashed_block_copies_it(make_llama: Callable[..., LoadedModel]) -> None:
    cfg = make_llama().config
    cache = PagedKVCache(cfg, block_size=4, num_blocks=8)
    _fill(cache, [1, 2, 3, 4, 5])
    b0 = cache.tables[0][0]
    cache.truncate(2)  # block 0 is full and hashed: immutable, so the next write copies it
    _fill(cache, [9], seed=2)
    assert cache.tables[0][0] != b0 and cache.pool.blocks.cow_copies == 1
    assert cache.pool.blocks.state(b0) == "cached"
    assert cache.match_prefix([1, 2, 3, 4]) == [b0]  # the old prefix is still findable


# ----------------------------------------------------------------------------- paged == static
@pytest.mark.parametrize("block", [1, 3, 16])
@pytest.mark.parametrize("fast", [True, False])
def test_paged_equals_static_greedy_and_sampled(make_llama: Callable[..., LoadedModel], block: int,
                                                fast: bool) -> None:
    m = make_llama()  # GQA: 4 query heads over 2 KV heads
    for kw in (dict(greedy=True), dict(temperature=1.0, seed=7)):
        ref = generate(m,
                       **request_kwargs(prompt="The cache holds", max_new_tokens=20, cache_kind="static", fast=fast, **kw))
        got = generate(m,
                       **request_kwargs(prompt="The cache holds", max_new_tokens=20, cache_kind="paged", kv_block_size=block, fast=fast, **kw))
        assert got.generated_ids == ref.generated_ids
        assert [e.cache_bytes_used for e in got.events] == [e.cache_bytes_used for e in ref.events]


def test_paged_batch_and_chunked_prefill_equal_static(make_llama: Callable[..., LoadedModel]) -> None:
    m = make_llama()
    ref = generate(m, prompt="Hi", max_new_tokens=12, batch_size=3, sampling=SamplingParams(temperature=0.9, seed=3),
                   cache=CacheSpec(kind="static"))
    got = generate(m, prompt="Hi", max_new_tokens=12, batch_size=3, sampling=SamplingParams(temperature=0.9, seed=3),
                   cache=CacheSpec(kind="paged", block_size=4))
    assert [e.token_ids for e in got.events] == [e.token_ids for e in ref.events]
    # Chunked prefill: 7 tokens, then 5 more at positions 7..11 (the explicit mask), then decode.
    c = m.config
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]])
    out, kv = {}, {}
    with torch.inference_mode():
        for kind in ("static", "paged"):
            from kvviz.engine.kvcache.factory import make_cache

            cache = make_cache(kind, c, 1, "cpu", torch.float32, block_size=3)
            pos = torch.arange(c.block_size)
            run_step(m, cache, ids[:, :7], pos[:7], backend="readable", hash_ids=False)
            out[kind] = run_step(m, cache, ids[:, 7:], pos[7:12], backend="readable", last_only=False, hash_ids=False)
            kv[kind] = cache.layer(1)
    assert torch.equal(out["static"], out["paged"])
    assert torch.equal(kv["static"][0], kv["paged"][0]) and torch.equal(kv["static"][1], kv["paged"][1])


def test_parallel_samples_share_the_prompt_and_equal_static(make_llama: Callable[..., LoadedModel]) -> None:
    m = make_llama()
    prompt = list(b"Once upon a ti")  # 14 tokens: 3 full blocks of 4 and a shared partial one
    paged = ParallelSamples(m, prompt, n=4, max_new_tokens=8, kv_block_size=4, seed=5, temperature=1.0).run()
    static = ParallelSamples(m, prompt, n=4, max_new_tokens=8, cache_kind="static", seed=5, temperature=1.0).run()
    assert paged.rows == static.rows and len({tuple(r) for r in paged.rows}) > 1
    assert paged.reorder_bytes == 0
    assert static.reorder_bytes == 14 * 4 * static.cache.bytes_per_token // 4  # 14 positions of 4 rows copied
    st = paged.cache.stats()  # type: ignore[union-attr]
    assert st.cow_copies == 3  # the partial block: 3 rows copy it, the last keeps it
    assert st.blocks_shared == 3  # the full prompt blocks stay shared by all 4
    # 4 rows x ceil(21 / 4) = 6 blocks each unshared; shared: 3 + 4 x 3 = 15 held.
    assert (st.bytes_unshared, st.bytes_held) == (24 * st.block_bytes, 15 * st.block_bytes)
    # And both equal the ordinary batched loop with the same seed (which prefills 4 identical rows).
    run = generate(m, prompt=prompt, max_new_tokens=8, batch_size=4, sampling=SamplingParams(temperature=1.0, seed=5))
    assert [list(r) for r in zip(*[e.token_ids for e in run.events])] == paged.rows


def test_pool_accounting_agrees_with_the_calculator(make_llama: Callable[..., LoadedModel]) -> None:
    """The calculator's --paged figure (tokens rounded up to whole blocks, per sequence) is exactly
    the bytes an unshared paged cache holds, and its waste is the internal fragmentation."""
    m = make_llama()
    c = m.config
    spec = ModelSpec(name="t", model_type="llama", n_layers=c.n_layer, n_heads=c.n_head, n_kv_heads=c.kv_heads,
                     head_dim=c.head_dim, hidden=c.n_embd)
    for block, n_tok, rows in ((16, 23, 1), (4, 9, 3), (5, 10, 2)):
        run_ids = list(range(1, n_tok + 1))
        cache = PagedKVCache(c, batch=rows, block_size=block)
        _fill(cache, run_ids)
        st = cache.stats()
        fmt = KVFormat("fp32")
        paged = kv_bytes(spec, fmt, n_tok, rows, True, block)
        unpaged = kv_bytes(spec, fmt, n_tok, rows, True, None)
        assert st.bytes_held == paged == st.bytes_unshared
        assert st.fragmentation_bytes == paged - unpaged
        assert st.bytes_filled == unpaged == cache.bytes_used


@pytest.mark.parametrize("n_tok, rows, block", [(100, 2, 16), (33, 1, 8)])
def test_smollm2_paged_cache_equals_memory_cli_paged(n_tok: int, rows: int, block: int,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m kvviz memory --preset smollm2-135m --paged` is what a paged cache of SmolLM2's own
    shape (from its GGUF header) holds: whole blocks per sequence; without --paged, what they fill."""
    import json

    import kvviz.cli.main as cli
    from kvviz.engine.loading.gguf_lite import read_gguf
    from kvviz.engine.loading.gguf_llama import config_from_metadata
    from kvviz.engine.loading.llama_loader import smollm2_path

    try:
        cfg = config_from_metadata(read_gguf(smollm2_path()))
    except KVVizError:
        pytest.skip("SmolLM2 is not installed")
    cache = PagedKVCache(cfg, batch=rows, block_size=block, num_blocks=rows * -(-n_tok // block))
    _fill(cache, list(range(1, n_tok + 1)))
    st = cache.stats()
    base = ["memory", "--preset", "smollm2-135m", "--seq-len", str(n_tok), "--batch", str(rows), "--dtype", "fp32",
            "--json"]
    assert cli.main([*base, "--paged", "--block-size", str(block)]) == 0
    paged = json.loads(capsys.readouterr().out)
    assert cli.main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert paged["kv_bytes"] == st.bytes_held == st.bytes_allocated  # a pool just big enough: every block held
    assert plain["kv_bytes"] == st.bytes_filled == cache.bytes_used
    assert paged["paging_waste_bytes"] == st.fragmentation_bytes


def test_bad_paged_requests_are_named(make_llama: Callable[..., LoadedModel]) -> None:
    m = make_llama()
    with pytest.raises(KVVizError, match="needs 2 blocks"):
        generate(m, prompt="abcdefghij", max_new_tokens=10, cache=CacheSpec(kind="paged", block_size=16, blocks=1))
    with pytest.raises(KVVizError, match="block size"):
        generate(m, prompt="a", max_new_tokens=1, cache=CacheSpec(kind="paged", block_size=0))
    with pytest.raises(KVVizError, match="cache_kind must be one of static, concat, paged"):
        generate(m, prompt="a", max_new_tokens=1, cache=CacheSpec(kind="pages"))
    # A pool that holds one sequence but not three unshared ones runs out mid-run, by name.
    with pytest.raises(KVVizError, match="KV pool is full"):
        generate(m, prompt="abcdefghij", max_new_tokens=10, batch_size=3,
                 cache=CacheSpec(kind="paged", block_size=4, blocks=6))


def test_cli_generate_paged_equals_static(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import kvviz.cli.main as cli

    out = {}
    for kind in ("static", "paged"):
        assert cli.main(["generate", "--model", "random:tiny-gqa", "--prompt", "abc", "--max-new-tokens", "6",
                         "--cache-kind", kind, "--block-size", "2", "--json"]) == 0
        out[kind] = json.loads(capsys.readouterr().out)
    assert out["static"]["generated_ids"] == out["paged"]["generated_ids"]
    assert [s["cache_bytes"] for s in out["static"]["steps"]] == [s["cache_bytes"] for s in out["paged"]["steps"]]


def test_pool_views_are_pure_figures(make_llama: Callable[..., LoadedModel]) -> None:
    from kvviz.charts import paged_charts as pc

    cache = PagedKVCache(make_llama().config, block_size=4, num_blocks=10)
    _fill(cache, [1, 2, 3, 4, 5, 6])
    cache.reorder(torch.tensor([0, 0]))
    _fill(cache, [7], seed=1)
    snap = cache.snapshot()
    grid = pc.pool_grid(snap, ["a", "b"])
    labels = {t.name for t in grid.data}
    assert {"shared", "a", "b", "free", "written this step"} <= labels
    shared = next(t for t in grid.data if t.name == "shared")
    assert list(shared.text) == [f"{cache.tables[0][0]}<br>×2"]  # the full prompt block, ref 2
    ring = next(t for t in grid.data if t.name == "written this step")
    assert sorted(ring.x) == sorted(b % pc.COLUMNS for _, b, _ in snap["new_slots"])
    # Position 6 of each row: slot 2 of its own (copied) second block, named on the ring and above.
    b0, b1 = cache.tables[0][1], cache.tables[1][1]
    assert sorted(ring.hovertext) == sorted(f"block {b}: this step wrote slot 2" for b in (b0, b1))
    assert f"block {min(b0, b1)} slot 2" in grid.layout.title.subtitle.text
    assert pc.written_slots([(0, 3, 0), (0, 3, 1), (0, 3, 2), (0, 5, 1), (0, 5, 3)]) == {
        3: "slots 0-2", 5: "slots 1, 3"}
    tables = pc.block_tables(snap, ["a", "b"])
    assert list(tables.data[0].text) == [str(b) for t in cache.tables for b in t]


def test_a_plan_the_pool_cannot_fill_aborts_cleanly(make_llama: Callable[..., LoadedModel]) -> None:
    """plan_step raising PoolFull halfway through claiming blocks, then abort_step (as a retry's
    reset/truncate/next plan calls it): the tables and ref counts are as before the plan. The claim
    used to be recorded before allocate(), so the abort indexed a block never appended (IndexError)."""
    cache = PagedKVCache(make_llama().config, block_size=4, num_blocks=3)
    _fill(cache, list(range(8)))  # blocks 0, 1 full; one block left
    tables, refs = [list(t) for t in cache.tables], list(cache.pool.blocks.ref_count)
    with pytest.raises(PoolFull):
        cache.plan_step(torch.tensor([list(range(8))]))  # needs 2 more blocks, gets 1
    cache.abort_step()
    assert cache.tables == tables and cache.pool.blocks.ref_count == refs
    cache.pool.blocks.check()
    _fill(cache, [8, 9, 10])  # and the cache goes on
    assert cache.pos == 11


def test_parallel_samples_on_a_full_shared_pool_say_so_and_give_every_block_back(
        make_llama: Callable[..., LoadedModel]) -> None:
    """Four samples of an 8-token prompt on a shared 3-block pool run out while fanning out. The
    run's rollback (reset -> abort_step) raised IndexError over the PoolFull and left ref counts
    [4, 4, 1] on blocks no table held."""
    m = make_llama()
    pool = PagedPool(m.config, num_blocks=3, block_size=4, device=m.device, dtype=m.dtype)
    with pytest.raises(PoolFull, match="KV pool is full"):
        ParallelSamples(m, list(range(1, 9)), n=4, max_new_tokens=8, kv_block_size=4, pool=pool).run()
    assert pool.blocks.ref_count == [0, 0, 0]
    pool.blocks.check()
