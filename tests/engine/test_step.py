"""The step driver (kvviz/engine/core/step.py): plan, forward, commit, on every cache kind and
backend, against the readable model run by hand on a cache that needs no plan."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

from kvviz.engine.core.step import backend_forward, backend_of, run_pieces, run_step
from kvviz.engine.kvcache.factory import make_cache
from kvviz.engine.kvcache.paged_cache import PagedKVCache
from kvviz.engine.loading.loader import LoadedModel


def test_the_backend_is_chosen_in_one_place(make_llama: Callable[..., LoadedModel]) -> None:
    m = make_llama()
    assert backend_of(m) == ("fast" if m.fast is not None else "readable") and backend_of(m, False) == "readable"
    assert backend_forward(m, "readable") is m.model
    if m.fast is not None:
        assert backend_forward(m, "fast") == m.fast.forward


@pytest.mark.parametrize("kind", ["static", "concat", "paged"])
@pytest.mark.parametrize("backend", ["fast", "readable"])
def test_a_prefill_and_decode_steps_equal_the_readable_model_run_by_hand(
        make_llama: Callable[..., LoadedModel], kind: str, backend: str) -> None:
    """Each step commits (pos moves) and gives the logits the readable model gives when run by hand
    with the same steps on a static cache (which needs no plan): bit for bit when the same code
    runs (readable, static); otherwise the same maths in another order (the accelerator's C rows,
    the paged gather, a concat), so within 1e-5 of the logits' scale (~100 fp32 ulps over a few
    layers' sums), far below the top token's margin, which the argmax check holds."""
    m = make_llama(seed=4)
    ids = torch.randint(0, m.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    cache = make_cache(kind, m.config, 1, "cpu", torch.float32)
    ref = make_cache("static", m.config, 1, "cpu", torch.float32)
    with torch.inference_mode():
        got = [run_step(m, cache, ids[:, :6], torch.arange(6), backend=backend, last_only=False)]
        got += [run_step(m, cache, ids[:, t:t + 1], torch.tensor([t]), backend=backend) for t in (6, 7, 8)]
        want = [m.model(ids[:, :6], torch.arange(6), ref)]
        for t in (6, 7, 8):
            ref.advance(6 if t == 6 else 1)
            want.append(m.model(ids[:, t:t + 1], torch.tensor([t]), ref, last_only=True))
    got_t, want_t = torch.cat(got, 1), torch.cat(want, 1)
    assert cache.pos == 9
    if backend == "readable" and kind == "static":
        assert torch.equal(got_t, want_t)
    scale = float(want_t.abs().max())
    torch.testing.assert_close(got_t, want_t, atol=1e-5 * scale, rtol=0.0)
    assert torch.equal(got_t.argmax(-1), want_t.argmax(-1))


def test_a_failed_forward_gives_the_planned_blocks_back(make_llama: Callable[..., LoadedModel]) -> None:
    """An id past the embedding table fails inside the forward, after the plan claimed blocks: the
    step aborts, so the tables, ref counts and position are as before it."""
    m = make_llama()
    cache = PagedKVCache(m.config, block_size=4, num_blocks=8)
    with torch.inference_mode():
        run_step(m, cache, torch.tensor([[1, 2, 3]]), torch.arange(3))
        tables, refs = [list(t) for t in cache.tables], list(cache.pool.blocks.ref_count)
        for backend in ("fast", "readable"):
            with pytest.raises(IndexError):
                run_step(m, cache, torch.tensor([[1] * 5 + [m.config.vocab_size]]), torch.arange(3, 9),
                         backend=backend)  # (1, 6): 3 + 6 positions need two more blocks
            assert cache.tables == tables and cache.pool.blocks.ref_count == refs and cache.pos == 3
    cache.pool.blocks.check()


@pytest.mark.parametrize("hash_ids", [True, False])
def test_hash_ids_decides_whether_a_step_is_offered_for_prefix_reuse(make_llama: Callable[..., LoadedModel],
                                                                     hash_ids: bool) -> None:
    m = make_llama()
    cache = PagedKVCache(m.config, block_size=4, num_blocks=8)
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    with torch.inference_mode():
        run_step(m, cache, torch.tensor([ids]), torch.arange(9), hash_ids=hash_ids)
    other = PagedKVCache(m.config, pool=cache.pool)
    assert other.match_prefix(ids) == (cache.tables[0][:2] if hash_ids else [])  # two full blocks of 4


def test_commit_false_leaves_the_commit_to_the_caller(make_llama: Callable[..., LoadedModel]) -> None:
    m = make_llama()
    cache = PagedKVCache(m.config, block_size=4, num_blocks=8)
    with torch.inference_mode():
        run_step(m, cache, torch.tensor([[1, 2, 3]]), torch.arange(3), commit=False)
        assert cache.pos == 0 and len(cache.tables[0]) == 1  # planned (a block claimed), written, not committed
        cache.abort_step()
    assert cache.pos == 0 and cache.tables[0] == [] and len(cache.pool.blocks.free) == 8


def test_pieces_on_a_full_window_equal_one_token_at_a_time(make_llama: Callable[..., LoadedModel]) -> None:
    """A window cache that is full takes one token per forward: run_pieces feeds 6 tokens as 6
    committed steps, the same float operations as feeding them one by one (so equal exactly)."""
    from kvviz.engine.generation.kv_spec import KVSpec, resolve

    m = make_llama(seed=6)
    spec = resolve(KVSpec(window=4, sinks=1), "llama", m.config.head_dim, m.config.block_size)
    ids = torch.randint(0, m.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(7))
    a = make_cache("static", m.config, 1, "cpu", torch.float32, kv=spec)
    b = make_cache("static", m.config, 1, "cpu", torch.float32, kv=spec)
    with torch.inference_mode():
        run_step(m, a, ids[:, :5], torch.arange(5))  # window 4 + 1 sink: full
        run_step(m, b, ids[:, :5], torch.arange(5))
        assert a.max_feed() == 1
        got = run_pieces(m, a, ids[:, 5:], torch.arange(5, 12))
        for t in range(5, 12):
            want = run_step(m, b, ids[:, t:t + 1], torch.tensor([t]))
    assert a.pos == b.pos == 12 and torch.equal(got, want)
