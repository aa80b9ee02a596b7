"""The flat one-token decode step (kvviz.decode) against the float64 reference and the module path."""
from __future__ import annotations

from typing import Callable

import pytest
import torch

import kvviz.model
from kvviz.cache import ConcatKVCache, StaticKVCache
from kvviz.checkpoints import LoadedModel
from kvviz.decode import build_plan, plan_for
from kvviz.model import ForwardCapture
from test_model import KV_HEADS, reference_forward


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the forwards that took the flat decode step."""
    calls: list[int] = []
    real = kvviz.model.decode_step
    monkeypatch.setattr(kvviz.model, "decode_step", lambda *a: calls.append(1) or real(*a))
    return calls


def _biased(m: LoadedModel, seed: int) -> LoadedModel:
    """Non-zero biases and LayerNorm parameters (the GPT-2 init makes them 0 and 1, which would
    leave the split accumulators untested), then freeze() again to rebuild the derived copies."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.gpt.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    m.gpt.freeze()
    return m


def _decode_all(m: LoadedModel, idx: torch.Tensor, cache_cls: type) -> torch.Tensor:
    """Feed idx (B, T) one token at a time from an empty cache; logits (B, T, V)."""
    B, T = idx.shape
    cache = cache_cls(m.config, batch=B, dtype=m.dtype)
    out = []
    with torch.inference_mode():
        for t in range(T):
            out.append(m.gpt(idx[:, t:t + 1], cache=cache))  # (B, 1, V)
            cache.advance(1)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("threads", [1, 2, 4], indirect=True)
@pytest.mark.parametrize("kind", list(KV_HEADS))
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("cache_cls", [StaticKVCache, ConcatKVCache])
def test_token_by_token_decode_matches_float64_reference(
    make_model: Callable[..., LoadedModel], threads: int, kind: str, batch: int, cache_cls: type,
    spy: list[int],
) -> None:
    """Every position decoded alone (the first one into an empty cache) equals the reference.

    Two and four threads take the chained column/row splits (batch 1); batch 2 and one thread go
    through row_matmul: all of them through the flat step.
    """
    m = _biased(make_model(n_kv_head=KV_HEADS[kind], seed=7), 7)
    assert plan_for(m.gpt).split == (threads > 1)  # every width of SMALL divides by 2 and by 4
    idx = torch.randint(0, 256, (batch, 20), generator=torch.Generator().manual_seed(8))
    got = _decode_all(m, idx, cache_cls)
    assert len(spy) == 20  # the flat step ran for every token, not the module path
    ref, _, _ = reference_forward(m.gpt, idx)
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("bias", [True, False])
def test_flat_step_equals_module_path(make_model: Callable[..., LoadedModel], bias: bool, threads: int,
                                      spy: list[int]) -> None:
    """Same cache state, same token: the flat step and the nn.Module path agree (grads on = modules)."""
    m = make_model(bias=bias, seed=3, vocab_size=101)  # an odd vocabulary: the head copy is padded
    m = _biased(m, 3) if bias else m
    assert m.gpt.decode_plan is not None and plan_for(m.gpt).split == (threads == 2)  # bias-free splits too
    idx = torch.randint(0, 101, (1, 12), generator=torch.Generator().manual_seed(4))
    cache = StaticKVCache(m.config)
    with torch.inference_mode():
        m.gpt(idx[:, :11], cache=cache)
        cache.advance(11)
        flat = m.gpt(idx[:, 11:], cache=cache)  # (1, 1, 101)
    assert len(spy) == 1 and flat.shape == (1, 1, 101)
    with torch.enable_grad():
        modules = m.gpt(idx[:, 11:], cache=cache)  # grads on: the module path
    assert len(spy) == 1
    torch.testing.assert_close(flat, modules.detach(), atol=1e-5, rtol=1e-5)


def test_captures_from_the_flat_step_are_the_cache_contents(make_model: Callable[..., LoadedModel]) -> None:
    m = make_model(n_kv_head=2, seed=5)
    idx = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(6))
    cache = StaticKVCache(m.config)
    with torch.inference_mode():
        m.gpt(idx[:, :8], cache=cache)
        cache.advance(8)
        fc = ForwardCapture(frozenset({1}))
        m.gpt(idx[:, 8:], cache=cache, capture=fc)
    k, v = cache.k[1][:, :, :9], cache.v[1][:, :, :9]
    assert set(fc.k) == {1} and torch.equal(fc.k[1], k) and torch.equal(fc.v[1], v)
    assert fc.q_last[1].shape == (1, m.config.n_head, 1, m.config.head_dim)
    _, _, kvs = reference_forward(m.gpt, idx)
    torch.testing.assert_close(k.double(), kvs[1][0], atol=1e-5, rtol=1e-5)  # (1, nkv, 9, hs)


def test_half_precision_decode_stays_close(make_model: Callable[..., LoadedModel]) -> None:
    m = make_model(seed=2, dtype=torch.bfloat16)
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(3))
    got = _decode_all(m, idx, StaticKVCache)
    ref, _, _ = reference_forward(m.gpt, idx)
    assert float((got.double() - ref).abs().max()) < 0.05 * float(ref.abs().max())


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_plan_views_the_weights_and_follows_the_thread_count(make_model: Callable[..., LoadedModel],
                                                           threads: int) -> None:
    m = make_model(seed=1)
    gpt = m.gpt
    plan = plan_for(gpt)
    assert plan.threads == 2 and plan.split
    fc, proj = plan.layers[0].c_fc, plan.layers[0].c_proj
    assert fc.split is not None and proj.split is not None
    w_fc, w_proj = gpt.transformer.h[0].mlp.c_fc.weight, gpt.transformer.h[0].attn.c_proj.weight
    assert fc.split.blocks.shape == (2, 32, 64) and not fc.split.by_rows  # (s, in, out/s): columns
    assert proj.split.blocks.shape == (2, 16, 32) and proj.split.by_rows  # (s, in/s, out): rows
    for split, w in ((fc.split, w_fc), (proj.split, w_proj)):
        assert split.blocks.data_ptr() == w.data_ptr()  # views: no second copy of the weights
    torch.testing.assert_close(torch.cat(list(fc.split.blocks), dim=1), w_fc.detach(), atol=0, rtol=0)
    torch.testing.assert_close(torch.cat(list(proj.split.blocks), dim=0), w_proj.detach(), atol=0, rtol=0)
    # The row split's accumulator holds the bias once: its blocks sum to it.
    torch.testing.assert_close(proj.split.acc.sum(0)[0], gpt.transformer.h[0].attn.c_proj.bias.detach())
    torch.set_num_threads(1)
    one = plan_for(gpt)
    assert one.threads == 1 and not one.split and one.layers[0].c_fc.split is None  # rebuilt
    three = build_plan(gpt, 3)  # 96 columns split in 3, 128 do not: plain GEMMs for the step
    assert three.layers[0].c_attn.split is not None and three.layers[0].c_fc.split is None
    assert not three.split


def test_training_and_unfrozen_models_take_the_module_path(make_model: Callable[..., LoadedModel],
                                                         spy: list[int]) -> None:
    m = make_model(seed=6)
    gpt = m.gpt
    cache = StaticKVCache(m.config)
    tok = torch.tensor([[3]])
    gpt.train()
    try:
        with torch.inference_mode():
            gpt(tok, cache=cache)
    finally:
        gpt.eval()
    assert not spy
    with torch.inference_mode():
        gpt(tok, cache=cache)
    assert len(spy) == 1


@pytest.mark.parametrize("threads", [2], indirect=True)
def test_bias_changed_in_place_without_freeze_is_picked_up(make_model: Callable[..., LoadedModel],
                                                           threads: int) -> None:
    """The row splits copy their biases; an in-place load (no new freeze()) must not leave them stale."""
    m = make_model(seed=9)
    idx = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(9))
    before = plan_for(m.gpt)
    g = torch.Generator().manual_seed(10)
    with torch.no_grad():  # what load_state_dict does: copy_ into the existing parameters
        for name, p in m.gpt.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    assert before.stale()
    got = _decode_all(m, idx, StaticKVCache)
    assert m.gpt.decode_plan is not before and not m.gpt.decode_plan.stale()  # rebuilt
    ref, _, _ = reference_forward(m.gpt, idx)
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=1e-5)
