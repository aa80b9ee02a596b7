"""Per-layer cache kinds in the paged cache and the quantized store (issue 30), on the tiny Gemma 3.

The tiny config (tests/engine/test_gemma3_tiny.py): 3 layers, two sliding with a window of 5, one
global; one K/V head of 16 fp32 numbers, so one position of one layer is 2 x 16 x 4 = 128 B and a
paged block of b tokens is 128 b B per layer. Every run here goes well past the window.
"""
from __future__ import annotations

import pytest
import torch

import kvviz
from kvviz.engine.core.step import run_step
from kvviz.engine.generation.request import kv_spec
from kvviz.engine.kvcache.compressed_caches import QuantizedKVCache
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.kvcache.paged_cache import PagedKVCache, PagedPool
from kvviz.engine.kvcache.paged_pool import layer_groups
from test_gemma3_tiny import _feed, tiny
from keyword_sets import request_kwargs
from kvviz import CacheSpec

W = 5  # the tiny config's window


def test_layer_groups_split_the_kinds_evenly() -> None:
    # Gemma 3 270M: 3 global layers (5, 11, 17) and 15 sliding -> six groups of 3, the global first.
    g = layer_groups([None if i in (5, 11, 17) else 512 for i in range(18)])
    assert g.size == 3 and g.count == 6 and g.windows == (None,) + (512,) * 5
    assert g.layers[0] == (5, 11, 17) and g.layers[1] == (0, 1, 2) and g.layers[2] == (3, 4, 6)
    assert g.group_of[11] == 0 and g.slot_of[11] == 1 and g.group_of[6] == 2 and g.slot_of[6] == 2
    # one kind: one group of every layer (the paged cache as before); an uneven split: a short group
    assert layer_groups([None] * 4).layers == ((0, 1, 2, 3),)
    assert layer_groups([None, None, 5, 5, 5]).layers == ((0, 1), (2, 3), (4,))


@pytest.mark.parametrize("bs", [1, 2, 3, 4])
@pytest.mark.parametrize("cuts", [(1,), (8,), (3, 12), (20,)])
def test_paged_equals_static_and_one_forward_past_the_window(bs: int, cuts: tuple[int, ...]) -> None:
    """Prefill (in chunks, some longer than the window) then decode to 30 tokens: the paged cache,
    whose sliding layers let blocks go, gives the static ring's logits and one forward's."""
    m = tiny()
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        whole = m.model(ids)
        paged = make_cache("paged", m.config, 1, "cpu", torch.float32, block_size=bs)
        got = _feed(m, paged, ids, cuts)
        ref = _feed(m, make_cache("static", m.config, 1, "cpu", torch.float32), ids, cuts)
    assert paged.freed[1:] == [(30 - W + 1) // bs] * 2 and paged.freed[0] == 0  # group 0: the global layer
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, whole, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def _hand_blocks(p: int, bs: int) -> tuple[int, int]:
    """(global, sliding) blocks after p positions: ceil(p / bs), and that minus the blocks wholly
    before the next query's window, floor(max(0, p - W + 1) / bs)."""
    full = -(-p // bs)
    return full, full - max(0, p - W + 1) // bs


@pytest.mark.parametrize("bs", [2, 16])
def test_paged_greedy_equals_static_and_events_carry_block_bytes(bs: int) -> None:
    m = tiny(seed=2)
    kw = dict(prompt_ids=list(range(60, 63)), max_new_tokens=40)
    static = kvviz.generate(m, **request_kwargs(**kw))
    paged = kvviz.generate(m, **request_kwargs(cache_kind="paged", kv_block_size=bs, **kw))
    assert paged.generated_ids == static.generated_ids
    for ev in paged.events:
        full, sliding = _hand_blocks(ev.position, bs)
        assert list(ev.cache_layer_bytes) == [sliding * 128 * bs] * 2 + [full * 128 * bs], ev.step
    # Hand-computed: block 2, after 42 positions: 21 global blocks; the sliding layers need
    # positions 38..41 of the next query's window, blocks 19 and 20: 2 blocks each.
    if bs == 2:
        assert paged.events[-1].position == 42 and paged.events[-1].cache_layer_bytes == (512, 512, 5376)
        from kvviz.ui.pages.generate.metrics import bytes_formula

        text = bytes_formula(paged)  # blocks per layer, and the positions they hold, with no warning
        assert "⚠️" not in text and "**Bytes held in blocks** = **6,400 B**" in text
        # the positions held: 42 on the global layer, 42 - 38 = 4 on each sliding one, 128 B each
        assert paged.events[-1].cache_bytes_used == (42 + 2 * 4) * 128


def test_pool_free_blocks_rise_as_blocks_slide_out() -> None:
    """Fed one token at a time with no ids (nothing hashed, so a let-go block goes straight back to
    the free list): every step, free = pool - (global + 2 sliding) blocks, by hand."""
    m = tiny()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(5))
    cache = PagedKVCache(m.config, 1, block_size=2, num_blocks=40)
    assert cache.groups.count == 3 and cache.pool.block_bytes == 256  # one layer per block here
    free = []
    with torch.inference_mode():
        for t in range(24):
            run_step(m, cache, ids[:, t:t + 1], torch.tensor([t]), backend="readable", hash_ids=False)
            full, sliding = _hand_blocks(t + 1, 2)
            st = cache.stats()
            assert st.blocks_used == full + 2 * sliding and st.blocks_free == 40 - full - 2 * sliding, t
            assert cache.layer_bytes() == [sliding * 256] * 2 + [full * 256]
            free.append(st.blocks_free)
            cache.pool.blocks.check()
    # 5 -> 6 positions: the global layer stays at 3 blocks, each sliding layer lets block 0 go
    assert free[5] == free[4] + 2
    assert free[-1] == 40 - 12 - 2 * 2  # 24 positions: 12 global blocks, 2 per sliding layer


def test_generate_lets_hashed_blocks_go_to_the_cache_and_a_later_request_reuses_them() -> None:
    """With ids told, a let-go sliding block is hashed: cached (evictable), not free. A second cache
    on the same pool matches the prompt's prefix (the global blocks all, the sliding ones only
    within the window) and continues exactly as a cache that computed it all."""
    m = tiny(seed=1)
    ids = torch.randint(0, 256, (1, 21), generator=torch.Generator().manual_seed(7))
    pool = PagedPool(m.config, 60, 4)
    a = PagedKVCache(m.config, 1, pool=pool)
    with torch.inference_mode():
        run_step(m, a, ids[:, :20], torch.arange(20), backend="readable")  # the ids told: hashed
    st = a.stats()
    # 20 positions, block 4: 5 global blocks; the sliding layers keep blocks 4 (16..19) only
    assert st.blocks_used == 5 + 2 * 1 and st.blocks_cached == 2 * 4 and st.blocks_free == 60 - 7 - 8
    a.release()
    b = PagedKVCache(m.config, 1, pool=pool)
    found = b.match_prefix(ids[0, :20].tolist())
    assert len(found) == 5
    b.adopt_prefix(ids[0, :20].tolist(), found)
    assert b.pos == 20 and b.freed == [0, 4, 4] and pool.blocks.hits == 5 + 2
    ref = make_cache("static", m.config, 1, "cpu", torch.float32)
    with torch.inference_mode():
        run_step(m, ref, ids[:, :20], torch.arange(20), backend="readable")
        last = [run_step(m, c, ids[:, 20:], torch.tensor([20]), backend="readable", last_only=False, hash_ids=False)
                for c in (b, ref)]
        torch.testing.assert_close(last[0], last[1], atol=1e-5, rtol=1e-5)
    pool.blocks.check()


def test_paged_truncate_refused_past_let_go_blocks_and_restore_exact() -> None:
    m = tiny()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(9))
    cache = PagedKVCache(m.config, 1, block_size=2, num_blocks=40)
    with torch.inference_mode():
        _feed(m, cache, ids[:, :13], (13,))
        # 13 positions: the sliding layers keep positions 8.. (blocks 4..6); a rollback to 12 needs
        # 8.. (the next query's window, 8..12), to 11 needs 7.. (block 3, let go)
        assert cache.freed == [0, 4, 4]
        assert cache.can_truncate(12) and not cache.can_truncate(11) and cache.can_truncate(0)
        with pytest.raises(ValueError, match="cannot roll back to 11"):
            cache.truncate(11)
        cache.truncate(12)
        # position 12's step, left uncommitted (the checkpoint drops its plan)
        before = run_step(m, cache, ids[:, 12:13], torch.tensor([12]), backend="readable", commit=False, hash_ids=False)
        cp = cache.checkpoint(12)
        _feed(m, cache, ids, (13,))  # on to 16: more blocks let go
        assert cache.freed == [0, 6, 6]
        cache.restore(cp)
        cache.commit(cp)
        assert cache.freed == [0, 4, 4] and cache.pos == 12
        again = run_step(m, cache, ids[:, 12:13], torch.tensor([12]), backend="readable", commit=False, hash_ids=False)
        torch.testing.assert_close(again, before, atol=0, rtol=0)
        ref = make_cache("static", m.config, 1, "cpu", torch.float32)
        torch.testing.assert_close(before, _feed(m, ref, ids[:, :13], (13,))[:, 12:], atol=1e-5, rtol=1e-5)
    cache.pool.blocks.check()


def test_chat_on_paged_hybrid_answers_as_a_full_cache() -> None:
    """Turns, an edit and a regenerate past the window on a paged cache answer as the concat cache."""
    from chat_fixtures import chat_model
    from kvviz.engine.sessions.conversation import Conversation

    m = chat_model(tiny(seed=3, block_size=256))
    got = {}
    for kind in ("paged", "concat"):
        conv = Conversation(m, cache=CacheSpec(kind=kind, block_size=4), max_new_tokens=6)
        turns = [conv.send("hi there"), conv.send("and more"), conv.edit(0, "edited"), conv.regenerate()]
        got[kind] = [t.generated_ids for t in turns]
        if kind == "paged":
            assert turns[1].reused_tokens > W  # the second turn appends to what the cache holds
            conv.cache.pool.blocks.check()
    assert got["paged"] == got["concat"]


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("cuts", [(1,), (8,), (3, 12), (20,)])
def test_quantized_rings_equal_the_same_quant_keeping_every_position(kv_dtype: str, cuts: tuple[int, ...]) -> None:
    """A ring of the window per sliding layer gives the logits of the same quantized store keeping
    every position (rings=False, the sliding mask hiding the old ones): each row is quantized alone,
    so the held rows are the same numbers; and holds 5 positions there instead of 30."""
    m = tiny()
    spec = kv_spec(m, kv_dtype)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ring, flat = QuantizedKVCache(m.config, spec), QuantizedKVCache(m.config, spec, rings=False)
        got, ref = _feed(m, ring, ids, cuts), _feed(m, flat, ids, cuts)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # by hand, one position of one layer, K and V: int8 16 B + an fp16 scale; int4 8 B + a scale;
    # fp8 16 B, plus its per-layer K and V fp32 scales (8 B) that do not grow
    per, fixed = {"int8": (36, 0), "int4": (20, 0), "fp8": (32, 8)}[kv_dtype]
    assert ring.layer_bytes() == [5 * per + fixed] * 2 + [30 * per + fixed] and sum(ring.layer_bytes()) == ring.bytes_used
    assert flat.layer_bytes() == [30 * per + fixed] * 3
    assert ring.layer(0)[0].shape[2] == 5 and ring.layer(2)[0].shape[2] == 30


def test_beam_search_on_the_paged_hybrid_equals_static() -> None:
    """Beams reorder the rows' tables (let-go entries included) past the window: the static ring's beams."""
    m = tiny(seed=2)
    kw = dict(prompt_ids=list(range(60, 63)), max_new_tokens=20, num_beams=3)
    assert kvviz.generate(m, **request_kwargs(cache_kind="paged", kv_block_size=2, **kw)).generated_ids == \
        kvviz.generate(m, **request_kwargs(cache_kind="static", **kw)).generated_ids


def test_quantized_ring_checkpoint_restore_is_exact_and_truncate_refused_once_overwritten() -> None:
    m = tiny()
    spec = kv_spec(m, "int4")
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(4))
    cache = QuantizedKVCache(m.config, spec)
    with torch.inference_mode():
        _feed(m, cache, ids[:, :12], (12,))
        assert not cache.can_truncate(11) and cache.can_truncate(12)
        with pytest.raises(ValueError, match="cannot roll back to 11"):
            cache.truncate(11)
        before = [t.clone() for i in range(3) for t in cache.layer(i)]
        cp = cache.checkpoint(12)
        _feed(m, cache, ids, (15,))  # a chunk and decodes that wrap the rings
        cache.restore(cp)
        cache.commit(cp)
        assert cache.pos == 12
        for a, b in zip(before, [t for i in range(3) for t in cache.layer(i)]):
            assert torch.equal(a, b)


def test_block_tables_chart_draws_each_group_and_the_blocks_let_go() -> None:
    from kvviz.charts import paged_charts as pc

    m = tiny()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(6))
    cache = PagedKVCache(m.config, 1, block_size=2, num_blocks=40)
    with torch.inference_mode():
        _feed(m, cache, ids, (12,))
    snap = cache.snapshot()
    # 12 positions, block 2: the global table 6 blocks; each sliding one lets go of blocks 0..3
    assert [g["freed"] for g in snap["groups"]] == [0, 4, 4] and snap["groups"][1]["tables"][0][:4] == [-1] * 4
    tr = pc.block_tables(snap).data[0]
    assert list(dict.fromkeys(tr.y)) == ["seq 0 · global L2", "seq 0 · sliding L0", "seq 0 · sliding L1"]
    assert list(tr.text) == [str(b) for b in cache.gtables[0][0]] + (["–"] * 4 + [str(b) for b in cache.gtables[1][0][4:]]) \
        + (["–"] * 4 + [str(b) for b in cache.gtables[2][0][4:]])
